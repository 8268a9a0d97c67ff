"""Local contraction at capture time (SPEC §2b): the exact block norm and its upper bound, the power method and the
Benettin FTLE on closed-form linear loop maps, the JVPs/VJPs on looptrace's tiny model against finite differences and
an exact Jacobian, and per-sequence seeding (the values do not depend on the batching)."""

import numpy as np
import pytest
import torch

from looptrace.capture.contraction import (
    ContractionConfig,
    block_norm_bound,
    contraction_stats,
    diagonal_block_norm,
    diagonal_jvp,
    round_up_float32,
)
from looptrace.config import ConfigError
from looptrace.models.interface import LoopedTransformerAdapter
from looptrace.models.looped import GroupConfig, LoopedTransformer, ModelConfig
from tests.builders import run_map


def _nonnormal(rng, eigs):
    """A = Q diag(eigs) Q^{-1} with a non-orthogonal Q: ‖A‖₂ > ρ(A) (so the two estimates differ)."""
    q = rng.standard_normal((len(eigs), len(eigs))) + 2 * np.eye(len(eigs))
    return q @ np.diag(eigs) @ np.linalg.inv(q)


def _linear_step(A, M=None, b=None):
    """h[i] <- A h[i] + M h[i−1] + b: the diagonal block is A whatever M (M mixes positions, as attention does)."""
    At = torch.as_tensor(A.T)
    Mt = None if M is None else torch.as_tensor(M.T)
    bt = 0 if b is None else torch.as_tensor(b)

    def step(h, t):
        out = h @ At + bt
        if Mt is not None:
            out = out + torch.nn.functional.pad(h[:, :-1] @ Mt, (0, 0, 1, 0))
        return out

    return step


def test_power_method_equals_spectral_norm_of_the_diagonal_block():
    rng = np.random.default_rng(0)
    A = _nonnormal(rng, [0.9, 0.5, -0.3, 0.1])
    M = rng.standard_normal((4, 4))  # cross-position coupling must not leak into the diagonal block
    step = _linear_step(A, M, rng.standard_normal(4))
    h = torch.as_tensor(rng.standard_normal((2, 5, 4)))
    sigma, v = diagonal_block_norm(lambda x: step(x, 0), h, torch.as_tensor(rng.standard_normal((2, 5, 4))), 30)
    want = np.linalg.norm(A, 2)  # closed form: the largest singular value
    assert want > max(abs(np.linalg.eigvals(A))) + 0.05  # non-normal: ‖A‖₂ ≠ ρ(A)
    np.testing.assert_allclose(sigma.numpy(), want, atol=1e-4)
    assert v.shape == (2, 5, 4)


def test_ftle_tends_to_log_spectral_radius_and_stats_shapes():
    rng = np.random.default_rng(1)
    A = _nonnormal(rng, [0.8, 0.5, -0.4])
    step = _linear_step(A, b=rng.standard_normal(3))
    T = 400
    h0 = torch.as_tensor(rng.standard_normal((2, 3, 3)))
    out = contraction_stats(step, h0, run_map(step, h0, T), ContractionConfig(power_iters=20))
    assert set(out) == {"contraction", "contraction_bound", "ftle", "ftle_share"} and out["ftle"].shape == (2, 3, T)
    # d = 3 ≤ exact_width: the block read whole, ρ_t = ‖A‖₂ to float32, and its bound never below it
    np.testing.assert_allclose(out["contraction"].numpy(), np.linalg.norm(A, 2), rtol=1e-6)
    assert (out["contraction_bound"].double().numpy() >= np.linalg.norm(A, 2)).all()
    np.testing.assert_allclose(out["contraction_bound"].numpy(), np.linalg.norm(A, 2), rtol=1e-6)
    # wider than exact_width: the power-method estimate, no bound (NaN)
    est = contraction_stats(step, h0, run_map(step, h0, 5), ContractionConfig(power_iters=20, exact_width=2))
    np.testing.assert_allclose(est["contraction"].numpy(), np.linalg.norm(A, 2), atol=1e-4)
    assert est["contraction_bound"].isnan().all()
    # log‖A^T u‖/T = log ρ + O(1/T) (the initial component along the top eigenvector)
    np.testing.assert_allclose(out["ftle"][:, :, -1].numpy(), np.log(0.8), atol=1e-2)
    np.testing.assert_allclose(out["ftle_share"].sum(dim=1).numpy(), 1.0, atol=1e-5)  # shares of one sequence


def test_ftle_of_a_scaled_identity_is_exact_at_every_loop():
    c = 0.7
    step = _linear_step(c * np.eye(3))
    h0 = torch.as_tensor(np.random.default_rng(2).standard_normal((1, 4, 3)))
    out = contraction_stats(step, h0, run_map(step, h0, 5), ContractionConfig(power_iters=1))
    np.testing.assert_allclose(out["ftle"].numpy(), np.log(c), rtol=1e-6)
    np.testing.assert_allclose(out["contraction"].numpy(), c, rtol=1e-6)


def _tiny(form="add"):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=11, block_size=12, d_model=16, n_head=2, groups=(GroupConfig(2, 2), GroupConfig(1, 1)),
                      loop_form=form)
    return LoopedTransformer(cfg).double().eval()


@pytest.mark.parametrize("form", ["add", "norm_add", "adapter"])
def test_jvp_of_the_tiny_model_equals_finite_differences(form):
    model = _tiny(form)
    ad = LoopedTransformerAdapter(model, "tiny")
    ids = torch.randint(0, 11, (2, 7), generator=torch.Generator().manual_seed(3))
    st = ad.states(ids)
    h = st.hidden[:, :, 0].clone()
    v = torch.randn(h.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    f = lambda x: ad.loop_step(x, st.hidden_init, 1)  # noqa: E731
    got = diagonal_jvp(f, h, v, chunk=3)
    eps = 1e-5
    with torch.no_grad():
        for i in range(h.shape[1]):  # central difference, one position perturbed at a time: error O(eps²)
            e = torch.zeros_like(h)
            e[:, i] = v[:, i]
            fd = (f(h + eps * e) - f(h - eps * e))[:, i] / (2 * eps)
            torch.testing.assert_close(got[:, i], fd, atol=1e-7, rtol=1e-6)


@pytest.mark.parametrize("exact_width", [256, 1])  # the block read whole; the power method (d = 16 > 1)
def test_contraction_on_the_tiny_model_equals_the_exact_block_svd(exact_width):
    model = _tiny("adapter")
    ad = LoopedTransformerAdapter(model, "tiny")
    ids = torch.randint(0, 11, (1, 5), generator=torch.Generator().manual_seed(5))
    st = ad.states(ids)
    out = contraction_stats(lambda x, t: ad.loop_step(x, st.hidden_init, t), st.hidden_init, st.hidden,
                            ContractionConfig(power_iters=60, position_chunk=2, exact_width=exact_width))
    h_prev = torch.cat([st.hidden_init[:, :, None], st.hidden[:, :, :-1]], dim=2)
    for t in range(st.hidden.shape[2]):  # the full Jacobian by reverse mode, then its diagonal blocks' SVD
        J = torch.autograd.functional.jacobian(lambda x, t=t: ad.loop_step(x, st.hidden_init, t), h_prev[:, :, t])
        for i in range(5):
            want = float(torch.linalg.matrix_norm(J[0, i, :, 0, i, :], ord=2))
            assert float(out["contraction"][0, i, t]) == pytest.approx(want, rel=1e-6 if exact_width > 1 else 1e-5)
            if exact_width > 1:  # an upper bound, above by no more than the margin and the float32 rounding up
                bound = float(out["contraction_bound"][0, i, t])
                assert want <= bound <= want * (1 + 1e-6)
            else:
                assert np.isnan(float(out["contraction_bound"][0, i, t]))


def test_block_bound_is_above_the_spectral_norm_and_rounded_up_to_float32():
    rng = np.random.default_rng(6)
    A = _nonnormal(rng, [0.95, 0.9, -0.6, 0.2, 0.1])
    M = rng.standard_normal((5, 5))
    step = _linear_step(A, M, rng.standard_normal(5))
    h = torch.as_tensor(rng.standard_normal((3, 4, 5)))
    sigma, bound = block_norm_bound(lambda x: step(x, 0), h, chunk=2)
    want = np.linalg.norm(A, 2)
    np.testing.assert_allclose(sigma.numpy(), want, rtol=1e-14)  # one-hot cotangents read A exactly
    margin = 5 * 2 * np.finfo(np.float64).eps * np.linalg.norm(A, "fro")  # d·(ε_J + ε₆₄)·‖A‖_F
    np.testing.assert_allclose(bound.numpy() - sigma.numpy(), margin, rtol=0, atol=4 * np.finfo(np.float64).eps)
    some = block_norm_bound(lambda x: step(x, 0), h, chunk=3, positions=np.array([1, 3]))
    assert torch.equal(some[1][:, [1, 3]], bound[:, [1, 3]]) and some[1][:, [0, 2]].isnan().all()  # only those read
    x = torch.tensor([0.1, 1 / 3, 0.5, 2.0 ** -30 * 3], dtype=torch.float64)
    up = round_up_float32(x)
    assert (up.double() >= x).all() and (up.double() - x <= x * 2.0 ** -23).all()
    assert float(up[2]) == 0.5  # a float32 value stays


def test_every_sequence_gets_the_same_values_in_any_batch():
    """Start vectors drawn per sequence (seed, index in the split): two batchings give the same FTLE and estimate."""
    model = _tiny("add")
    ad = LoopedTransformerAdapter(model, "tiny")
    ids = torch.randint(0, 11, (5, 6), generator=torch.Generator().manual_seed(7))
    cfg = ContractionConfig(power_iters=2, position_chunk=4, seed=3, exact_width=1)  # the seeded power method too

    def stats(rows):
        st = ad.states(ids[rows])
        return contraction_stats(lambda x, t: ad.loop_step(x, st.hidden_init, t), st.hidden_init, st.hidden, cfg,
                                 rows=rows)

    whole = stats(np.arange(5))
    parts = [stats(np.array([3, 0])), stats(np.array([1, 2, 4]))]
    for name in whole:
        got = torch.cat([parts[0][name], parts[1][name]])[torch.as_tensor([1, 2, 3, 0, 4])]
        torch.testing.assert_close(got, whole[name], rtol=1e-12, atol=0, equal_nan=True, msg=name)
    # the batch's first row alone (consecutive sequences) means the same
    st = ad.states(ids)
    torch.testing.assert_close(contraction_stats(lambda x, t: ad.loop_step(x, st.hidden_init, t), st.hidden_init,
                                                 st.hidden, cfg, rows=0)["ftle"], whole["ftle"])
    assert not torch.equal(whole["ftle"][0], whole["ftle"][1])  # not one draw for all


def test_bad_config():
    with pytest.raises(ConfigError, match="power_iters"):
        ContractionConfig(power_iters=0)
    with pytest.raises(ConfigError, match="exact_width"):
        ContractionConfig(exact_width=0)


def test_dump_option_stores_the_stats_of_every_scored_token_and_is_off_by_default():
    from looptrace.capture.dump import DumpConfig, dump_split
    from looptrace.io.store.location import memory_store
    from looptrace.tasks import IGNORE
    from tests.builders import tiny_adapter_and_data

    adapter, data = tiny_adapter_and_data(n_seq=9, unscored=True)
    cc = ContractionConfig(power_iters=3, position_chunk=3, seed=5)
    plain = dump_split(adapter, data, memory_store(), DumpConfig(batch_size=4, chunk_tokens=16))
    with_c = dump_split(adapter, data, memory_store(), DumpConfig(batch_size=4, chunk_tokens=16, contraction=cc))
    assert not {"contraction", "contraction_bound", "ftle", "ftle_share"} & set(plain.names)
    assert "contraction" not in plain.attrs["params"]  # a default store's attributes are unchanged
    assert with_c.attrs["params"]["contraction"] == {"power_iters": 3, "position_chunk": 3, "seed": 5,
                                                     "exact_width": 256}
    for name in plain.names:  # the option adds arrays and changes none
        np.testing.assert_array_equal(with_c.read(name), plain.read(name), err_msg=name)
    mask = data.targets != IGNORE
    T = adapter.info.n_loops
    for b0 in range(0, len(data), 4):  # the same batches, computed directly (seeded by each sequence's index)
        ids = torch.from_numpy(data.tokens[b0:b0 + 4])
        with torch.no_grad():
            st = adapter.states(ids)
        want = contraction_stats(lambda h, t, st=st: adapter.loop_step(h, st.hidden_init, t), st.hidden_init,
                                 st.hidden, cc, b0)
        rows = np.flatnonzero(np.isin(with_c.read("sequence"), np.arange(b0, b0 + 4)))
        m = torch.from_numpy(mask[b0:b0 + 4])
        for name, x in want.items():
            np.testing.assert_allclose(with_c.read(name)[rows], x[m].numpy(), rtol=1e-5, err_msg=name)
    assert with_c.read("contraction").shape == (with_c.n_tokens, T)
    assert np.all(with_c.read("contraction") > 0) and np.all(np.isfinite(with_c.read("ftle")))
    assert np.all(with_c.read("contraction_bound") >= with_c.read("contraction"))  # d = 16: exact, bounded


def test_an_adapter_without_a_loop_step_is_refused_before_writing():
    from looptrace.capture.dump import DumpConfig, dump_split
    from looptrace.io.store.location import memory_store
    from looptrace.models.interface import LoopedModelAdapter
    from tests.builders import tiny_adapter_and_data

    inner, data = tiny_adapter_and_data(n_seq=3, unscored=False)

    class NoStep(LoopedModelAdapter):
        info = inner.info

        def states(self, input_ids):
            return inner.states(input_ids)

        def readout(self, h, loop):
            return inner.readout(h, loop)

    with pytest.raises(ConfigError, match="no loop step.*dump.contraction: null"):
        dump_split(NoStep(), data, memory_store(), DumpConfig(contraction=ContractionConfig()))


def test_params_section_turns_it_on():
    from looptrace.capture.dump import DumpConfig
    from looptrace.config import from_dict

    assert DumpConfig().contraction is None  # off by default: default stores unchanged
    cfg = from_dict(DumpConfig, {"contraction": {"power_iters": 2}}, "dump")
    assert cfg.contraction == ContractionConfig(power_iters=2)
    with pytest.raises(ConfigError, match="power_iters"):
        from_dict(DumpConfig, {"contraction": {"power_iters": 0}}, "dump")
