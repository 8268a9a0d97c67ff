"""Intervention windows: a size-0 intervention changes nothing; on a linear loop map the measured decay equals
‖A^j δ‖/‖δ‖ and the linearised prediction; on the tiny model the JVP chain predicts small perturbations; the noise
and the patch donors are drawn per sequence, never repeated across batches."""

import numpy as np
import pytest
import torch

from looptrace.capture.interventions import (
    InterventionConfig,
    adapter_intervention,
    intervene,
    patch_donors,
    perturbation,
    window_summary,
)
from looptrace.config import ConfigError
from tests.builders import run_map, tiny_adapter_and_data


def _linear(A, b):
    At, bt = torch.as_tensor(A.T), torch.as_tensor(b)
    return lambda h, t: h @ At + bt


def test_linear_map_decay_equals_matrix_powers():
    rng = np.random.default_rng(0)
    A = rng.standard_normal((4, 4))
    A *= 0.8 / max(abs(np.linalg.eigvals(A)))
    step = _linear(A, rng.standard_normal(4))
    h0 = torch.as_tensor(rng.standard_normal((3, 5, 4)))
    hidden = run_map(step, h0, 7)
    k = 2
    out = intervene(step, h0, hidden, InterventionConfig(loop=k, scale=0.3, seed=1))
    # δ recovered from the same seeded draw: the effect after j loops is exactly A^j δ
    from looptrace.capture.interventions import perturbation

    delta = perturbation(hidden[:, :, k - 1], InterventionConfig(loop=k, scale=0.3, seed=1)).numpy()
    for j in range(1, 7 - k + 1):
        want = np.linalg.norm(delta @ np.linalg.matrix_power(A, j).T, axis=-1) / np.linalg.norm(delta, axis=-1)
        np.testing.assert_allclose(out["state"][..., j - 1].numpy(), want, rtol=1e-6)
        np.testing.assert_allclose(out["linear"][..., j - 1].numpy(), want, rtol=1e-6)
    np.testing.assert_allclose(out["delta_norm"].numpy(), 0.3 * hidden[:, :, k - 1].norm(dim=-1).numpy(), rtol=1e-6)


def test_size_zero_changes_nothing_and_patching_runs_on_the_tiny_model():
    adapter, data = tiny_adapter_and_data(n_seq=4, unscored=False, gate="none")
    ids = torch.from_numpy(data.tokens)
    zero = adapter_intervention(adapter, ids, InterventionConfig(loop=1, scale=0.0))
    assert float(zero["state"].abs().max()) == 0.0 and float(zero["kl"].abs().max()) == 0.0
    patch = adapter_intervention(adapter, ids, InterventionConfig(loop=0, kind="patch"))
    assert patch["state"].shape == (4, data.tokens.shape[1], adapter.info.n_loops)
    assert float(patch["delta_norm"].min()) >= 0 and torch.isfinite(patch["state"]).all()


def test_small_noise_follows_the_linearised_prediction():
    adapter, data = tiny_adapter_and_data(n_seq=3, unscored=False, gate="none")
    adapter.model.double()
    out = adapter_intervention(adapter, torch.from_numpy(data.tokens), InterventionConfig(loop=0, scale=1e-6))
    torch.testing.assert_close(out["state"], out["linear"], rtol=1e-3, atol=1e-6)  # O(δ) nonlinearity


def test_window_summary_and_bad_config():
    eff = np.array([[1.0, 0.5, 0.05], [1.0, 0.3, 0.01], [1.0, 0.2, 0.02]])
    s = window_summary(eff, 0.1)
    np.testing.assert_allclose(s["median"], [1.0, 0.3, 0.02])
    assert s["window"] == 3 and window_summary(eff, 0.001)["window"] == 4
    with pytest.raises(ConfigError, match="kind"):
        InterventionConfig(kind="blur")


def test_two_batches_get_different_draws_and_a_sequence_the_same_in_any_batch():
    h = torch.as_tensor(np.random.default_rng(0).standard_normal((4, 3, 5)))
    noise = InterventionConfig(loop=1, scale=0.5, seed=2)
    a = perturbation(h, noise, rows=np.arange(0, 4))
    b = perturbation(h, noise, rows=np.arange(4, 8))  # same shape, the next four sequences
    assert not torch.allclose(a, b)
    # sequence 5 drawn alone or in a batch: the same direction
    torch.testing.assert_close(perturbation(h[1:2], noise, rows=np.array([5])), b[1:2], rtol=0, atol=0)
    # the relative size is s per token, whatever the draw
    torch.testing.assert_close(a.norm(dim=-1), 0.5 * h.norm(dim=-1))
    # patching: a derangement (a single cycle) keyed by the rows, another one for other rows
    patch = InterventionConfig(loop=1, kind="patch", seed=2)
    d1, d2 = patch_donors(np.arange(0, 6), 2, 1), patch_donors(np.arange(6, 12), 2, 1)
    for rows, d in ((np.arange(0, 6), d1), (np.arange(6, 12), d2)):
        assert set(d) == set(rows) and not (d == rows).any()
        seen, r = [], int(rows[0])
        for _ in rows:  # one cycle through all of them
            seen.append(r)
            r = int(d[r - rows[0]])
        assert sorted(seen) == list(rows)
    assert not np.array_equal(d1, d2 - 6)  # not the same shift in every batch
    got = perturbation(h, patch, rows=np.arange(4))
    want = h[torch.as_tensor(patch_donors(np.arange(4), 2, 1))] - h
    torch.testing.assert_close(got, want)
    donor = torch.zeros_like(h)
    torch.testing.assert_close(perturbation(h, patch, rows=np.arange(4), donor=donor), -h)  # donors given
    with pytest.raises(ConfigError, match="at least 2 sequences"):
        patch_donors(np.array([3]), 0, 1)
