"""Decoding without a host round trip per loop (looptrace.online.lookahead, issue 28 item 2).

- Exactness: the lookahead path gives the tokens, exit depths and log-probs of the per-loop path with masking
  (``compact=False``) bit for bit, and the tokens and depths of the default compaction (log-probs too at batch 1),
  for top1, entropy, rel_step and q_exit at batch 1 and 8, policies share and recompute, free and teacher-forced,
  on looptrace's own model (with a halting gate for q_exit) and the Dory stand-in.
- Synchronisation: counting every tensor method that reads a value to the host (``item``, ``__bool__``, ``cpu``,
  ``tolist``, ``numpy``, ``nonzero``, ...), the lookahead path does a fixed number per generated token whatever the
  loops run — derived below from what it must read (each position's exit depths once, to group rows for the KV
  policy; the three results at the end; the stop flags' host view once) — while the per-loop path's count grows
  with the loops (so the counter does see its reads).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from looptrace.models.adapters.loading import AdapterConfig, load_adapter
from looptrace.models.decode import DecodeUnsupported
from looptrace.models.decoders import decoder_for
from looptrace.online.engine import RegistryRule
from looptrace.online.generate import decode_tokens
from looptrace.online.lookahead import decode_tokens_lookahead
from tests import hf_helpers as H
from tests.test_generate import HandRule, _thresholds, own_model, prompts_of

torch.set_num_threads(1)

RULES = {"top1": "max_prob", "entropy": "entropy", "rel_step": "rel_step"}


@pytest.fixture(scope="module")
def dory(tmp_path_factory):
    return load_adapter(AdapterConfig("dory", str(H.build_dory(tmp_path_factory.mktemp("lookahead") / "dory"))))


def _q_threshold(dec, p, N) -> float:
    """A q_exit threshold at which the rows exit at several depths (the per-loop path decides)."""
    best, most = 0.5, 0
    for thr in (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9):
        d = decode_tokens(dec, p, N, RegistryRule("q_exit", thr, "float32")).exit_depth
        if len(np.unique(d)) > most:
            best, most = thr, len(np.unique(d))
    return best


def _assert_same(a, b, logprob: bool = True) -> None:
    assert np.array_equal(a.tokens, b.tokens) and np.array_equal(a.exit_depth, b.exit_depth)
    if logprob:
        assert np.array_equal(a.logprob, b.logprob)


@pytest.mark.parametrize("policy", ["share", "recompute"])
@pytest.mark.parametrize("kind", ["own", "dory"])
def test_lookahead_equals_the_per_loop_path(dory, kind, policy):
    model = own_model(T=5) if kind == "own" else dory
    N = 5
    rules = [*RULES] + (["q_exit"] if kind == "own" else [])
    seen_depths = set()
    for B in (1, 8):
        p = prompts_of(B=B, S=3, lo=3, hi=11 if kind == "own" else 250, seed=2)
        dec = decoder_for(model, policy)
        T = dec.n_loops
        for name in rules:
            thr = _q_threshold(dec, p, N) if name == "q_exit" else _thresholds(dec, p, N, RULES[name])

            def rule(name=name, thr=thr):
                return RegistryRule(name, thr, "float32")

            ref = decode_tokens(dec, p, N, rule())
            masked = decode_tokens(dec, p, N, rule(), compact=False)
            new = decode_tokens(dec, p, N, rule(), lookahead=True)
            _assert_same(new, masked)
            _assert_same(new, ref, logprob=B == 1)
            forced_tok = torch.from_numpy((ref.tokens + 1) % 11)
            _assert_same(decode_tokens(dec, p, N, rule(), force=forced_tok, lookahead=True),
                         decode_tokens(dec, p, N, rule(), force=forced_tok, compact=False))
            seen_depths |= set(np.unique(ref.exit_depth).tolist())
        full = decode_tokens(dec, p, N, None)
        _assert_same(decode_tokens(dec, p, N, None, lookahead=True), full)
    assert min(seen_depths) < T and len(seen_depths) >= 3  # early exits at several depths were exercised


def test_lookahead_hand_set_depths_and_speculative_loops():
    """Hand-set exit depths (all rows early: the speculative loop runs and is discarded; a row at T; mixed):
    depths as set, tokens as the per-loop path's, and the loops run = per position max depth + 1 speculative
    loop when every row exited before T (× batch: masking)."""
    m = own_model(T=4)
    B, N, T = 3, 4, 4
    p = prompts_of(B=B, S=3, seed=5)
    depth = torch.tensor([[1, 2, 4, 2], [1, 1, 3, 4], [2, 1, 1, 4]])
    for policy in ("share", "recompute"):
        dec = decoder_for(m, policy)
        new = decode_tokens(dec, p, N, HandRule(depth), lookahead=True)
        ref = decode_tokens(dec, p, N, HandRule(depth), compact=False)
        assert np.array_equal(new.exit_depth, depth.numpy())
        _assert_same(new, ref)
        dmax = depth.max(dim=0).values.tolist()  # [2, 2, 4, 4]
        loops = sum(B * (d + 1 if d < T else T) for d in dmax)
        skipped = int((T - depth).sum()) if policy == "recompute" else 0
        assert new.row_loops == loops + skipped


def test_lookahead_refuses_lockstep_native(tmp_path):
    ouro = load_adapter(AdapterConfig("ouro", str(H.build_ouro(tmp_path / "ouro")), trust_remote_code=True))
    with pytest.raises(DecodeUnsupported, match="lookahead"):
        decode_tokens(decoder_for(ouro, "native"), prompts_of(B=1, S=2, lo=3, hi=250), 2, None, lookahead=True)


_READS = ("item", "__bool__", "cpu", "tolist", "numpy", "nonzero", "__int__", "__float__", "__index__", "any_",
          "unique", "__len__", "__iter__")


def _count_reads(monkeypatch) -> dict[str, int]:
    counts: dict[str, int] = {}
    for name in _READS:
        orig = getattr(torch.Tensor, name, None)
        if orig is None:
            continue

        def wrapped(self, *a, __orig=orig, __name=name, **k):
            counts[__name] = counts.get(__name, 0) + 1
            return __orig(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, wrapped)
    return counts


@pytest.mark.parametrize("rule_name", ["top1", "entropy", "rel_step", "q_exit", "hand"])
def test_lookahead_reads_the_host_a_fixed_number_of_times_per_token(monkeypatch, rule_name):
    """Per generated token: 1 read (the position's exit depths, ``tolist``; and the KV cache's share reads its
    row list, a host tensor, for keys and values, per exit-depth group); per decode: 3 ``cpu`` + 3 ``numpy``
    (the results) + 1 ``numpy`` (the stop flags' host view). Nothing per loop: the same count at T = 3 and 8, for
    the rules decided on the device too (looptrace.online.device_rules: ``entropy`` without its finiteness read,
    ``rel_step`` and ``q_exit`` in float64 torch; no position redone). With ``device_rules=False`` ``entropy``'s
    signal reads one flag per evaluation (``_all_finite``, the dump's fast-path check in signals/logits.py)."""
    N = 4
    for T in (3, 8):
        m = own_model(T=T)
        for B in (1, 8):
            p = prompts_of(B=B, S=3, seed=1)
            dec = decoder_for(m, "share")
            if rule_name == "hand":
                depth = torch.randint(1, T + 1, (B, N), generator=torch.Generator().manual_seed(T))
                depth[:, 0] = T  # a position that runs every loop

                def rule(depth=depth):
                    return HandRule(depth)
            else:
                thr = (_q_threshold(dec, p, N) if rule_name == "q_exit"
                       else _thresholds(dec, p, N, RULES[rule_name]))

                def rule(thr=thr):
                    return RegistryRule(rule_name, thr, "float32")
            with monkeypatch.context() as mp:
                counts = _count_reads(mp)
                r = decode_tokens(dec, p, N, rule(), lookahead=True)
            # share's row loop reads its (host) row list for the keys and for the values, once per early-exit group
            # that is not the whole batch
            groups = sum(sum(1 for dd in np.unique(r.exit_depth[:, n]) if dd < T and (r.exit_depth[:, n] == dd).sum() < B)
                         for n in range(N))
            want = {"tolist": N + 2 * groups, "cpu": 3, "numpy": 3 + 1}
            assert counts == want, (T, B, counts)
            assert r.redone == 0
            if rule_name == "entropy":  # the host form: the signal's own finiteness check (signals/logits.py), per
                # rule evaluation: loops 1..d_max of each position (the last loop forces the exit without the rule)
                with monkeypatch.context() as mp:
                    counts = _count_reads(mp)
                    r = decode_tokens_lookahead(dec, p, N, rule(), device_rules=False)
                want["__bool__"] = int(np.minimum(r.exit_depth.max(axis=0), T - 1).sum())
                assert counts == want, (T, B, counts)
            assert r.exit_depth.max() <= T
            with monkeypatch.context() as mp:
                counts_old = _count_reads(mp)
                old = decode_tokens(dec, p, N, rule())
            per_loop = sum(counts_old.values()) - sum(want.values())
            assert per_loop >= int(old.exit_depth.max(axis=0).sum()) - N  # ≥ one read per loop run after the first
