"""Loop memory ([RT] Loop Memory Attention, ``model.loop_memory``; docs/SPEC.md §1 "Trajectories with loop memory").

- The forward equals a hand-written loop-time attention (numpy, float64, the model's weights) on a 2-token,
  3-loop case: self-attention over positions, then attention of each position over its own layer outputs at the
  earlier iterations, then the MLP.
- Causal in loop time: perturbing the layer's outputs at iterations > t leaves h_1..h_t unchanged (and does change
  the later ones, so the memory is read at all).
- Checkpoints carry the option; models without it keep the config dict (and so the checkpoint bytes) they had.
- Decoding stays exact: full-depth decoding (policies share and recompute) equals greedy decoding with the uncached
  forward; with early exits under ``recompute`` every loop's readout equals the full forward's; the latency
  engine's compacted early exit equals the full forward truncated at each token's exit loop.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from looptrace.config import ConfigError
from looptrace.models.decoders import decoder_for
from looptrace.models.looped import (
    GroupConfig,
    LoopedTransformer,
    ModelConfig,
    load_checkpoint,
    save_checkpoint,
)
from looptrace.online.engine import early_exit
from looptrace.online.generate import decode_tokens
from tests.test_generate import HandRule as DecodeHandRule
from tests.test_generate import assert_full_depth_decode_exact, greedy, prompts_of
from tests.test_latency import HandRule

torch.set_num_threads(1)


def memory_model(T: int = 3, groups=None, n_layer: int = 1, vocab: int = 5, seq: int = 8, d: int = 8, n_head: int = 2,
                 n_prelude: int = 0, n_coda: int = 0, loop_form: str = "add", gate: str = "none", seed: int = 0,
                 scale: float | None = None) -> LoopedTransformer:
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=vocab, block_size=seq, d_model=d, n_head=n_head, n_prelude=n_prelude, n_coda=n_coda,
                      groups=tuple(groups) if groups else (GroupConfig(n_layer, T),), loop_form=loop_form,
                      gate=gate, loop_memory=True)
    m = LoopedTransformer(cfg).eval()
    if scale is not None:  # weights large enough that every sublayer moves the state visibly
        with torch.no_grad():
            for name, p in m.named_parameters():
                if not name.startswith(("wte", "wpe")) and "ln" not in name:
                    p.normal_(0.0, scale)
    return m


# ---------------------------------------------------------------------------------------------- hand computation

def _ln(x, mod):
    w, b = mod.weight.detach().double().numpy(), mod.bias.detach().double().numpy()
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + mod.eps) * w + b


def _lin(x, mod):
    y = x @ mod.weight.detach().double().numpy().T
    return y + mod.bias.detach().double().numpy() if mod.bias is not None else y


def _softmax(a):
    a = a - a.max()
    e = np.exp(a)
    return e / e.sum()


def _gelu(x):
    return 0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))


def hand_forward(m: LoopedTransformer, ids: list[int]) -> np.ndarray:
    """h_1..h_T [S, T, D] of one sequence, loop by loop and position by position, with explicit attention sums."""
    cfg = m.cfg
    D, H = cfg.d_model, cfg.n_head
    dh = D // H
    S = len(ids)
    e = m.wte.weight.detach().double().numpy()[ids] + m.wpe.weight.detach().double().numpy()[:S]  # [S, D]
    layer = m.blocks[0][0]
    h = e.copy()
    outs: list[np.ndarray] = []  # o^1, o^2, ...: the layer's output at each iteration, [S, D]
    states = []
    for _t in range(cfg.n_loops):
        x = h + e  # add form, reinject
        # self-attention over positions (causal)
        qkv = _lin(_ln(x, layer.ln_1), layer.attn.qkv)  # [S, 3D]
        q, k, v = qkv[:, :D], qkv[:, D:2 * D], qkv[:, 2 * D:]
        att = np.zeros((S, D))
        for i in range(S):
            for hd in range(H):
                sl = slice(hd * dh, (hd + 1) * dh)
                w = _softmax(np.array([q[i, sl] @ k[j, sl] / math.sqrt(dh) for j in range(i + 1)]))
                att[i, sl] = sum(w[j] * v[j, sl] for j in range(i + 1))
        x = x + _lin(att, layer.attn.proj)
        # loop-time attention: position i over its own outputs at iterations 1..t-1
        if outs:
            mem = np.zeros((S, D))
            qm = _lin(_ln(x, layer.ln_m), layer.mem_attn.q)  # [S, D]
            for i in range(S):
                kvs = [_lin(_ln(o[i], layer.ln_m), layer.mem_attn.kv) for o in outs]  # each [2D]
                for hd in range(H):
                    sl = slice(hd * dh, (hd + 1) * dh)
                    w = _softmax(np.array([qm[i, sl] @ kv[:D][sl] / math.sqrt(dh) for kv in kvs]))
                    mem[i, sl] = sum(w[s] * kvs[s][D:][sl] for s in range(len(kvs)))
            x = x + _lin(mem, layer.mem_attn.proj)
        x = x + _lin(_gelu(_lin(_ln(x, layer.ln_2), layer.mlp.fc)), layer.mlp.proj)
        outs.append(x)
        h = x
        states.append(h)
    return np.stack(states, axis=1)


def test_forward_equals_hand_written_loop_time_attention_2_tokens_3_loops():
    m = memory_model(T=3, d=8, n_head=2, scale=0.4).double()
    ids = [3, 1]
    with torch.no_grad():
        got = m(torch.tensor([ids])).hidden[0].numpy()  # [S, T, D]
    want = hand_forward(m, ids)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
    # the memory term is not negligible here: without it iteration 2 differs
    with torch.no_grad():
        m.blocks[0][0].mem_attn.proj.weight.zero_()
        m.blocks[0][0].mem_attn.proj.bias.zero_()
        no_mem = m(torch.tensor([ids])).hidden[0].numpy()
    np.testing.assert_allclose(no_mem[:, 0], want[:, 0], rtol=0, atol=1e-12)  # iteration 1 has no memory
    assert np.abs(no_mem[:, 1] - want[:, 1]).max() > 1e-3


@pytest.mark.parametrize("t", [1, 2, 3])
def test_causal_in_loop_time(t):
    """Noise added to the first block layer's output at iterations > t (it enters that layer's memory and the
    second layer's input) leaves h_1..h_t bit-identical, and changes the later states."""
    T = 5
    m = memory_model(T=T, n_layer=2, d=8, scale=0.3, seed=2)
    ids = torch.randint(0, 5, (2, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = m(ids).hidden
    n_first = {"n": 0}

    def perturb_first(module, args, out):
        n_first["n"] += 1
        return out + torch.randn_like(out) if n_first["n"] > t else out

    hook = m.blocks[0][0].register_forward_hook(perturb_first)
    try:
        with torch.no_grad():
            got = m(ids).hidden
    finally:
        hook.remove()
    assert torch.equal(got[:, :, :t], ref[:, :, :t])
    if t < T:
        assert not torch.allclose(got[:, :, t:], ref[:, :, t:])


def test_memory_restarts_per_group_and_step_needs_it():
    m = memory_model(groups=(GroupConfig(1, 2), GroupConfig(2, 2)), scale=0.3)
    h0 = m.embed(torch.zeros(1, 3, dtype=torch.long))
    assert [x.shape for x in m.empty_memory(1, h0)] == [(1, 3, 0, 8)] * 2
    with pytest.raises(ValueError, match="loop memory"):
        m.step(h0, h0, 0)
    with pytest.raises(ConfigError, match="loop_memory"):
        ModelConfig(vocab_size=5, block_size=4, loop_form="adapter", loop_memory=True)
    # forward = explicit steps with the memory restarted at the second group
    with torch.no_grad():
        ref = m(torch.zeros(1, 3, dtype=torch.long)).hidden
        h, states = h0, []
        for g, loops in ((0, 2), (1, 2)):
            mem = m.empty_memory(g, h0)
            for _ in range(loops):
                h, outs = m.step_outputs(h, h0, g, memory=mem)
                mem = m.extend_memory(mem, outs)
                states.append(h)
    assert torch.equal(torch.stack(states, 2), ref)


def test_checkpoint_carries_loop_memory(tmp_path):
    m = memory_model(scale=0.3)
    save_checkpoint(tmp_path / "model.pt", m, name="x")
    back, ckpt = load_checkpoint(tmp_path / "model.pt")
    assert ckpt["model_config"]["loop_memory"] is True and back.cfg.loop_memory
    ids = torch.randint(0, 5, (2, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(back(ids).hidden, m(ids).hidden)
    plain = ModelConfig(vocab_size=5, block_size=4)
    assert "loop_memory" not in plain.to_dict()  # models without memory: the config dict of before
    assert ModelConfig.from_dict(plain.to_dict()) == plain


# ---------------------------------------------------------------------------------------------- exact decoding

@pytest.mark.parametrize("policy", ["share", "recompute"])
@pytest.mark.parametrize("groups", [None, (GroupConfig(1, 2), GroupConfig(2, 2))])
def test_decoding_full_depth_equals_uncached_greedy(policy, groups):
    m = memory_model(T=4, groups=groups, n_layer=2, vocab=11, seq=24, d=16, n_prelude=1, n_coda=1, gate="linear",
                     seed=1, scale=0.1)
    p, N = prompts_of(), 6
    ref = greedy(lambda ids: m(ids).logits[:, -1, -1], p, N)
    if groups and policy == "share":
        return  # share needs one looped group (test_generate covers the refusal)
    assert_full_depth_decode_exact(m, policy, p, N, ref)


@pytest.mark.parametrize("groups", [None, (GroupConfig(1, 2), GroupConfig(2, 2))])
def test_decoding_with_exits_recompute_equals_the_forward_at_every_loop(groups):
    """Rows exit at hand-set loops (compaction), policy recompute: every readout the decoder computes equals the
    full forward's at that loop and position, and so does the emitted token's log-probability at its exit loop —
    the exited rows' recomputed loops read their own memory back."""
    m = memory_model(T=4, groups=groups, n_layer=2, vocab=11, seq=24, d=16, n_prelude=1, n_coda=0, seed=3, scale=0.1)
    B, N = 4, 5
    p = prompts_of(B=B, S=3)
    depth = torch.randint(1, 5, (B, N), generator=torch.Generator().manual_seed(4))
    trace: list = []
    r = decode_tokens(decoder_for(m, "recompute"), p, N, DecodeHandRule(depth), trace=trace)
    assert np.array_equal(r.exit_depth, depth.numpy())
    ids = torch.cat([p, torch.from_numpy(r.tokens)], dim=1)
    with torch.inference_mode():
        z = m(ids).logits  # [B, S, T, V]
    for n, t, rows, _h, zt in trace:
        if t >= 0 and zt is not None:
            torch.testing.assert_close(zt[:, 0], z[rows, p.shape[1] - 1 + n, t], rtol=0, atol=1e-5)
    pos = p.shape[1] - 1 + torch.arange(N)
    zexit = z[torch.arange(B)[:, None], pos[None], depth - 1]  # [B, N, V]
    assert np.array_equal(r.tokens, zexit.argmax(-1).numpy())


@pytest.mark.parametrize("causal", [True, False])
def test_latency_engine_compaction_equals_truncated_full_depth(causal):
    torch.manual_seed(1)
    cfg = ModelConfig(vocab_size=5, block_size=9, d_model=16, n_head=2, causal=causal, n_coda=1, loop_memory=True,
                      groups=(GroupConfig(1, 2), GroupConfig(2, 3)))
    m = LoopedTransformer(cfg).eval()
    T, B, S = 5, 7, 9
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 5, (B, S), generator=g)
    scored = torch.rand(B, S, generator=g) < 0.7
    scored[2] = False
    depth = torch.randint(1, T + 1, (B, S), generator=g)
    depth[0] = 1
    with torch.inference_mode():
        ref = m(tokens).logits
    run = early_exit(m, tokens, scored, HandRule(depth))
    want = ref.argmax(-1).gather(2, (depth - 1).unsqueeze(-1)).squeeze(-1)
    assert torch.equal(run.exit_depth, torch.where(scored, depth, 0))
    assert torch.equal(run.pred[scored], want[scored])
