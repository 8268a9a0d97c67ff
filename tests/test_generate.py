"""Generation-time early exit (docs/generate.md): loop-by-loop decoding with a per-(loop, layer) KV cache.

- Full depth (no rule, or a rule that never fires) with policy ``recompute`` (and ``share``, and the model's own
  cache) reproduces greedy decoding with the model's own uncached forward, on looptrace's model and on the Dory,
  Ouro and Huginn stand-ins (and a retrofitted Llama).
- Policy ``share`` on a hand-computed case: token 1 exits at loop 1 of T = 3; token 2's attention at loops 2–3
  sees token 1's loop-1 keys/values (explicit attention maths on the model's weights); on Huginn, ``share`` equals
  Huginn's own ``latest-m4`` lookup (a cache written here from REPORT §6.2's description).
- Per-row exits in a batch of 8 (compaction, and masking) equal running each row alone.
- Decode-time signals are the offline functions' values on the same states, bit for bit, and the online exit
  equals the offline ``exit_depths`` on them.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from looptrace.models.decode import DecodeUnsupported
from looptrace.models.decoders import decoder_for
from looptrace.models.kv import CODA, LOOP, PRELUDE, LoopKVCache
from looptrace.models.looped import GroupConfig, LoopedTransformer, ModelConfig
from looptrace.online.engine import OnlineRule, RegistryRule
from looptrace.online.generate import decode_tokens, prefix_agreement
from looptrace.online.signals import LiveSignals
from looptrace.rules.registry import get_rule, loop_signals
from looptrace.rules.scoring import exit_depths
from looptrace.signals.logits import logit_stats
from looptrace.signals.steps import step_metrics
from tests import hf_helpers as H

torch.set_num_threads(1)


def own_model(T: int = 4, n_layer: int = 2, prelude: int = 1, coda: int = 1, gate: str = "linear", seed: int = 1,
              groups=None, vocab: int = 11, d: int = 16) -> LoopedTransformer:
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=vocab, block_size=24, d_model=d, n_head=2, n_prelude=prelude, n_coda=coda,
                      groups=tuple(groups) if groups else (GroupConfig(n_layer, T),), gate=gate)
    return LoopedTransformer(cfg).eval()


def assert_full_depth_decode_exact(m, policy: str, p: torch.Tensor, N: int, ref: np.ndarray) -> None:
    """Decoding at full depth (no rule, or one that never fires) gives the uncached greedy tokens ``ref`` and, at
    each generated token, the uncached forward's last-loop log-probability (used for loop memory too)."""
    for rule in (None, Never("never", 0.0, "ge")):
        r = decode_tokens(decoder_for(m, policy), p, N, rule)
        assert np.array_equal(r.tokens, ref) and (r.exit_depth == m.n_loops).all()
    ids = torch.cat([p, torch.from_numpy(ref)], dim=1)
    with torch.inference_mode():
        lp = torch.log_softmax(m(ids).logits[:, :, -1].double(), -1)
    want = lp[:, p.shape[1] - 1:-1].gather(2, torch.from_numpy(ref)[..., None]).squeeze(-1).numpy()
    np.testing.assert_allclose(r.logprob, want, rtol=0, atol=1e-5)


class Never(OnlineRule):
    """Reads the readout every loop (so the decode path pays for it) and never fires."""

    def fires(self, t, h, z, model):
        return torch.zeros(h.shape[:2], dtype=torch.bool, device=h.device)


class HandRule(OnlineRule):
    """Fires at hand-set exit loops: ``depth[n]`` for the n-th decoded position of every row (a [B, N] table),
    following the engine's compaction."""

    needs_logits = False

    def __init__(self, depth: torch.Tensor):
        super().__init__("hand", 0.0, "ge")
        self.depth, self.n = depth, -1

    def reset(self, model, h0):
        self.n += 1
        self.state = {"d": self.depth[:, self.n].reshape(-1, 1).clone()}

    def fires(self, t, h, z, model):
        d = self.state["d"]
        assert d.shape == h.shape[:2]
        return d == t


def greedy(forward, prompts: torch.Tensor, n: int) -> np.ndarray:
    """Greedy decoding with an uncached forward ``forward(ids) -> last-position logits``."""
    ids, out = prompts.clone(), []
    with torch.inference_mode():
        for _ in range(n):
            tok = forward(ids).argmax(-1)
            out.append(tok)
            ids = torch.cat([ids, tok[:, None]], dim=1)
    return torch.stack(out, dim=1).numpy()


def prompts_of(B: int = 3, S: int = 4, hi: int = 11, lo: int = 0, seed: int = 0) -> torch.Tensor:
    return torch.randint(lo, hi, (B, S), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------- the cache

def test_loop_kv_cache_layout_rows_windows_and_share():
    kv = LoopKVCache(batch=3, max_len=5, n_loops=3, n_layers=2, n_prelude=1, n_coda=1, windows={(LOOP, 1): 2})
    assert [kv.slot(LOOP, t, j) for t in range(3) for j in range(2)] == list(range(6))
    with pytest.raises(IndexError):
        kv.slot(LOOP, 3, 0)

    def kv_of(val, b=3, q=1):
        x = torch.full((b, 2, q, 4), float(val))
        return x, -x

    for p in range(3):  # positions 0..2, every slot, all rows: value = 100 * slot + 10 * pos
        kv.pos = p
        for t in range(3):
            for j in range(2):
                K, V = kv.update(LOOP, (t, j), *kv_of(100 * (2 * t + j) + 10 * p))
                assert K.shape[2] == (min(2, p + 1) if j == 1 else p + 1)  # layer 1: a window of 2
        kv.update(PRELUDE, (0,), *kv_of(-1))
        kv.update(CODA, (0,), *kv_of(-2))
    # a compacted call: rows [2, 0] write position 3 of slot (1, 0) and read theirs back
    kv.pos, kv.rows = 3, torch.tensor([2, 0])
    k = torch.stack([torch.full((2, 1, 4), 7.0), torch.full((2, 1, 4), 9.0)])
    K, V = kv.update(LOOP, (1, 0), k, -k)
    assert K.shape == (2, 2, 4, 4) and K[0, 0, 3, 0] == 7 and K[1, 0, 3, 0] == 9 and K[0, 0, 1, 0] == 210
    assert kv.entry(LOOP, 1, 0, row=1, pos=3)[0].abs().sum() == 0  # row 1 untouched
    # share: row 2, position 3 exited after loop 0 (0-based) -> loops 1, 2 get its loop-0 keys/values
    kv.rows = None
    for j in range(2):
        kv.update(LOOP, (0, j), *kv_of(555 + j))
    kv.share(torch.tensor([2]), 0)
    for t in (1, 2):
        for j in range(2):
            k2, v2 = kv.entry(LOOP, t, j, row=2, pos=3)
            assert (k2 == 555 + j).all() and (v2 == -(555 + j)).all()
    assert kv.entry(LOOP, 2, 0, row=1, pos=3)[0].abs().sum() == 0  # other rows keep theirs
    assert (kv.entry(LOOP, 2, 0, row=2, pos=2)[0] == 100 * 4 + 20).all()  # other positions too


# ---------------------------------------------------------------------------------------------- exactness

@pytest.mark.parametrize("policy", ["share", "recompute"])
@pytest.mark.parametrize("groups", [None, (GroupConfig(1, 2), GroupConfig(2, 2))])
def test_own_model_full_depth_equals_uncached_greedy(policy, groups):
    m = own_model(groups=groups)
    p, N = prompts_of(), 6
    ref = greedy(lambda ids: m(ids).logits[:, -1, -1], p, N)
    if groups and policy == "share":
        with pytest.raises(DecodeUnsupported, match="looped groups"):
            decoder_for(m, policy)
        return
    assert_full_depth_decode_exact(m, policy, p, N, ref)
    with pytest.raises(DecodeUnsupported, match="no KV policy of its own"):
        decoder_for(m, "native")


def test_own_model_decode_logits_equal_the_forward_at_every_loop():
    """Without a coda, the readout of loop t while decoding equals the full forward's at loop t (recompute, no
    exit): the cache holds exactly full depth's keys/values."""
    m = own_model(coda=0)
    p = prompts_of(B=2, S=3)
    trace: list = []
    r = decode_tokens(decoder_for(m, "recompute"), p, 4, Never("never", 0.0, "ge"), trace=trace)
    ids = torch.cat([p, torch.from_numpy(r.tokens)], dim=1)
    with torch.inference_mode():
        z = m(ids).logits  # [B, S, T, V]
    for n, t, rows, _h, zt in trace:
        if t >= 0:
            torch.testing.assert_close(zt[:, 0], z[rows, p.shape[1] - 1 + n, t], rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def standins(tmp_path_factory):
    from looptrace.models.adapters.loading import AdapterConfig, load_adapter

    root = tmp_path_factory.mktemp("standins")
    out = {
        "dory": load_adapter(AdapterConfig("dory", str(H.build_dory(root / "dory")))),
        "ouro": load_adapter(AdapterConfig("ouro", str(H.build_ouro(root / "ouro")), trust_remote_code=True)),
        "huginn": load_adapter(AdapterConfig("huginn", str(H.build_huginn(root / "huginn")), trust_remote_code=True)),
        "retrofit": load_adapter(AdapterConfig("retrofit", str(H.build_llama(root / "llama")), block=(1, 3),
                                               n_loops=3)),
    }
    return out


def _reference(adapter, dec, p: torch.Tensor, N: int) -> np.ndarray:
    """Greedy decoding with the model's own uncached forward at full depth."""
    kind = adapter.kind
    T = adapter.info.n_loops
    if kind == "ouro":
        return greedy(lambda ids: adapter.model(input_ids=ids, use_cache=False, exit_at_step=T - 1).logits[:, -1], p, N)
    if kind == "huginn":  # the same h_0 as the decoder at every position (its per-position streams)
        def fwd(ids):
            e, _ = adapter.model.embed_inputs(ids)
            h0 = torch.cat([dec.initial_state(e[:, i:i + 1], i) for i in range(ids.shape[1])], dim=1)
            return adapter.model(input_ids=ids, input_states=h0, num_steps=T).logits[:, -1]
        return greedy(fwd, p, N)
    if kind == "retrofit":  # a Llama whose layer list repeats the block T times (shared weights)
        base = adapter.model.model
        layers = list(base.layers)
        s, e = adapter.start, adapter.end
        base.layers = torch.nn.ModuleList(layers[:s] + layers[s:e] * T + layers[e:])
        cfg_layers = adapter.model.config.num_hidden_layers
        adapter.model.config.num_hidden_layers = len(base.layers)
        try:
            return greedy(lambda ids: adapter.model(input_ids=ids, use_cache=False).logits[:, -1], p, N)
        finally:
            base.layers = torch.nn.ModuleList(layers)
            adapter.model.config.num_hidden_layers = cfg_layers
    return greedy(lambda ids: adapter.model(input_ids=ids, use_cache=False).logits[:, -1], p, N)


@pytest.mark.parametrize("kind", ["dory", "ouro", "huginn", "retrofit"])
def test_standin_full_depth_equals_uncached_greedy(standins, kind):
    """Prompt 4 + 6 tokens: Dory's sliding window (4) is exceeded, so the cache's window is exercised."""
    ad = standins[kind]
    p, N = prompts_of(B=3, S=4, lo=3, hi=250), 6
    ref = None
    policies = ["share", "recompute"] + (["native"] if kind in ("ouro", "huginn") else [])
    for policy in policies:
        dec = decoder_for(ad, policy)
        for rule in (None, Never("never", 0.0, "ge")):
            r = decode_tokens(dec, p, N, rule)
            ref = _reference(ad, dec, p, N) if ref is None else ref  # after reset: Huginn's h_0 streams
            assert np.array_equal(r.tokens, ref), (kind, policy, rule)
            assert (r.exit_depth == ad.info.n_loops).all()
    if kind in ("dory", "retrofit"):
        with pytest.raises(DecodeUnsupported, match="native"):
            decoder_for(ad, "native")


# ---------------------------------------------------------------------------------------------- policy share

def _attend(layer, x: torch.Tensor, keys: list[torch.Tensor], vals: list[torch.Tensor], n_head: int) -> torch.Tensor:
    """One pre-norm layer of looptrace's model for one position by hand: softmax(q·Kᵀ/√d)·V over given keys."""
    D = x.shape[-1]
    q = layer.attn.qkv(layer.ln_1(x))[:D].view(n_head, -1)  # [H, Dh]
    K, V = torch.stack(keys, 1), torch.stack(vals, 1)  # [H, S, Dh]
    w = torch.softmax((K @ q[:, :, None]).squeeze(-1) / math.sqrt(q.shape[-1]), dim=-1)  # [H, S]
    y = (w[:, :, None] * V).sum(1).reshape(D)
    x = x + layer.attn.proj(y)
    return x + layer.mlp(layer.ln_2(x))


def _kv_of(layer, x: torch.Tensor, n_head: int) -> tuple[torch.Tensor, torch.Tensor]:
    D = x.shape[-1]
    _, k, v = layer.attn.qkv(layer.ln_1(x)).split(D)
    return k.view(n_head, -1), v.view(n_head, -1)


def test_share_policy_hand_computed():
    """2 tokens, T = 3, 1-layer block, no prelude/coda: token 1 (position 0) exits at loop 1, so token 2's
    attention at loops 2 and 3 sees token 1's loop-1 keys/values; computed here by hand from the weights."""
    m = own_model(T=3, n_layer=1, prelude=0, coda=0, gate="none", seed=4)
    layer, H_ = m.blocks[0][0], m.cfg.n_head
    prompt = torch.tensor([[3]])
    dec = decoder_for(m, "share")
    trace: list = []
    r = decode_tokens(dec, prompt, 2, HandRule(torch.tensor([[1, 3]])), trace=trace)
    assert r.exit_depth.tolist() == [[1, 3]]
    with torch.inference_mode():
        # token 1 at position 0: loop 1 only
        h0_1 = m.wte.weight[3] + m.wpe.weight[0]
        k1, v1 = _kv_of(layer, h0_1 + h0_1, H_)
        h1 = _attend(layer, h0_1 + h0_1, [k1], [v1], H_)
        tok1 = int(m.head(m.ln_f(h1)).argmax())
        assert tok1 == r.tokens[0, 0]
        # token 2 at position 1: loops 1..3, attending to token 1's loop-1 keys at every loop
        h0_2 = m.wte.weight[tok1] + m.wpe.weight[1]
        h = h0_2
        for t in range(3):
            x = h + h0_2
            k2, v2 = _kv_of(layer, x, H_)
            h = _attend(layer, x, [k1, k2], [v1, v2], H_)
            got = [hh for n, tt, _, hh, _ in trace if n == 1 and tt == t][0]
            torch.testing.assert_close(got[0, 0], h, rtol=0, atol=1e-5)
        z = m.head(m.ln_f(h))
        assert int(z.argmax()) == r.tokens[0, 1]
        assert r.logprob[0, 1] == pytest.approx(float(torch.log_softmax(z.double(), -1).max()), abs=1e-5)
    # the cache holds token 1's loop-1 keys/values at loops 2 and 3
    for t in (1, 2):
        for a, b in zip(dec.cache.entry(LOOP, t, 0, pos=0), dec.cache.entry(LOOP, 0, 0, pos=0), strict=True):
            assert torch.equal(a, b)
    torch.testing.assert_close(dec.cache.entry(LOOP, 0, 0, pos=0)[0], k1, rtol=0, atol=1e-6)
    # recompute instead: token 2 sees token 1's own loop-2 and loop-3 keys (different numbers, same token 1)
    r2 = decode_tokens(decoder_for(m, "recompute"), prompt, 2, HandRule(torch.tensor([[1, 3]])))
    assert r2.tokens[0, 0] == r.tokens[0, 0] and r2.logprob[0, 1] != r.logprob[0, 1]


class LatestM4Cache:
    """Huginn's ``HuginnDynamicCache`` with lookup ``latest-m4`` as REPORT §6.2 describes it (generalised from
    P = 2, Lc = 4 to the stand-in's P, Lc): entries per step index and absolute position; at a core step s a
    position that lacks it is served its entry at the latest step s' ≤ s of the same core layer."""

    def __init__(self, P: int, Lc: int):
        self.P, self.Lc, self.seen = P, Lc, 0
        self.k: dict[int, dict[int, torch.Tensor]] = {}
        self.v: dict[int, dict[int, torch.Tensor]] = {}

    def update(self, key_states, value_states, step_idx, lookup_strategy=None):
        step = int(step_idx)
        if step == 0:
            self.seen += key_states.shape[-2]
        start = self.seen - key_states.shape[-2]
        ks, vs = self.k.setdefault(step, {}), self.v.setdefault(step, {})
        for i in range(key_states.shape[-2]):
            ks[start + i], vs[start + i] = key_states[:, :, i], value_states[:, :, i]
        if step < self.P:  # prelude and coda: every position has its own
            return torch.stack([ks[p] for p in sorted(ks)], -2), torch.stack([vs[p] for p in sorted(vs)], -2)
        K, V = [], []
        for p in range(self.seen):
            s = max(s for s in self.k if s >= self.P and s <= step and (s - step) % self.Lc == 0 and p in self.k[s])
            K.append(self.k[s][p])
            V.append(self.v[s][p])
        return torch.stack(K, -2), torch.stack(V, -2)

    def get_seq_length(self, *a):
        return self.seen


def test_share_equals_huginns_latest_m4_lookup(standins, monkeypatch):
    """Huginn stand-in, batch 1, hand-set exits: ``share`` (copies) gives the same tokens and log-probabilities as
    decoding through Huginn's own lookup (``latest-m4``), and differs from ``full`` (skip missing positions)."""
    import sys

    ad = standins["huginn"]
    c = ad.model.config
    mod = sys.modules[type(ad.model).__module__]
    p = prompts_of(B=1, S=3, lo=3, hi=250, seed=5)
    depth = torch.tensor([[1, 3, 2, 4, 1, 2]])
    share = decode_tokens(decoder_for(ad, "share"), p, 6, HandRule(depth))
    full = decode_tokens(decoder_for(ad, "native"), p, 6, HandRule(depth))  # the stand-in's "full" lookup
    monkeypatch.setattr(mod, "HuginnDynamicCache",
                        lambda lookup_strategy: LatestM4Cache(c.n_layers_in_prelude, c.n_layers_in_recurrent_block))
    latest = decode_tokens(decoder_for(ad, "native", huginn_lookup_strategy="latest-m4"), p, 6, HandRule(depth))
    assert np.array_equal(share.exit_depth, depth.numpy()) and np.array_equal(latest.exit_depth, depth.numpy())
    assert np.array_equal(share.tokens, latest.tokens)
    np.testing.assert_allclose(share.logprob, latest.logprob, rtol=0, atol=1e-5)
    assert np.abs(share.logprob - full.logprob).max() > 1e-4


# ---------------------------------------------------------------------------------------------- batches

def _thresholds(dec, p, N, signal, hidden_dtype="float32", q=0.5):
    """A threshold between two observed values of ``signal`` (no ties), from a full-depth trace."""
    vals = []

    class Probe(Never):
        def reset(self, model, h0):
            self.live = LiveSignals((signal,), model, hidden_dtype)
            self.live.reset(h0)

        def fires(self, t, h, z, model):
            vals.append(self.live.update(t, h, z)[signal].reshape(-1).double().numpy())
            return super().fires(t, h, z, model)

    decode_tokens(dec, p, N, Probe("probe", 0.0, "ge"))
    v = np.unique(np.concatenate(vals))
    v = v[np.isfinite(v)]
    i = int(q * (v.size - 1))
    return float((v[i] + v[i + 1]) / 2)


@pytest.mark.parametrize("policy", ["share", "recompute"])
@pytest.mark.parametrize("kind", ["own", "huginn", "dory"])
def test_per_row_exits_in_a_batch_equal_each_row_alone(standins, kind, policy):
    model = own_model(T=5) if kind == "own" else standins[kind]
    B, N = 8, 5
    p = prompts_of(B=B, S=3, lo=3, hi=11 if kind == "own" else 250, seed=2)
    dec = decoder_for(model, policy)
    thr = _thresholds(dec, p, N, "max_prob")
    r = decode_tokens(dec, p, N, RegistryRule("top1", thr, "float32"))
    T = dec.n_loops
    assert r.exit_depth.min() < T and len(np.unique(r.exit_depth)) >= 2  # rows at different depths
    assert r.row_loops == r.exit_depth.sum() + (policy == "recompute") * (T - r.exit_depth).sum()
    for i in range(B):
        ri = decode_tokens(dec, p[i:i + 1], N, RegistryRule("top1", thr, "float32"))
        assert np.array_equal(ri.tokens[0], r.tokens[i]) and np.array_equal(ri.exit_depth[0], r.exit_depth[i])
        np.testing.assert_allclose(ri.logprob[0], r.logprob[i], rtol=0, atol=1e-5)
    masked = decode_tokens(dec, p, N, RegistryRule("top1", thr, "float32"), compact=False)
    assert np.array_equal(masked.tokens, r.tokens) and np.array_equal(masked.exit_depth, r.exit_depth)
    assert masked.row_loops >= r.row_loops


def test_native_lockstep_and_all_steps(standins):
    """Huginn native: rows loop together until the last exits (exited rows keep computing); Ouro native: every
    token runs all T steps. The emitted tokens still come from each row's exit loop."""
    p = prompts_of(B=4, S=3, lo=3, hi=250, seed=3)
    depth = torch.tensor([[1, 2, 4, 2], [3, 1, 1, 4], [2, 2, 2, 2], [1, 3, 1, 1]])
    for kind, per_pos in (("huginn", lambda d: 4 * int(d.max())), ("ouro", lambda d: 4 * 4)):
        r = decode_tokens(decoder_for(standins[kind], "native"), p, 4, HandRule(depth))
        assert np.array_equal(r.exit_depth, depth.numpy())
        assert r.row_loops == sum(per_pos(depth[:, n]) for n in range(4))


# ---------------------------------------------------------------------------------------------- signals

SIGNALS = ("entropy", "max_prob", "margin", "argmax", "kl_prev", "kl_prev_rev", "logit_change", "step_norm",
           "rel_step", "step_cos", "state_cos_dist", "accel", "accel_norm", "step_d2", "gate_logit")


@pytest.mark.parametrize("kind", ["own", "ouro"])
def test_decode_signals_equal_the_offline_functions(standins, kind):
    """Every live signal at decode time equals the offline vectorised function (the dump's ``logit_stats``, the
    geometry stage's ``step_metrics`` on the float16-rounded states) on the same states and readouts, bit for bit."""
    model = own_model(T=4) if kind == "own" else standins[kind]
    dec = decoder_for(model, "share")
    rec: dict = {}

    class Probe(Never):
        def reset(self, model, h0):
            self.live = LiveSignals(SIGNALS, model, "float16")
            self.live.reset(h0)
            self.n = getattr(self, "n", -1) + 1

        def fires(self, t, h, z, model):
            rec[(self.n, t)] = {k: v.clone() for k, v in self.live.update(t, h, z).items()}
            return super().fires(t, h, z, model)

    trace: list = []
    p = prompts_of(B=3, S=3, lo=3, hi=11 if kind == "own" else 250, seed=6)
    decode_tokens(dec, p, 3, Probe("probe", 0.0, "ge"), trace=trace)
    T = dec.n_loops
    for n in range(3):
        h0 = [h for nn, t, _, h, _ in trace if nn == n and t == -1][0][:, 0]  # [B, D]
        hs = torch.stack([h[:, 0] for nn, t, _, h, _ in trace if nn == n and t >= 0], 1)  # [B, T, D]
        zs = torch.stack([z[:, 0] for nn, t, _, _, z in trace if nn == n and t >= 0], 1)  # [B, T, V]
        off = dict(logit_stats(zs, torch.zeros(zs.shape[0], dtype=torch.int64)))
        off.update(step_metrics(hs.to(torch.float16).numpy(), h0.to(torch.float16).numpy()))
        with torch.inference_mode():  # a model output, not a signal function: same GEMM shape as at decode time
            off["gate_logit"] = torch.cat([dec.gate_logit(hs[:, t:t + 1]) for t in range(T)], 1).numpy()
        for t in range(1, T):  # the rule is asked after loops 1..T−1 (loop T always exits)
            for k, v in rec[(n, t)].items():
                got, want = v.reshape(-1).numpy(), off[k][:, t - 1]
                assert got.dtype == want.dtype, k
                assert np.array_equal(got.view(np.uint32) if got.dtype == np.float32 else got,
                                      want.view(np.uint32) if want.dtype == np.float32 else want, equal_nan=True), (k, t)


def test_online_exit_equals_offline_exit_depths_on_the_decode_signals():
    """A rule calibrated offline means the same online: the decode-time exit of every token equals
    ``exit_depths`` of the rule's offline score on that token's decoded signals (padded after its exit)."""
    m = own_model(T=5)
    p = prompts_of(B=4, S=3, seed=8)
    for name in ("entropy", "kl_prev", "accel_two_hit", "q_exit"):
        rule = get_rule(name)
        dec = decoder_for(m, "share")
        thr = 0.6 if name == "q_exit" else _thresholds(dec, p, 4, rule.signals[0], "float16", q=0.6)
        trace: list = []
        r = decode_tokens(dec, p, 4, RegistryRule(rule, thr, "float16"), trace=trace)
        T = m.n_loops
        for n in range(4):
            for b in range(4):
                d = int(r.exit_depth[b, n])
                h0 = [h[rows == b] for nn, t, rows, h, _ in trace if nn == n and t == -1][0][:, 0]
                hs = torch.cat([h[rows == b] for nn, t, rows, h, _ in trace if nn == n and t >= 0], 0)[:, 0]
                zl = [z for nn, t, _, _, z in trace if nn == n and t >= 0]
                assert hs.shape[0] == d
                sig = {}
                if all(z is not None for z in zl[:d]):  # rules on the state only read no logits before loop T
                    zs = torch.cat([z[rows == b] for nn, t, rows, _, z in trace if nn == n and t >= 0], 0)[:, 0]
                    sig = dict(logit_stats(zs[None], torch.zeros(1, dtype=torch.int64)))
                sig.update(step_metrics(hs[None].to(torch.float16).numpy(), h0.to(torch.float16).numpy()))
                with torch.inference_mode():
                    sig["gate_logit"] = torch.cat([m.gate_logit(hs[None, t:t + 1]) for t in range(d)], 1).numpy()
                pad = {k: np.concatenate([v.astype(np.float64), np.full((1, T - d), np.nan)], 1) for k, v in sig.items()}
                score = rule.score_of(loop_signals({k: pad[k] for k in rule.signals}, T))
                want = exit_depths(score, np.array([thr]), rule.op, rule.min_loop, rule.two_hit)[0]
                assert int(want[0]) == d, (name, n, b)


def test_prefix_agreement():
    a = np.array([[1, 2, 3, 4], [1, 2, 3, 4]])
    b = np.array([[1, 2, 0, 4], [1, 2, 3, 4]])
    assert prefix_agreement(a, b) == pytest.approx((2 / 4 + 1) / 2)


# ---------------------------------------------------------------------------------------------- the report

def _greedy_with_exit(m: LoopedTransformer, prompts: torch.Tensor, n: int, thr: float | None,
                      force: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Greedy decoding with top1 early exit, from the model's uncached forward (every loop's logits of every
    position) and the offline exit rule — the recompute policy by another route: each position's states are the
    full-depth states of the sequence so far, and it exits at the offline ``exit_depths`` of its max-prob.

    Returns:
        tokens [B, n], exit depths [B, n], log-probabilities of the fed token (emitted or ``force``d) [B, n].
    """
    ids = prompts.clone()
    T = m.n_loops
    tok, dep, lp = [], [], []
    with torch.inference_mode():
        for i in range(n):
            z = m(ids).logits[:, -1].double()  # [B, T, V]
            logp = torch.log_softmax(z, -1)
            p = torch.softmax(z.float(), -1).max(-1).values.double().numpy()  # [B, T]
            d = (np.full(p.shape[0], T) if thr is None else exit_depths(p, np.array([thr]), "ge")[0]).astype(np.int64)
            zd = logp[torch.arange(p.shape[0]), torch.from_numpy(d - 1)]  # [B, V]
            emitted = zd.argmax(-1)
            fed = emitted if force is None else torch.from_numpy(force[:, i])
            tok.append(emitted.numpy())
            dep.append(d)
            lp.append(zd.gather(1, fed[:, None]).squeeze(1).numpy())
            ids = torch.cat([ids, fed[:, None]], dim=1)
    return np.stack(tok, 1), np.stack(dep, 1), np.stack(lp, 1)


def test_generate_model_report_equals_an_independent_computation():
    """Every quality figure of a generate.parquet row — mean exit depth, ideal speedup, token and prefix agreement,
    the full-depth continuation's loss under full depth and under early exit, the teacher-forced exit depth —
    equals the same figure computed from the uncached forward and the offline rule (policy recompute, batch 1
    and a batch of 4 with per-row exits); the work ratios are the loop counts' closed forms for both policies."""
    from looptrace.online.generate import GenerateConfig, generate_model
    from looptrace.online.latency import RuleSpec

    m = own_model(T=5, coda=0, seed=3)
    T, B, S0, N = 5, 4, 3, 4
    p = prompts_of(B=B, S=S0, seed=9)
    thr = _thresholds(decoder_for(m, "recompute"), p, N, "max_prob", q=0.4)
    spec = RuleSpec(rule="top1", kind="posthoc", source="explicit", threshold=thr,
                    factory=lambda: RegistryRule("top1", thr, "float32"), offline_exit=np.zeros(0, np.int64),
                    offline_correct=np.zeros(0, bool))
    cfg = GenerateConfig(rules=(f"top1@{thr}",), policies=("recompute", "share"), batch_sizes=(1, 4), prompts=B,
                         prompt_len=S0, new_tokens=N, repeats=2)
    decs = {pol: decoder_for(m, pol) for pol in cfg.policies}
    rows = generate_model(decs, p.numpy(), [spec], cfg, {"model": "m"}, progress=False)
    assert [(r["policy"], r["batch_size"]) for r in rows] == [("recompute", 1), ("recompute", 4), ("share", 1),
                                                             ("share", 4)]
    full_tok, _, full_lp = _greedy_with_exit(m, p, N, None)
    tok, dep, _ = _greedy_with_exit(m, p, N, thr)
    _, fdep, flp = _greedy_with_exit(m, p, N, thr, force=full_tok)
    assert 1 < dep.mean() < T and (tok != full_tok).any()  # a real test: early exits that change tokens
    same = tok == full_tok
    prefix = np.mean([(np.argmin(s) if not s.all() else N) / N for s in same])
    share_rows = {}
    for r in rows:
        assert r["n_tokens"] == B * N and r["n_loops"] == T and r["repeats"] == 2
        assert r["ideal_speedup"] == pytest.approx(T / r["mean_exit_depth"], rel=1e-12)
        assert r["speedup_ratio"] == pytest.approx(r["realised_speedup"] / r["ideal_speedup"], rel=1e-12)
        assert r["tokens_per_s"] == pytest.approx(B * N / r["exit_time_s"], rel=1e-12)
        assert r["full_tokens_per_s"] == pytest.approx(B * N / r["full_time_s"], rel=1e-12)
        assert r["loss_full_depth"] == pytest.approx(float(-full_lp.mean()), abs=1e-5)
        if r["policy"] == "recompute":
            assert r["mean_exit_depth"] == pytest.approx(dep.mean(), abs=1e-12)
            assert (r["min_exit_depth"], r["max_exit_depth"]) == (dep.min(), dep.max())
            assert r["token_agreement"] == pytest.approx(same.mean(), abs=1e-12)
            assert r["prefix_agreement"] == pytest.approx(prefix, abs=1e-12)
            assert r["forced_mean_exit_depth"] == pytest.approx(fdep.mean(), abs=1e-12)
            assert r["loss_early_exit"] == pytest.approx(float(-flp.mean()), abs=1e-5)
            assert r["loss_gap"] == pytest.approx(r["loss_early_exit"] - r["loss_full_depth"], abs=1e-12)
            assert r["work_speedup"] == 1.0  # the skipped loops are computed for their KV
        else:
            # share computes exactly the loops run: T·tokens over the sum of exit depths
            assert r["work_speedup"] == pytest.approx(T * B * N / (r["mean_exit_depth"] * B * N), rel=1e-12)
            share_rows[r["batch_size"]] = r
    # per-row exits in the batch of 4 decide exactly as one row at a time
    for k in ("mean_exit_depth", "token_agreement", "prefix_agreement", "loss_early_exit", "forced_mean_exit_depth"):
        assert share_rows[1][k] == pytest.approx(share_rows[4][k], abs=1e-6), k


def test_generate_stage_on_a_tiny_pipeline(tmp_path):
    """generate_models on train -> dump -> readouts artifacts: prompts are the store's first test sequences, each
    rule runs at its chosen threshold, unsupported rules/policies are skipped with reasons, and the recompute row's
    exits equal the independent greedy-with-exit computation; the CLI writes both files, bad input is one line."""
    import json

    import polars as pl
    from typer.testing import CliRunner

    from looptrace.cli import app
    from looptrace.io.store.reader import open_store
    from looptrace.models.looped import load_checkpoint
    from looptrace.online.generate import GenerateConfig, generate_models, write_generate
    from tests.test_latency import _tiny_pipeline

    name, rows, _ = _tiny_pipeline(tmp_path)
    roots = {k: tmp_path / k for k in ("train", "dump", "readouts", "gates")}
    cfg = GenerateConfig(rules=("top1", "q_exit", "entropy", "gate"), policies=("share", "recompute", "native"),
                         batch_sizes=(1, 3), prompts=3, prompt_len=3, new_tokens=4, repeats=1)
    df, metrics = generate_models([name], cfg, roots["dump"], roots["readouts"], roots["gates"],
                                  train_root=roots["train"], progress=False)
    assert df.height == 2 * 2 * 2  # (top1, q_exit) × (share, recompute) × batch (1, 3)
    chosen = {r["rule"]: r["threshold"] for r in rows}
    assert {r["rule"]: r["threshold"] for r in df.iter_rows(named=True)} == chosen
    sk = metrics["models"][name]["skipped"]
    assert set(sk) == {"entropy", "gate", "policy:native"} and "no chosen point" in sk["entropy"]
    st = open_store(roots["dump"] / name / "test.zarr")
    seq, pos, tok = st.read("sequence"), st.read("position"), st.read("token_id")
    prompts = np.zeros((3, 3), np.int64)
    for s, p_, t in zip(seq, pos, tok, strict=True):
        if s < 3 and p_ < 3:
            prompts[s, p_] = t
    model, _ = load_checkpoint(roots["train"] / name / "model.pt")
    _, dep, _ = _greedy_with_exit(model.eval(), torch.from_numpy(prompts), 4, chosen["top1"])
    r = df.filter((pl.col("rule") == "top1") & (pl.col("policy") == "recompute") & (pl.col("batch_size") == 3))
    assert r["mean_exit_depth"][0] == pytest.approx(dep.mean(), abs=1e-12)
    assert set(metrics["summary"]) == {"share_bs1", "share_bs3", "recompute_bs1", "recompute_bs3"}
    write_generate(tmp_path / "generate", df, metrics)
    assert pl.read_parquet(tmp_path / "generate" / "generate.parquet").shape == df.shape
    assert json.loads((tmp_path / "generate" / "metrics.json").read_text())["n_runs"] == df.height
    res = CliRunner().invoke(app, ["generate", "--models", "nope", "--train-root", str(tmp_path)])
    assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1, res.output
