"""The HF adapters' loop step and loop-block layers on tiny random-weight checkpoints.

Huginn, Ouro and Nanbeige run the stand-ins of their published code (tests/hf_helpers.py; the same checks against
the real code: tests/test_real_code.py), Dory and retrofit (Llama) transformers' own classes. Independent references:

- the states the adapter's :meth:`states` records (the model's own forward) — the step iterated from h_0 must
  reproduce them bit for bit, with and without autograd recording;
- the outputs of the loop block's layers hooked during the model's own forward (Huginn ``forward(num_steps=T)``
  on each sequence alone in its stream, Ouro ``OuroModel.forward``, Nanbeige ``NanbeigeModel.forward``, Dory
  ``DoryModel.forward``, retrofit the plain Llama = pass 1);
- the full Jacobian of the step by reverse mode (``torch.autograd.functional.jacobian``, float64): its diagonal
  blocks' largest singular values for ρ, and Benettin's recursion on the full matrices for the FTLE.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from looptrace.capture.layers import layer_states
from looptrace.config import ConfigError
from looptrace.loopmap.config import InterventionConfig
from looptrace.loopmap.contraction import ContractionConfig, _start_vectors, check_adapter, contraction_stats
from looptrace.loopmap.interventions import adapter_intervention
from looptrace.models.adapters.huginn import sequence_seed
from looptrace.models.adapters.loading import AdapterConfig, load_adapter
from tests import hf_helpers as H

torch.set_num_threads(1)
KINDS = ("huginn", "ouro", "nanbeige", "dory", "retrofit")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("loopstep")
    return {"huginn": H.build_huginn(root / "huginn"), "ouro": H.build_ouro(root / "ouro"),
            "nanbeige": H.build_nanbeige(root / "nanbeige"),
            "dory": H.build_dory(root / "dory"), "retrofit": H.build_llama(root / "llama")}


def _adapter(ckpts, kind, **kw):
    extra = {"huginn": {"trust_remote_code": True}, "ouro": {"trust_remote_code": True},
             "nanbeige": {"trust_remote_code": True}, "dory": {},
             "retrofit": {"block": (1, 3), "n_loops": 3}}[kind]
    return load_adapter(AdapterConfig(kind=kind, path=str(ckpts[kind]), **extra, **kw))


def _ids(b=2, s=7, seed=0):
    return torch.randint(0, H.VOCAB - 4, (b, s), generator=torch.Generator().manual_seed(seed))


def _double(a):
    """The adapter's model in float64 (the Jacobian references are compared to ~1e-10)."""
    a.model.double()
    a.dtype = torch.float64
    return a


def _own_layer_outputs(a, kind, ids):
    """[loop][layer] outputs of the loop block's layers, hooked during the model's own forward."""
    seen: list[torch.Tensor] = []
    hooks = [layer.register_forward_hook(lambda m, i, o: seen.append(o[0] if isinstance(o, tuple) else o))
             for layer in a.loop_layers(0)]
    m = a.model
    try:
        with torch.no_grad():
            if kind == "huginn":  # each sequence alone, in its own stream (as the adapter's exit check runs it)
                per_seq = []
                for i in range(ids.shape[0]):
                    seen.clear()
                    with torch.random.fork_rng():
                        torch.manual_seed(sequence_seed(a.cfg.seed, ids[i]))
                        m(input_ids=ids[i:i + 1], num_steps=a.info.n_loops)
                    per_seq.append(list(seen))
                flat = [torch.cat([p[k] for p in per_seq]) for k in range(len(per_seq[0]))]
            elif kind in ("ouro", "nanbeige"):
                m.model(input_ids=ids, use_cache=False)
                flat = list(seen)
            else:  # dory: its forward loops the recurrent layers; retrofit: the plain Llama is pass 1
                m(input_ids=ids, use_cache=False)
                flat = list(seen)
    finally:
        for h in hooks:
            h.remove()
    L = len(a.loop_layers(0))
    return [flat[t * L:(t + 1) * L] for t in range(len(flat) // L)]


@pytest.mark.parametrize("kind", KINDS)
def test_iterated_step_is_the_models_own_forward_bit_for_bit_with_its_layers(ckpts, kind):
    a = _adapter(ckpts, kind)
    ids = _ids()
    st = a.states(ids)
    T = a.info.n_loops
    own = _own_layer_outputs(a, kind, ids)
    assert len(own) == (1 if kind == "retrofit" else T)
    for grad in (False, True):  # the step is the same computation whether autograd records it or not
        h = st.hidden_init
        with torch.set_grad_enabled(grad):
            for t in range(T):
                h, outs = a.loop_step_layers(h, st.hidden_init, t)
                assert h.requires_grad == grad  # the parameters require grad: with grad on, a graph is built
                assert torch.equal(h, st.hidden[:, :, t]), (kind, t)
                if t < len(own):
                    assert len(outs) == len(own[t]) == len(a.loop_layers(0)) >= 2
                    for j, (x, y) in enumerate(zip(outs, own[t], strict=True)):
                        assert torch.equal(x, y), (kind, t, j)
    # dump.layers' capture (hooks during states()) gives the same layer outputs, every loop
    got = layer_states(a, ids, [1, 0])
    assert got.shape == (2, 7, T, 2, a.info.d_model)
    for t in range(len(own)):
        assert torch.equal(got[:, :, t, 0], own[t][1]) and torch.equal(got[:, :, t, 1], own[t][0])
    if kind not in ("ouro", "nanbeige"):  # layer 1, the last, gives the loop state (Ouro, Nanbeige: norm after)
        assert torch.equal(got[:, :, :, 0], st.hidden)


@pytest.mark.parametrize("kind", KINDS)
def test_rho_and_ftle_equal_the_exact_jacobian(ckpts, kind):
    """Through the adapter's step (JVP/VJP, vmapped one-position tangents) vs the reverse-mode Jacobian: (1) the
    same power method and Benettin recursion run on the explicit matrices, from the same seeded vectors, agree to
    float32 rounding; (2) ρ is the block's largest singular value σ₁ within the power method's truncation error
    (relative error ≲ (σ₂/σ₁)^(2·iters); SPEC §2b) and never above it."""
    a = _double(_adapter(ckpts, kind))
    ids = _ids(b=2, s=4, seed=1)
    st = a.states(ids)
    B, S, T, D = st.hidden.shape
    iters = 60
    # exact_width 1: ``contraction`` is the power method's estimate (what this test follows); the exact block norm
    # and its bound are tests/test_certified_soundness.py's
    cfg = ContractionConfig(power_iters=iters, position_chunk=2, seed=3, exact_width=1)
    out = contraction_stats(lambda h, t: a.loop_step(h, st.hidden_init, t), st.hidden_init, st.hidden, cfg, rows=4)
    h_prev = torch.cat([st.hidden_init[:, :, None], st.hidden[:, :, :-1]], dim=2)
    u, v = _start_vectors((B, S, D), cfg.seed, np.arange(4, 4 + B), torch.device("cpu"), torch.float64)
    u = u.reshape(B, S * D)
    u = u / u.norm(dim=1, keepdim=True)
    v = v / v.norm(dim=-1, keepdim=True)
    log_sum = torch.zeros(B, dtype=torch.float64)
    for t in range(T):
        J = torch.autograd.functional.jacobian(lambda y, t=t: a.loop_step(y, st.hidden_init, t),
                                               h_prev[:, :, t].clone())  # [B, S, D, B, S, D]
        for b in range(B):
            assert float(J[b, :, :, 1 - b].abs().max()) == 0.0  # sequences do not interact
            for i in range(S):
                Jii = J[b, i, :, b, i, :]
                for _ in range(iters):  # the power method on J_ii^T J_ii, warm-started from the previous loop
                    w = Jii.T @ (Jii @ v[b, i])
                    v[b, i] = w / w.norm()
                got = float(out["contraction"][b, i, t])
                assert got == pytest.approx(float((Jii @ v[b, i]).norm()), rel=1e-6), (kind, b, i, t)
                sv = torch.linalg.svdvals(Jii)
                trunc = float((sv[1] / sv[0]) ** (2 * iters))
                assert got <= float(sv[0]) * (1 + 1e-6)
                assert got == pytest.approx(float(sv[0]), rel=max(1e-5, 4 * trunc)), (kind, b, i, t, trunc)
            w = J[b, :, :, b].reshape(S * D, S * D) @ u[b]  # Benettin on the full map (positions mix)
            log_sum[b] += w.norm().log()
            u[b] = w / w.norm()
            share = w.reshape(S, D).pow(2).sum(-1) / w.pow(2).sum()
            np.testing.assert_allclose(out["ftle_share"][b, :, t].numpy(), share.numpy(), rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(out["ftle"][:, 0, t].numpy(), (log_sum / (t + 1)).numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_dump_contraction_and_layers_through_the_adapter(ckpts, kind):
    from looptrace.capture.dump import DumpConfig, dump_split
    from looptrace.io.store.location import memory_store
    from looptrace.tasks import IGNORE, TaskBatch

    a = _adapter(ckpts, kind)
    ids = _ids(b=3, s=9, seed=2).numpy()
    data = TaskBatch(ids[:, :-1], ids[:, 1:], np.full_like(ids[:, :-1], -1), np.zeros_like(ids[:, :-1]))
    cc = ContractionConfig(power_iters=2, position_chunk=4, seed=1)
    base = {"batch_size": 2, "chunk_tokens": 8, "hidden_dtype": "float32"}
    plain = dump_split(a, data, memory_store(), DumpConfig(**base))
    st = dump_split(a, data, memory_store(), DumpConfig(**base, contraction=cc, layers=(0, 1)))
    n, T, D = plain.n_tokens, a.info.n_loops, a.info.d_model
    for name in ("contraction", "ftle", "ftle_share"):
        assert st.read(name).shape == (n, T) and np.isfinite(st.read(name)).all(), name
    assert st.read("layer_hidden").shape == (n, T, 2, D)
    for name in plain.names:  # the options add arrays and change none
        np.testing.assert_array_equal(st.read(name), plain.read(name), err_msg=name)
    mask = data.targets != IGNORE
    for b0 in range(0, 3, 2):  # the same batches, directly (seeded by the batch's first row)
        x = torch.from_numpy(data.tokens[b0:b0 + 2])
        s = a.states(x)
        want = contraction_stats(lambda h, t, s=s: a.loop_step(h, s.hidden_init, t), s.hidden_init, s.hidden, cc, b0)
        rows = np.flatnonzero(np.isin(st.read("sequence"), np.arange(b0, b0 + 2)))
        m = torch.from_numpy(mask[b0:b0 + 2])
        for name, v in want.items():
            np.testing.assert_allclose(st.read(name)[rows], v[m].numpy(), rtol=1e-5, err_msg=name)
        lay = layer_states(a, x, [0, 1])[m].numpy()
        np.testing.assert_array_equal(st.read("layer_hidden")[rows], lay)


@pytest.mark.parametrize("kind", KINDS)
def test_a_size_zero_intervention_changes_nothing(ckpts, kind):
    a = _adapter(ckpts, kind)
    ids = _ids(b=3, s=6)
    zero = adapter_intervention(a, ids, InterventionConfig(loop=1, scale=0.0))
    assert float(zero["state"].abs().max()) == 0.0 and float(zero["kl"].abs().max()) == 0.0
    noise = adapter_intervention(a, ids, InterventionConfig(loop=1, scale=0.1))
    assert noise["state"].shape == (3, 6, a.info.n_loops - 1) and float(noise["state"][..., 0].min()) > 0


def test_huginn_with_test_time_noise_is_refused_and_steps_need_their_batch(ckpts, tmp_path):
    from looptrace.capture.dump import DumpConfig, dump_split
    from looptrace.io.store.location import memory_store
    from looptrace.tasks import TaskBatch

    noisy = H.copy_checkpoint(ckpts["huginn"], tmp_path / "noisy", "loopstep-noise", {"test_time_noise": 0.3})
    a = load_adapter(AdapterConfig(kind="huginn", path=str(noisy), trust_remote_code=True))
    with pytest.raises(ConfigError, match="test_time_noise > 0.*set the checkpoint's test_time_noise to 0"):
        check_adapter(a)
    ids = _ids(b=2, s=6).numpy()
    data = TaskBatch(ids[:, :-1], ids[:, 1:], np.full_like(ids[:, :-1], -1), np.zeros_like(ids[:, :-1]))
    for opt in ({"contraction": ContractionConfig()}, {"layers": (0,)}):
        with pytest.raises(ConfigError, match="test_time_noise"):
            dump_split(a, data, memory_store(), DumpConfig(**opt))
    st = a.states(torch.from_numpy(ids))
    with pytest.raises(ConfigError, match="test_time_noise"):
        a.loop_step(st.hidden_init, st.hidden_init, 0)

    b = _adapter(ckpts, "huginn")
    with pytest.raises(ValueError, match="states\\(\\) of the same batch"):
        b.loop_step(st.hidden_init, st.hidden_init, 0)
    s1 = b.states(_ids(b=2, s=5))
    b.states(_ids(b=2, s=5, seed=9))
    with pytest.raises(ValueError, match="hidden_init of the last states"):
        b.loop_step(s1.hidden_init, s1.hidden_init, 0)


def test_inkling2loop_has_no_loop_step(ckpts, tmp_path):
    a = load_adapter(AdapterConfig(kind="inkling2loop", path=str(H.build_inkling(tmp_path / "inkling"))))
    with pytest.raises(ConfigError, match="exposes no loop step"):
        check_adapter(a)
