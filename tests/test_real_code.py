"""The ``huginn``, ``ouro`` and ``nanbeige`` adapters against the *published* remote code (skipped unless it is
given).

Set ``LOOPTRACE_REAL_CODE=/dir`` where ``/dir/huginn``, ``/dir/ouro`` and ``/dir/nanbeige`` are tiny random-weight
checkpoints saved with the published modeling code (``/dir/ouro_confident``, the Ouro one with confident gates, is
used when present; a model whose directory is missing is skipped). How to build them: docs/adapters.md,
"Re-verifying against the real code". Nothing of that code is in this repository; CI runs the same checks on stand-ins (tests/test_remote_adapters.py).

Every reference is the real model's own computation under the installed transformers (through looptrace's
compatibility shim, which adapts interfaces, never maths): per-loop states, gate logits and every exit equal it
to 1e-5 in float32; Ouro's Q-exit step equals its own ``forward(exit_threshold=q)``; cached generation equals
uncached greedy decoding (Nanbeige: its own generate and looptrace's decoders under every KV policy).
``pytest -s`` prints the measured max |diff| per model and quantity.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from looptrace.models.adapters.huginn import sequence_seed
from looptrace.models.adapters.loading import AdapterConfig, load_adapter
from looptrace.rules.registry import get_rule
from looptrace.rules.scoring import exit_depths
from looptrace.signals.halting import ouro_threshold
from tests.hf_helpers import own_forward_at

ROOT = os.environ.get("LOOPTRACE_REAL_CODE")
pytestmark = pytest.mark.skipif(not ROOT, reason="LOOPTRACE_REAL_CODE (a directory with huginn/ and ouro/ "
                                                 "checkpoints of the published code) is not set")
TOL = 1e-5
QS = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0)
torch.set_num_threads(1)


def _dir(name: str) -> Path:
    p = Path(ROOT or ".") / name
    if not (p / "config.json").is_file():
        pytest.skip(f"{p} holds no checkpoint")
    return p


def _ids(b=3, s=12, vocab=250, seed=0):
    return torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(seed))


def diff(a, b) -> float:
    return float((a.float() - b.float()).abs().max())


def report(model: str, **d: float) -> None:
    print(f"\n[real code] {model}: " + ", ".join(f"{k} {v:.3g}" for k, v in d.items()))


def exits(a, st):
    return torch.stack([a.readout(st.hidden[:, :, t], t) for t in range(a.info.n_loops)], dim=2)


# ----------------------------------------------------------------------------------------------- Huginn

@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(("noise", "kind"), [(0.0, "fixed"), (0.3, "fixed"), (0.3, "geom")])
def test_huginn_states_and_exits_are_the_real_models_own(noise, kind, dtype):
    path = _dir("huginn")
    a = load_adapter(AdapterConfig(kind="huginn", path=str(path), trust_remote_code=True, seed=3, dtype=dtype))
    m = a.model
    m.config.test_time_noise, m.config.test_time_noise_type = noise, kind
    a._verified = False  # the exit check runs with this noise setting
    ids = _ids(vocab=m.config.vocab_size - 1)
    st = a.states(ids)
    T = a.info.n_loops
    d = {"h0": 0.0, "states": 0.0, "exits vs forward(num_steps=t)": 0.0}
    for i in range(ids.shape[0]):
        seed = sequence_seed(3, ids[i])
        with torch.no_grad(), torch.random.fork_rng():  # its own step API, in the sequence's stream
            torch.manual_seed(seed)
            e, bidx = m.embed_inputs(ids[i:i + 1])
            x = m.initialize_state(e)
            d["h0"] = max(d["h0"], diff(st.hidden_init[i:i + 1], x))
            for t in range(T):
                x, bidx, _ = m.iterate_one_step(e, x, block_idx=bidx, current_step=t)
                d["states"] = max(d["states"], diff(st.hidden[i:i + 1, :, t], x))
        for t in range(T):
            with torch.no_grad(), torch.random.fork_rng():
                torch.manual_seed(seed)
                own = m(input_ids=ids[i:i + 1], num_steps=t + 1).logits
            d["exits vs forward(num_steps=t)"] = max(d["exits vs forward(num_steps=t)"],
                                                     diff(a.readout(st.hidden[:, :, t], t)[i:i + 1], own))
    d["batch of 1 vs 3"] = diff(a.states(ids[1:2]).hidden, st.hidden[1:2])
    report(f"huginn {dtype} noise {noise} {kind}", **d)
    # bf16: the same kernels on the same bf16 inputs; the float32 slack is for batched vs lone embedding (~1 ulp)
    assert max(d.values()) <= (TOL if dtype == "float32" else 0.0), d


def test_huginn_generation_runs_its_own_loops():
    """Plain generate (routed to Huginn's generate_minimal) and its adaptive loop with a never-exiting criterion
    both equal uncached greedy decoding; h_0 = 0 (init_scale 0) makes every path deterministic."""
    path = _dir("huginn")
    a = load_adapter(AdapterConfig(kind="huginn", path=str(path), trust_remote_code=True))
    m, ids, n = a.model, _ids(b=1, s=6, vocab=a.model.config.vocab_size - 1), 4
    with torch.no_grad():
        seq = ids
        for _ in range(n):
            nxt = m(input_ids=seq, num_steps=a.info.n_loops, init_scale=0.0).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
        plain = m.generate(ids, max_new_tokens=n, do_sample=False, init_scale=0.0)
        adaptive = m.generate(ids, max_new_tokens=n, do_sample=False, init_scale=0.0, criterion="none")
    adaptive = adaptive.sequences if hasattr(adaptive, "sequences") else adaptive
    report("huginn generate", plain_tokens_equal=float(torch.equal(plain, seq)),
           adaptive_tokens_equal=float(torch.equal(adaptive, seq)))
    assert torch.equal(plain, seq) and torch.equal(adaptive, seq)


# ----------------------------------------------------------------------------------------------- Ouro

def _ouro(path, **kw):
    return load_adapter(AdapterConfig(kind="ouro", path=str(path), trust_remote_code=True, **kw))


@pytest.mark.parametrize("name", ["ouro", "ouro_confident"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_ouro_states_gates_exits_and_q_exit_are_the_real_models_own(name, dtype):
    path = _dir(name)
    a = _ouro(path, dtype=dtype)  # verify_exit on
    m = a.model
    ids = _ids(b=4, s=16, vocab=m.config.vocab_size - 1)
    st = a.states(ids)
    T = a.info.n_loops
    with torch.no_grad():
        _, hs, gates = m.model(input_ids=ids, use_cache=False)
        ex = exits(a, st)
        d = {"states": max(diff(st.hidden[:, :, t], hs[t]) for t in range(T)),
             "gate logits": diff(st.gate_logits, torch.cat(gates, dim=-1)),
             "exits vs forward(exit_at_step=t)": max(
                 diff(ex[:, :, t], m(input_ids=ids, use_cache=False, exit_at_step=t).logits) for t in range(T))}
        misses, misses64 = {}, {}
        g = st.gate_logits.reshape(-1, T).numpy()
        for q in QS:
            own = m(input_ids=ids, use_cache=False, exit_threshold=q).logits.float()
            match = (ex == own[:, :, None]).all(-1)
            assert bool(match.any(-1).all())
            own_step = (match.float().argmax(-1) + 1).reshape(-1).numpy()
            mine = exit_depths(get_rule(f"q_exit_{dtype}").score_of({"gate_logit": g}),
                               np.array([ouro_threshold(q, dtype)]), "ge")[0]
            f64 = exit_depths(get_rule("q_exit").score_of({"gate_logit": g}), np.array([q]), "ge")[0]
            misses[q], misses64[q] = int((mine != own_step).sum()), int((f64 != own_step).sum())
    report(f"{name} {dtype}", **d, q_exit_model_dtype_mismatches=sum(misses.values()),
           q_exit_float64_mismatches=sum(misses64.values()))
    print(f"  tokens ({g.shape[0]}) whose Q-exit step differs from forward(exit_threshold=q): "
          f"q_exit_{dtype} {misses}; float64 q_exit {misses64}")
    assert max(d.values()) <= (TOL if dtype == "float32" else 0.0), d
    assert not any(misses.values()), misses


def test_ouro_n_loops_equals_a_model_built_with_that_many_steps():
    from transformers import AutoModelForCausalLM

    path = _dir("ouro")
    a = _ouro(path, n_loops=3)
    ids = _ids(vocab=a.model.config.vocab_size - 1)
    st = a.states(ids)
    ref = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, local_files_only=True,
                                               total_ut_steps=3).eval()
    with torch.no_grad():
        _, hs, _ = ref.model(input_ids=ids, use_cache=False)
    d = {"states (n_loops 3 vs total_ut_steps 3)": max(diff(st.hidden[:, :, t], hs[t]) for t in range(3))}
    report("ouro n_loops 3", **d)
    assert st.hidden.shape[2] == 3 and max(d.values()) <= TOL


def test_ouro_cached_generate_equals_uncached_greedy():
    path = _dir("ouro")
    a = _ouro(path)
    m, ids, n = a.model, _ids(b=1, s=6, vocab=a.model.config.vocab_size - 1), 5
    T = a.info.n_loops
    with torch.no_grad():
        seq = ids
        for _ in range(n):
            nxt = m(input_ids=seq, use_cache=False, exit_at_step=T - 1).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
        gen = m.generate(ids, max_new_tokens=n, do_sample=False, exit_at_step=T - 1)
        cached = m(input_ids=ids).logits  # use_cache defaults to True: the model's own cache
        plain = m(input_ids=ids, use_cache=False).logits
    report("ouro generate", tokens_equal=float(torch.equal(gen, seq)), cached_vs_uncached_logits=diff(cached, plain))
    assert torch.equal(gen, seq) and diff(cached, plain) <= TOL


# ----------------------------------------------------------------------------------------------- loop step

@pytest.mark.parametrize("name", ["huginn", "ouro", "nanbeige"])
def test_loop_step_and_layers_are_the_real_models_own(name):
    """The adapters' differentiable loop step, iterated from h_0, reproduces the states bit for bit; its per-layer
    outputs are the layer outputs hooked in the real model's own forward; ρ (power method through the step) equals
    the exact diagonal-block singular value of the reverse-mode Jacobian (float64)."""
    from looptrace.loopmap.contraction import ContractionConfig, contraction_stats

    path = _dir(name)
    a = load_adapter(AdapterConfig(kind=name, path=str(path), trust_remote_code=True))
    m = a.model
    ids = _ids(b=2, s=8, vocab=m.config.vocab_size - 1)
    st = a.states(ids)
    T, layers = a.info.n_loops, a.loop_layers(0)
    seen: list[torch.Tensor] = []
    hooks = [lay.register_forward_hook(lambda mod, i, o: seen.append(o[0] if isinstance(o, tuple) else o))
             for lay in layers]
    try:
        with torch.no_grad():
            if name == "huginn":
                own = []
                for i in range(2):
                    seen.clear()
                    with torch.random.fork_rng():
                        torch.manual_seed(sequence_seed(0, ids[i]))
                        m(input_ids=ids[i:i + 1], num_steps=T)
                    own.append(list(seen))
                flat = [torch.cat([o[k] for o in own]) for k in range(len(own[0]))]
            else:
                m.model(input_ids=ids, use_cache=False)
                flat = list(seen)
    finally:
        for hk in hooks:
            hk.remove()
    L = len(layers)
    d = {"step states": 0.0, "step layers vs own forward": 0.0}
    h = st.hidden_init
    for t in range(T):
        with torch.enable_grad():
            h, outs = a.loop_step_layers(h, st.hidden_init, t)
        d["step states"] = max(d["step states"], diff(h, st.hidden[:, :, t]))
        d["step layers vs own forward"] = max(d["step layers vs own forward"],
                                              *(diff(x, y) for x, y in zip(outs, flat[t * L:(t + 1) * L], strict=True)))
        h = h.detach()
    a.model.double()
    a.dtype = torch.float64
    st = a.states(ids)
    out = contraction_stats(lambda x, t: a.loop_step(x, st.hidden_init, t), st.hidden_init, st.hidden,
                            ContractionConfig(power_iters=300, position_chunk=8))
    x = st.hidden[:, :, 0].clone()
    J = torch.autograd.functional.jacobian(lambda y: a.loop_step(y, st.hidden_init, 1), x)
    want = torch.stack([torch.stack([torch.linalg.matrix_norm(J[b, i, :, b, i, :], ord=2) for i in range(8)])
                        for b in range(2)])
    d["rho vs exact block SVD (rel)"] = float(((out["contraction"][:, :, 1].double() - want) / want).abs().max())
    report(f"{name} loop step", **d)
    assert d["step states"] == 0.0 and d["step layers vs own forward"] == 0.0, d
    assert d["rho vs exact block SVD (rel)"] <= 1e-5, d


# ----------------------------------------------------------------------------------------------- Nanbeige

def _nanbeige(path, **kw):
    return load_adapter(AdapterConfig(kind="nanbeige", path=str(path), trust_remote_code=True, **kw))


def _nb_ids(m, b=3, s=12, seed=0):
    # ids >= 3: clear of pad (0), bos and eos, so generate's attention mask keeps every prompt token
    return torch.randint(3, m.config.vocab_size, (b, s), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_nanbeige_states_and_exits_are_the_real_models_own(dtype, attn):
    """h_t and the exit at loop t equal the real model's last hidden state and logits run with num_loops = t
    (``output_hidden_states``' last entry: the normed output of the last loop); every rotary table is the one
    ``NanbeigeRotaryEmbedding.__init__`` computes; with ``skip_loop_final_norm`` and with ``pretraining_tp`` 2 (the
    head in slices) the exits equal it too."""
    from looptrace.models.adapters.nanbeige import NanbeigeAdapter

    path = _dir("nanbeige")
    a = _nanbeige(path, dtype=dtype, attn_implementation=attn)  # verify_exit on
    m = a.model
    ids = _nb_ids(m)
    st = a.states(ids)
    T = a.info.n_loops
    d = {"inv_freq vs its __init__": max(diff(lay.self_attn.rotary_emb.inv_freq, type(lay.self_attn.rotary_emb)(
            lay.self_attn.rotary_emb.dim, base=lay.self_attn.rotary_emb.base).inv_freq) for lay in m.model.layers),
         "h0": diff(st.hidden_init, m.model.embed_tokens(ids)), "states": 0.0, "exits vs forward(num_loops=t)": 0.0}
    for t in range(T):
        own = own_forward_at(m, t + 1, ids, output_hidden_states=True)
        d["states"] = max(d["states"], diff(st.hidden[:, :, t], own.hidden_states[-1]))
        d["exits vs forward(num_loops=t)"] = max(d["exits vs forward(num_loops=t)"],
                                                 diff(a.readout(st.hidden[:, :, t], t), own.logits))
    d["batch of 1 vs 3"] = diff(a.states(ids[1:2]).hidden, st.hidden[1:2])
    m.config.skip_loop_final_norm = True
    try:
        s = NanbeigeAdapter(m, a.cfg)  # verify_exit on: lm_head(norm(h_T)) against the forward
        sk = s.states(ids)
        d["skip norm: exits"] = max(diff(s.readout(sk.hidden[:, :, t], t), own_forward_at(m, t + 1, ids).logits)
                                    for t in range(T))
        d["skip norm: norm(h_T)"] = diff(m.model.norm(sk.hidden[:, :, T - 1]), own_forward_at(
            m, T, ids, output_hidden_states=True).hidden_states[-1])
    finally:
        m.config.skip_loop_final_norm = False
    m.config.pretraining_tp = 2  # the forward then splits every projection and the head into 2 slices
    try:
        s = NanbeigeAdapter(m, a.cfg)
        sk = s.states(ids)
        d["pretraining_tp 2: exits"] = max(diff(s.readout(sk.hidden[:, :, t], t), own_forward_at(m, t + 1, ids).logits)
                                           for t in range(T))
    finally:
        m.config.pretraining_tp = 1
    report(f"nanbeige {dtype} {attn}", **d)
    assert max(d.values()) <= (TOL if dtype == "float32" else 0.0), d


def test_nanbeige_n_loops_is_the_models_num_loops():
    path = _dir("nanbeige")
    a = _nanbeige(path, n_loops=3)
    m = a.model
    ids = _nb_ids(m)
    st = a.states(ids)
    d = {"states (n_loops 3 vs forward(num_loops=t))": max(
        diff(st.hidden[:, :, t], own_forward_at(m, t + 1, ids, output_hidden_states=True).hidden_states[-1])
        for t in range(3))}
    report("nanbeige n_loops 3", **d)
    assert st.hidden.shape[2] == 3 and max(d.values()) <= TOL


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_nanbeige_generation_equals_uncached_greedy(attn):
    """Looptrace's decoders (share, recompute, native = the model's own DynamicCache: one slot per loop x layer;
    speculative drafts at every k < T) and the model's own cached generate equal uncached greedy decoding; its
    cached forward continued by one token equals the uncached forward."""
    import sys

    from looptrace.models.decoders import decoder_for
    from looptrace.online.generate import decode_tokens
    from looptrace.online.speculative import decode_speculative

    path = _dir("nanbeige")
    a = _nanbeige(path, attn_implementation=attn)
    m, T, m_layers = a.model, a.info.n_loops, len(a.loop_layers(0))
    p, N = _nb_ids(m, b=3, s=6), 6
    seq = p
    with torch.no_grad():
        for _ in range(N):
            seq = torch.cat([seq, m(input_ids=seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    ref = seq[:, p.shape[1]:].numpy()
    d: dict[str, float] = {}
    for policy in ("share", "recompute", "native"):
        dec = decoder_for(a, policy)
        r = decode_tokens(dec, p, N)
        d[f"{policy} tokens equal"] = float(np.array_equal(r.tokens, ref))
        if policy == "native":
            d["native cache slots == T*L"] = float(len(dec.cache.layers) == T * m_layers)
    for k in range(1, T):
        r = decode_speculative(decoder_for(a, "recompute"), p, N, k, 3)
        d[f"speculative k={k} tokens equal"] = float(np.array_equal(r.tokens, ref))
    ids = p[:1]
    with torch.no_grad():
        gen = m.generate(p, max_new_tokens=N, do_sample=False)  # a batch of 3 (equal lengths: no padding)
        cache = sys.modules[type(m).__module__].DynamicCache()
        m(input_ids=ids, past_key_values=cache, use_cache=True)
        nxt = m(input_ids=seq[:1, 6:7], past_key_values=cache, use_cache=True).logits
        full = m(input_ids=seq[:1, :7], use_cache=False).logits
        legacy = m(input_ids=ids).logits  # use_cache defaults to True: a cache of its own, returned as a tuple
    d["generate tokens equal"] = float(torch.equal(gen, seq))
    d["own cache slots == T*L"] = float(len(cache.layers) == T * m_layers)
    diffs = {"cached next-token logits": diff(nxt[:, -1], full[:, -1]),
             "cached forward logits": diff(legacy, m(input_ids=ids, use_cache=False).logits)}
    report(f"nanbeige generation {attn}", **d, **diffs)
    assert all(v == 1.0 for v in d.values()), d
    assert max(diffs.values()) <= TOL, diffs
