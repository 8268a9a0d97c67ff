"""Exit decisions on the device (looptrace.online.device_rules).

- The bound: on random states (d_model 2048; float16 / bfloat16 / float32 rounding; scales 1e-3..1e3) and gate
  logits (−40..40), the device's float64 values lie within their bound e of numpy's (the functions that wrote
  token_loop.parquet), and e is tiny (≤ 1e-11 relative, so a decision is practically always certain).
- Decoding: for every built-in rule that runs online, batch 1 and 8, share and recompute, free and teacher-forced,
  the lookahead path with device rules gives the host path's tokens, exit depths and log-probs bit for bit (and
  today's per-loop path's tokens and depths), at thresholds between observed values and at thresholds *equal* to
  an observed value (ties: float32 signals compare equal to τ32; q_exit's float64 CDF equal to its threshold is
  never certain, so the position is redone on the host — counted, and still exact).
- Forced uncertainty (the bound inflated): positions are redone and the result is still the host path's.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import looptrace.online.device_rules as DR
from looptrace.models.decoders import decoder_for
from looptrace.online.device_rules import device_rule
from looptrace.online.engine import OnlineRule, RegistryRule
from looptrace.online.generate import decode_tokens
from looptrace.online.lookahead import decode_tokens_lookahead
from looptrace.rules.builtin import ALL_RULES, BUILTIN_RULES
from looptrace.signals.halting import HaltingCDF
from looptrace.signals.steps import StepSignals
from tests.test_generate import own_model, prompts_of

torch.set_num_threads(1)

#: every built-in rule that runs online (the oracle does not)
ONLINE = [n for n in ALL_RULES if BUILTIN_RULES[n].online is not None]


class _Recorder(OnlineRule):
    """Never fires; records the host rule's signal (the value it compares) after every loop."""

    def __init__(self, inner: RegistryRule, out: list):
        super().__init__("rec", 0.0, "ge")
        self.inner, self.out = inner, out
        self.needs_logits = inner.needs_logits

    def reset(self, model, h0):
        self.inner.reset(model, h0)

    def fires(self, t, h, z, model):
        s = self.inner.signal(t, h, z, model)
        if t >= self.inner.min_loop:
            self.out.append(s.reshape(-1).cpu().numpy())
        return torch.zeros(h.shape[:-1], dtype=torch.bool)


def _observed(dec, p, N, name) -> np.ndarray:
    """The host rule's signal values on the first decoded position (every loop the rule reads), sorted unique."""
    vals: list = []
    decode_tokens(dec, p[:, :], 1, _Recorder(RegistryRule(name, 0.0, "float32"), vals))
    v = np.unique(np.concatenate(vals))
    return v[np.isfinite(v)]


def _same(a, b, logprob=True):
    assert np.array_equal(a.tokens, b.tokens), (a.tokens, b.tokens)
    assert np.array_equal(a.exit_depth, b.exit_depth), (a.exit_depth, b.exit_depth)
    if logprob:
        assert np.array_equal(a.logprob, b.logprob)


def test_every_default_rule_with_a_host_signal_has_a_device_form():
    have = {n for n in ONLINE if device_rule(RegistryRule(n, 0.5, "float16")) is not None}
    assert {"entropy", "top1", "margin", "kl_prev", "kl_prev_rev", "logit_change", "hidden_change", "rel_step",
            "state_cosine", "q_exit"} <= have
    assert not have & {"argmax_stable", "accel_two_hit", "fixed"}  # host forms (no per-loop host signal / two-hit)
    assert device_rule(None) is None


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_step_values_within_their_bound_of_numpy(dtype):
    g = torch.Generator().manual_seed(3)
    B, D, T = 64, 2048, 6
    for name, sig in (("rel_step", "rel_step"), ("hidden_change", "step_norm"), ("state_cosine", "state_cos_dist")):
        r = device_rule(RegistryRule(name, 0.1, dtype))
        scale = torch.logspace(-3, 3, B, dtype=torch.float64)[:, None, None]
        hs = [(torch.randn(B, 1, D, generator=g, dtype=torch.float64) * scale).float() for _ in range(T + 1)]
        for t in range(1, T + 1):  # states that converge: h_t = h_{t−1} + shrinking steps
            hs[t] = hs[t - 1] + hs[t] * 0.3 ** t
        hs[2][5] = hs[1][5]  # a zero step
        hs[3][7] = 0.0  # a zero state (NaN ratios)
        r.reset(None, hs[0])
        ref = StepSignals(r._rounded(hs[0]).numpy(), (sig,))
        for t in range(1, T + 1):
            v, e = r.values(hs[t])
            want = ref.update(r._rounded(hs[t]).numpy())[sig]
            v, e = v.numpy(), e.numpy()
            assert np.array_equal(np.isnan(v), np.isnan(want))
            ok = ~np.isnan(want)
            assert (np.abs(v - want)[ok] <= e[ok]).all()
            assert (e[ok] <= 1e-11 * np.maximum(np.abs(want[ok]), 1.0)).all()
            if sig != "state_cos_dist":  # a relative bound: the float32 values (as stored) agree here; (1 − cos near
                # 0 has an absolute one: its float32 values can differ, which the certificate sees)
                assert np.array_equal(v.astype(np.float32), want.astype(np.float32), equal_nan=True)


def test_q_exit_values_within_their_bound_of_numpy():
    r = device_rule(RegistryRule("q_exit", 0.5, "float16"))
    g = torch.Generator().manual_seed(4)
    B, T = 512, 8
    logits = (torch.rand(B, T, generator=g, dtype=torch.float64) * 80 - 40).float()
    logits[:8] = torch.tensor([0.0, -0.0, 1e-8, -1e-8, 30.0, -30.0, 5.0, -5.0])[:, None]
    r.reset(None, None)
    ref = HaltingCDF()
    for t in range(1, T + 1):
        v, e = r.values(t, logits[:, t - 1].reshape(B, 1))
        want = ref.update(logits[:, t - 1].reshape(B, 1).numpy())
        assert (np.abs(v.numpy() - want) <= e.numpy()).all()
        assert (e.numpy() <= 1e-11 * (np.abs(ref._sum) + 1)).all()  # relative to the log-space sum S_t


def _check_rule(dec, p, N, name, thr, hidden_dtype="float32"):
    def rule():
        return RegistryRule(name, thr, hidden_dtype)

    host = decode_tokens_lookahead(dec, p, N, rule(), device_rules=False)
    new = decode_tokens_lookahead(dec, p, N, rule())
    _same(new, host)
    _same(new, decode_tokens(dec, p, N, rule()), logprob=p.shape[0] == 1)  # today's default path
    forced = torch.from_numpy((host.tokens + 1) % 11)
    _same(decode_tokens_lookahead(dec, p, N, rule(), force=forced),
          decode_tokens_lookahead(dec, p, N, rule(), force=forced, device_rules=False))
    return new


@pytest.mark.parametrize("policy", ["share", "recompute"])
def test_device_rules_decode_as_the_host(policy):
    m = own_model(T=5)
    N = 4
    depths, redone = set(), {}
    for B in (1, 8):
        p = prompts_of(B=B, S=3, lo=3, hi=11, seed=7)
        dec = decoder_for(m, policy)
        for name in ONLINE:
            v = _observed(dec, p, N, name)
            mids = (v[:-1] + v[1:]) / 2 if len(v) > 1 else v
            ties = v[[len(v) // 4, len(v) // 2, (3 * len(v)) // 4]]  # thresholds equal to observed values
            for thr in (*mids[[len(mids) // 3, (2 * len(mids)) // 3]], *ties):
                r = _check_rule(dec, p, N, name, float(thr))
                depths |= set(np.unique(r.exit_depth).tolist())
                redone[name] = redone.get(name, 0) + r.redone
    assert min(depths) < 5 and len(depths) >= 3
    assert redone["q_exit"] > 0  # float64 ties are never certain: the host decided them
    assert all(redone[n] == 0 for n in redone if n != "q_exit"), redone


def test_bfloat16_rounding_of_step_rules():
    m = own_model(T=5)
    dec = decoder_for(m, "share")
    p = prompts_of(B=8, S=3, lo=3, hi=11, seed=9)
    for name in ("rel_step", "state_cosine"):
        vals: list = []
        decode_tokens(dec, p, 1, _Recorder(RegistryRule(name, 0.0, "bfloat16"), vals))
        v = np.unique(np.concatenate(vals))
        v = v[np.isfinite(v)]
        for thr in v[[len(v) // 3, len(v) // 2]]:
            _check_rule(dec, p, 4, name, float(thr), "bfloat16")


def test_forced_uncertainty_redoes_positions_exactly(monkeypatch):
    """With the bound inflated (u = 1e-3) most decisions near the threshold are uncertain: the positions are redone
    on the host, and the result is still the host path's."""
    monkeypatch.setattr(DR, "_U", 1e-3)
    m = own_model(T=5)
    dec = decoder_for(m, "share")
    p = prompts_of(B=8, S=3, lo=3, hi=11, seed=7)
    total = 0
    for name in ("rel_step", "q_exit"):
        v = _observed(dec, p, 4, name)
        r = _check_rule(dec, p, 4, name, float(v[len(v) // 2]))
        total += r.redone
    assert total > 0
