"""Batch-invariant inference kernels (looptrace.models.invariant, looptrace.signals.rowwise).

The property: one row's value is the same whatever else is in the batch (row count 1..16, any position), for
a causal query whatever later positions exist, and for a decoded query whatever its batch. Each kernel is also
checked against a float64 reference (it computes the right thing, not only a reproducible one). CI runs this file
under a second CPU code path too (``ATEN_CPU_CAPABILITY=avx2``, ``MKL_ENABLE_INSTRUCTIONS=AVX2``: Makefile).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from looptrace.models import invariant as I
from looptrace.signals.rowwise import row_norm, row_sum


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("shape", [(16, 48), (64, 16), (64, 192), (256, 1024)])
def test_linear_row_is_independent_of_its_batch(shape):
    K, N = shape
    g = _g(K + N)
    W, b, x0 = torch.randn(N, K, generator=g), torch.randn(N, generator=g), torch.randn(K, generator=g)
    alone = I.linear(x0[None], W, b)[0]
    for M in range(1, 17):
        for pos in {0, M // 2, M - 1}:
            x = torch.randn(M, K, generator=g)
            x[pos] = x0
            assert torch.equal(I.linear(x, W, b)[pos], alone), (M, pos)
    want = x0.double() @ W.double().T + b.double()
    assert torch.allclose(alone.double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    # leading dims are rows too: [B, S, K]
    x3 = torch.randn(3, 5, K, generator=g)
    x3[2, 4] = x0
    assert torch.equal(I.linear(x3, W, b)[2, 4], alone)


def _sdpa64(q, k, v, causal):
    s = (q.double() @ k.double().transpose(-2, -1)) / q.shape[-1] ** 0.5
    if causal:
        S = q.shape[-2]
        s = s.masked_fill(~torch.ones(S, S, dtype=torch.bool).tril(), float("-inf"))
    return torch.softmax(s, -1) @ v.double()


@pytest.mark.parametrize("S", [5, 9, 17, 70])
def test_attention_query_is_independent_of_later_positions_and_of_its_batch(S):
    H, E = 2, 8
    g = _g(S)
    q, k, v = (torch.randn(1, H, S, E, generator=g) for _ in range(3))
    full = I.attention(q, k, v, is_causal=True)
    assert torch.allclose(full.double(), _sdpa64(q, k, v, True), atol=1e-5)
    for S2 in range(1, S + 1):  # later positions cut off (the online engine's truncation)
        part = I.attention(q[..., :S2, :], k[..., :S2, :], v[..., :S2, :], is_causal=True)
        assert torch.equal(part, full[..., :S2, :]), S2
    # the last query decoded alone against the cached keys (no mask) = its row of the causal pass
    assert torch.equal(I.attention(q[..., -1:, :], k, v), full[..., -1:, :])
    # inside a batch of 5, at row 3
    qb, kb, vb = (torch.randn(5, H, S, E, generator=g) for _ in range(3))
    qb[3], kb[3], vb[3] = q[0], k[0], v[0]
    assert torch.equal(I.attention(qb, kb, vb, is_causal=True)[3], full[0])


def test_attention_masks_and_grouped_keys_as_torch_does():
    g = _g(1)
    q = torch.randn(2, 4, 6, 8, generator=g)
    k, v = torch.randn(2, 2, 6, 8, generator=g), torch.randn(2, 2, 6, 8, generator=g)
    mask = torch.rand(6, 6, generator=g) > 0.3
    mask[:, 0] = True  # every query sees one key
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    got = I.attention(q, k, v, attn_mask=mask, enable_gqa=True)
    assert torch.allclose(got, want, atol=1e-6)
    add = torch.randn(6, 6, generator=g)
    assert torch.allclose(I.attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=add),
                          F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                                         attn_mask=add), atol=1e-6)
    with pytest.raises(ValueError, match="dropout_p"):
        I.attention(q, k, v, dropout_p=0.1, enable_gqa=True)


@pytest.fixture
def two_threads():
    """ATen splits a lone row across threads only with more than one (another test module may have set 1)."""
    n = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("V", [11, 1000, 49152, 166144])
def test_row_sum_of_a_lone_row_is_its_value_in_a_batch(V, two_threads):
    x = torch.randn(8, V, generator=_g(V))
    batch = row_sum(x)
    for M in range(1, 9):
        assert torch.equal(row_sum(x[:M]), batch[:M]), M
    assert torch.equal(row_norm(x[:1]), row_norm(x)[:1])
    assert torch.allclose(batch.double(), x.double().sum(-1), rtol=1e-5, atol=1e-3)
    assert torch.allclose(row_norm(x).double(), x.double().norm(dim=-1), rtol=1e-5)
    assert torch.equal(row_sum(x), x.sum(-1))  # a batch keeps ATen's own order (stored values unchanged)
    if V >= 32768:  # what row_sum avoids: ATen's own sum of the lone row differs from its value in the batch
        assert not all(torch.equal(x[i:i + 1].sum(-1), batch[i:i + 1]) for i in range(8))


def test_model_states_do_not_depend_on_the_batch_and_training_keeps_default_kernels():
    from tests.test_generate import own_model

    m = own_model(T=5)
    g = _g(2)
    tok = torch.randint(0, 11, (8, 7), generator=g)
    with torch.inference_mode():
        full = m(tok)
        one = m(tok[5:6])
        cut = m(tok[5:6, :4])
    assert torch.equal(full.hidden[5:6], one.hidden) and torch.equal(full.logits[5:6], one.logits)
    assert torch.equal(full.hidden[5:6, :4], cut.hidden) and torch.equal(full.gate_logits[5:6, :4], cut.gate_logits)
    # with autograd (training) the default kernels run: not the mode, close to it
    seen = []
    m.register_forward_pre_hook(lambda mod, a: seen.append(I.active()))
    out = m(tok[5:6])
    assert seen == [False]
    assert torch.allclose(out.hidden.detach(), one.hidden, atol=1e-5)
    with torch.no_grad():
        m(tok[:1])
    assert seen[-1] is False  # the hook runs before forward enters the mode; inside it the mode is on
    inside = []
    h = m.blocks[0][0].attn.qkv.register_forward_pre_hook(lambda mod, a: inside.append(I.active()))
    with torch.no_grad():
        m(tok[:1])
    h.remove()
    assert inside and all(inside)


def test_decoding_with_compaction_equals_masking_and_batch_one():
    """Exited rows leaving the batch (compaction) and staying in it (masking) give the same tokens, exit depths
    and log-probabilities; so does each row decoded alone."""
    from looptrace.models.decoders import decoder_for
    from looptrace.online.engine import RegistryRule
    from looptrace.online.generate import decode_tokens
    from tests.test_device_rules import _observed
    from tests.test_generate import own_model, prompts_of

    m = own_model(T=5)
    p = prompts_of(B=8, S=3, lo=3, hi=11, seed=7)
    for policy in ("share", "recompute"):
        dec = decoder_for(m, policy)
        for name in ("top1", "kl_prev", "entropy"):
            v = _observed(dec, p, 4, name)
            thr = float(v[len(v) // 2])  # an observed value: a tie for some rows, varied exits
            comp = decode_tokens(dec, p, 4, RegistryRule(name, thr, "float32"))
            mask = decode_tokens(dec, p, 4, RegistryRule(name, thr, "float32"), compact=False)
            assert np.array_equal(comp.tokens, mask.tokens) and np.array_equal(comp.exit_depth, mask.exit_depth)
            assert np.array_equal(comp.logprob, mask.logprob)
            assert len(np.unique(comp.exit_depth)) > 1, (policy, name)  # the rule exits at varied depths
            for i in (0, 5):
                alone = decode_tokens(dec, p[i:i + 1], 4, RegistryRule(name, thr, "float32"))
                assert np.array_equal(alone.tokens[0], comp.tokens[i])
                assert np.array_equal(alone.exit_depth[0], comp.exit_depth[i])
                assert np.array_equal(alone.logprob[0], comp.logprob[i])


def test_model_runs_the_modes_kernels_without_a_mode():
    """The model's inference equals, bit for bit, the same weights in plain ``nn.Linear`` layers run under the
    :class:`BatchInvariant` mode (which substitutes ``F.linear``); and no torch-function mode is entered."""
    import copy

    from tests.test_generate import own_model

    m = own_model(T=5)
    tok = torch.randint(0, 11, (6, 7), generator=_g(3))
    modes = []
    m.blocks[0][0].attn.qkv.register_forward_pre_hook(
        lambda mod, a: modes.append(torch._C._is_torch_function_mode_enabled()))
    with torch.no_grad():
        out = m(tok)
    assert modes and not any(modes)
    plain = copy.deepcopy(m)
    for mod in plain.modules():
        if isinstance(mod, I.Linear):
            mod.__class__ = torch.nn.Linear  # F.linear, which only the mode makes row-wise
    with torch.no_grad(), I.BatchInvariant(key_length=m.cfg.block_size):
        ref = plain(tok)
    for a, b in ((out.hidden, ref.hidden), (out.logits, ref.logits), (out.gate_logits, ref.gate_logits)):
        assert torch.equal(a, b)
