"""Logit statistics (SPEC §3): hand cases with closed forms and an independent float64 numpy computation."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from looptrace.signals.logits import STAT_NAMES, LoopStats, kl_div, logit_stats


def _np_reference(z: np.ndarray, y: np.ndarray) -> dict[str, np.ndarray]:
    """Independent float64 implementation: z [N, T, V], y [N] -> name -> [N, T]."""
    z = z.astype(np.float64)
    N, T, V = z.shape
    zmax = z.max(-1, keepdims=True)
    logp = z - zmax - np.log(np.exp(z - zmax).sum(-1, keepdims=True))
    p = np.exp(logp)
    srt = np.sort(z, axis=-1)
    out = {
        "entropy": -(p * logp).sum(-1),
        "max_prob": p.max(-1),
        "margin": srt[..., -1] - srt[..., -2],
        "target_logprob": np.take_along_axis(logp, y[:, None, None].repeat(T, 1), -1)[..., 0],
        "argmax": z.argmax(-1),
        "kl_final": (p[:, -1:, :] * (logp[:, -1:, :] - logp)).sum(-1),
    }
    nan = np.full((N, 1), np.nan)
    out["kl_prev"] = np.concatenate([nan, (p[:, 1:] * (logp[:, 1:] - logp[:, :-1])).sum(-1)], 1)
    out["kl_prev_rev"] = np.concatenate([nan, (p[:, :-1] * (logp[:, :-1] - logp[:, 1:])).sum(-1)], 1)
    out["logit_change"] = np.concatenate([nan, np.linalg.norm(z[:, 1:] - z[:, :-1], axis=-1)], 1)
    return out


def test_random_logits_match_numpy_float64():
    rng = np.random.default_rng(0)
    N, T, V = 40, 5, 11
    z = (rng.normal(size=(N, T, V)) * 3).astype(np.float32)
    y = rng.integers(0, V, N)
    got = logit_stats(z, y)
    ref = _np_reference(z, y)
    assert set(got) == set(STAT_NAMES)
    for k in STAT_NAMES:
        if k == "argmax":
            assert got[k].dtype == np.int32
            np.testing.assert_array_equal(got[k], ref[k])
            continue
        assert got[k].dtype == np.float32, k
        assert got[k].shape == (N, T)
        np.testing.assert_allclose(got[k], ref[k], rtol=2e-5, atol=2e-6, equal_nan=True, err_msg=k)


def test_missing_at_first_loop_and_zero_final_kl():
    rng = np.random.default_rng(1)
    z = rng.normal(size=(6, 4, 7)).astype(np.float32)
    s = logit_stats(z, rng.integers(0, 7, 6))
    for k in ("kl_prev", "kl_prev_rev", "logit_change"):
        assert np.isnan(s[k][:, 0]).all(), k  # NaN, never 0 (SPEC §3)
        assert np.isfinite(s[k][:, 1:]).all(), k
    assert (s["kl_final"][:, -1] == 0).all()  # KL(p_T ‖ p_T) is exactly 0
    assert (s["kl_final"][:, :-1] > 0).all()


def test_kl_of_two_known_distributions():
    # p = (1/2, 1/2), q = (9/10, 1/10): KL(p‖q) = ½ ln(5/9) + ½ ln 5 ; KL(q‖p) = 0.9 ln 1.8 + 0.1 ln 0.2
    p, q = np.array([0.5, 0.5]), np.array([0.9, 0.1])
    kl_pq = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)
    kl_qp = 0.9 * math.log(0.9 / 0.5) + 0.1 * math.log(0.1 / 0.5)
    assert kl_pq == pytest.approx(0.5108256, abs=1e-6)
    # loop 1 = q, loop 2 = p: kl_prev(t=2) = KL(p_2‖p_1) = KL(p‖q), kl_prev_rev = KL(q‖p)
    z = np.log(np.stack([q, p]))[None].astype(np.float32) + 3.0  # shift-invariant
    s = logit_stats(z, np.array([0]))
    assert s["kl_prev"][0, 1] == pytest.approx(kl_pq, rel=1e-5)
    assert s["kl_prev_rev"][0, 1] == pytest.approx(kl_qp, rel=1e-5)
    assert s["kl_final"][0, 0] == pytest.approx(kl_pq, rel=1e-5)  # KL(p_T‖p_1) with p_T = p
    assert s["max_prob"][0, 0] == pytest.approx(0.9, rel=1e-6)
    assert s["entropy"][0, 1] == pytest.approx(math.log(2), rel=1e-6)
    assert s["target_logprob"][0, 0] == pytest.approx(math.log(0.9), rel=1e-5)
    assert kl_div(torch.log(torch.tensor([[0.5, 0.5]])), torch.log(torch.tensor([[0.9, 0.1]]))).item() == \
        pytest.approx(kl_pq, rel=1e-5)


def test_margin_argmax_entropy_logit_change_hand_cases():
    z = np.array([[[1.0, 3.0, 2.5, -1.0], [0.0, 0.0, 0.0, 0.0], [3.0, 4.0, 0.0, 0.0]]], dtype=np.float32)
    s = logit_stats(z, np.array([2]))
    np.testing.assert_allclose(s["margin"][0], [0.5, 0.0, 1.0])
    np.testing.assert_array_equal(s["argmax"][0], [1, 0, 1])  # ties -> first index
    assert s["entropy"][0, 1] == pytest.approx(math.log(4), rel=1e-6)  # uniform over 4
    assert s["max_prob"][0, 1] == pytest.approx(0.25, rel=1e-6)
    assert s["target_logprob"][0, 1] == pytest.approx(-math.log(4), rel=1e-6)
    # ‖z_2 − z_1‖ = ‖(−1, −3, −2.5, 1)‖ = √17.25 ; ‖z_3 − z_2‖ = ‖(3, 4, 0, 0)‖ = 5
    np.testing.assert_allclose(s["logit_change"][0, 1:], [math.sqrt(17.25), 5.0], rtol=1e-6)


def test_masked_vocabulary_minus_inf_is_finite():
    z = np.array([[[0.0, 0.0, -np.inf], [1.0, -np.inf, -np.inf]]], dtype=np.float32)
    s = logit_stats(z, np.array([0]))
    assert s["entropy"][0, 0] == pytest.approx(math.log(2), rel=1e-6)
    assert s["entropy"][0, 1] == 0.0
    # p_T = (1, 0, 0): KL(p_T‖p_1) = ln 2; KL(p_1‖p_T) = ∞ (p_1 puts mass where p_T has none)
    assert s["kl_final"][0, 0] == pytest.approx(math.log(2), rel=1e-6)
    assert s["kl_prev"][0, 1] == pytest.approx(math.log(2), rel=1e-6)
    assert np.isinf(s["kl_prev_rev"][0, 1])


def test_streaming_equals_batch_and_bad_target():
    rng = np.random.default_rng(2)
    z = torch.from_numpy(rng.normal(size=(8, 3, 5)).astype(np.float32))
    y = torch.from_numpy(rng.integers(0, 5, 8))
    acc = LoopStats(z[:, -1], y)
    rows = [acc.update(z[:, t]) for t in range(3)]
    full = logit_stats(z, y)
    for k in STAT_NAMES:
        np.testing.assert_array_equal(torch.stack([r[k] for r in rows], 1).numpy(), full[k])
    with pytest.raises(ValueError, match="target ids"):
        LoopStats(z[:, -1], torch.full((8,), 5))


def _direct_torch_stats(z: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """The SPEC §3 formulas written out directly in float32 torch, loop by loop (topk for the runner-up,
    argmax, max of log p, every p·x sum masked where p = 0). The online rules of ``pipeline.latency`` and
    ``pipeline.gates`` compute them this way, so the stored statistics must equal these bit for bit."""
    N, T, V = z.shape
    logp = torch.log_softmax(z, dim=-1)
    p = logp.exp()

    def masked(pp, x):
        return torch.where(pp > 0, pp * x, torch.zeros(())).sum(-1)

    top2 = z.topk(2, dim=-1).values
    out = {"entropy": -masked(p, logp), "max_prob": logp.max(-1).values.exp(),
           "margin": top2[..., 0] - top2[..., 1],
           "target_logprob": logp.gather(-1, y.view(N, 1, 1).expand(N, T, 1)).squeeze(-1),
           "argmax": z.argmax(-1).to(torch.int32),
           "kl_final": torch.stack([masked(p[:, -1], logp[:, -1] - logp[:, t]).clamp_min(0) for t in range(T)], 1)}
    nan = torch.full((N, 1), float("nan"))
    out["kl_prev"] = torch.cat([nan] + [masked(p[:, t], logp[:, t] - logp[:, t - 1]).clamp_min(0)[:, None]
                                        for t in range(1, T)], 1)
    out["kl_prev_rev"] = torch.cat([nan] + [masked(p[:, t - 1], logp[:, t - 1] - logp[:, t]).clamp_min(0)[:, None]
                                            for t in range(1, T)], 1)
    out["logit_change"] = torch.cat([nan] + [torch.linalg.vector_norm(z[:, t] - z[:, t - 1], dim=-1)[:, None]
                                             for t in range(1, T)], 1)
    return out


def test_bit_identical_to_the_direct_formulas():
    # ties, probabilities that underflow to 0 with finite log p, a dominant logit, a masked (-inf) entry
    g = torch.Generator().manual_seed(3)
    z = torch.randn(64, 5, 33, generator=g) * 3
    z[:6] = torch.round(z[:6])
    z[6:12, :, :4] = -200.0
    z[12:14, 2, 1] = 150.0
    z[14, 3, 4] = float("-inf")
    y = torch.randint(0, 33, (64,), generator=g)
    got, ref = logit_stats(z, y), _direct_torch_stats(z, y)
    for k in STAT_NAMES:
        g_, r_ = got[k], ref[k].numpy()
        assert g_.dtype == r_.dtype, k
        np.testing.assert_array_equal(g_.view(np.uint32) if g_.dtype == np.float32 else g_,
                                      r_.view(np.uint32) if r_.dtype == np.float32 else r_, err_msg=k)
    assert np.isinf(got["kl_prev_rev"][14, 3])  # the masked entry took the masked path


@pytest.mark.parametrize("threads", [1, 2])
def test_row_groups_give_the_batch_bits(threads):
    """The dump computes the statistics in row groups (capture.dump.stat_row_groups): every grouping — one row
    (ATen's lone-row reduction case at ≥ 32768 entries), three rows, the whole batch — gives the same bits,
    with a -inf entry in one row (the masked sums) and finite rows beside it."""
    from looptrace.capture.dump import stat_row_groups

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(5)
        n, T, V = 7, 3, 40_000
        z = torch.randn(n, T, V, generator=g) * 3
        z[2, :, 11] = float("-inf")
        target = torch.randint(0, V, (n,), generator=g)

        def stats(groups):
            accs = [LoopStats(z[r, -1], target[r]) for r in groups]
            loops = [[a.update(z[r, t]) for a, r in zip(accs, groups, strict=True)] for t in range(T)]
            return {k: torch.stack([torch.cat([q[k] for q in parts]) for parts in loops], 1) for k in STAT_NAMES}

        whole = stats([slice(0, n)])
        assert whole["entropy"].isfinite().all() and whole["kl_prev"][:, 1:].isfinite().all()
        for groups in ([slice(i, i + 1) for i in range(n)], [slice(0, 3), slice(3, 6), slice(6, 7)],
                       stat_row_groups(n, V, torch.device("cpu"))):
            got = stats(groups)
            for k in STAT_NAMES:
                torch.testing.assert_close(got[k], whole[k], rtol=0, atol=0, equal_nan=True, msg=k)
        assert stat_row_groups(n, V, torch.device("cpu")) == [slice(i, min(i + 26, n)) for i in range(0, n, 26)]
        assert stat_row_groups(2048, 49_152, torch.device("cpu"))[0] == slice(0, 21)
    finally:
        torch.set_num_threads(before)
