"""Cross-loop causal tracing, exit-gate patching and answer-flip tracking (SPEC §2b) against independent references:
an exactly affine loop map built from looptrace's own LoopedTransformer (a causal position-mixing affine layer,
identity final norm, linear readout and gate) whose patched logit difference and gate logits have a closed form in
matrix powers; hand-made argmax sequences with known flip depths; hand-made gate logits with known halting
distributions; the tasks' answer-changing substitutions against their own labels."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest
import torch
from torch import nn

from looptrace.config import ConfigError
from looptrace.loopmap.config import LoopmapConfig
from looptrace.loopmap.trace_tables import (
    expected_depth,
    flip_depth,
    flip_depth_table,
    gate_patch_table,
    halting_distribution,
    native_exit,
    restored_fraction,
    role_values,
    trace_table,
)
from looptrace.loopmap.tracing import adapter_causal_trace, answer_pairs, trace_sample
from looptrace.models.interface import LoopedTransformerAdapter
from looptrace.models.looped import GroupConfig, LoopedTransformer, ModelConfig
from looptrace.tasks import IGNORE, make_task

D, T, S, V = 3, 4, 5, 4


class CausalAffineLayer(nn.Module):
    """y[i] = A x[i] + C Σ_{j<i} x[j] + c: an affine map of the whole sequence that mixes positions causally."""

    def __init__(self, A: np.ndarray, C: np.ndarray, c: np.ndarray):
        super().__init__()
        self.register_buffer("At", torch.as_tensor(A.T))
        self.register_buffer("Ct", torch.as_tensor(C.T))
        self.register_buffer("c", torch.as_tensor(c))

    def forward(self, x: torch.Tensor, kv=None) -> torch.Tensor:
        before = torch.cumsum(x, dim=1) - x  # Σ_{j<i} x[j]
        return x @ self.At + before @ self.Ct + self.c


def _affine_adapter(seed: int = 0) -> tuple[LoopedTransformerAdapter, dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    A = 0.5 * rng.standard_normal((D, D)) / np.sqrt(D)
    C = 0.3 * rng.standard_normal((D, D)) / np.sqrt(D)
    c = rng.standard_normal(D)
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=V, block_size=S, d_model=D, n_head=1, groups=(GroupConfig(1, T),), loop_form="add",
                      reinject=True, gate="linear")
    model = LoopedTransformer(cfg)
    model.blocks[0] = nn.ModuleList([CausalAffineLayer(A, C, c)])
    model.ln_f = nn.Identity()  # readout and gate linear in h_T
    with torch.no_grad():
        model.wte.weight.normal_(0.0, 1.0)
        model.wpe.weight.normal_(0.0, 1.0)
        model.head.weight.normal_(0.0, 1.0)
        model.gate.net.weight.normal_(0.0, 1.0)
        model.gate.net.bias.fill_(0.3)
    model = model.double()
    adapter = LoopedTransformerAdapter(model, "affine", extra={"regime": {"kind": "joint"}})
    # the whole-sequence map h ← M (h + e) + c̄ on vec(h) (position-major), M block lower-triangular
    M = np.zeros((S * D, S * D))
    for i in range(S):
        M[i * D:(i + 1) * D, i * D:(i + 1) * D] = A
        for j in range(i):
            M[i * D:(i + 1) * D, j * D:(j + 1) * D] = C
    ref = {"M": M, "cbar": np.tile(c, S), "E": model.wte.weight.detach().numpy(),
           "P": model.wpe.weight.detach().numpy(), "W": model.head.weight.detach().numpy(),
           "g": model.gate.net.weight.detach().numpy()[0], "g0": float(model.gate.net.bias.detach())}
    return adapter, ref


def _closed_form(ref, clean: np.ndarray, corrupt: np.ndarray, a: int, yc: int, yx: int):
    """LD_clean, LD_corrupt, LD_patched [T + 1, S] and the gate logits at a [T + 1, S, T] in closed form.

    h_t = M^t e + Σ_{j=1}^{t} M^j e + Σ_{j<t} M^j c̄; a patch at (k ≥ 1, p) adds M^{T−k} P_p (h^c_k − h^x_k) to the
    corrupted h_T, and at (0, p) — the injection too — (M^T + Σ_{j=1}^{T} M^j) P_p (e^c − e^x)."""
    M, cbar = ref["M"], ref["cbar"]
    Mp = [np.linalg.matrix_power(M, j) for j in range(T + 1)]

    def traj(e):
        return [Mp[t] @ e + sum(Mp[j] @ e for j in range(1, t + 1)) + sum(Mp[j] @ cbar for j in range(t))
                for t in range(T + 1)]

    def embed(tok):
        return (ref["E"][tok] + ref["P"][np.arange(S)]).reshape(-1)

    ec, ex = embed(clean), embed(corrupt)
    Hc, Hx = traj(ec), traj(ex)
    w = np.zeros(S * D)
    w[a * D:(a + 1) * D] = ref["W"][yc] - ref["W"][yx]
    gsel = np.zeros(S * D)
    gsel[a * D:(a + 1) * D] = ref["g"]
    ld_c, ld_x = w @ Hc[T], w @ Hx[T]
    ld_p = np.empty((T + 1, S))
    gate = np.empty((T + 1, S, T))
    for k in range(T + 1):
        for p in range(S):
            P = np.zeros(S * D)
            P[p * D:(p + 1) * D] = 1.0
            if k == 0:
                d0 = P * (ec - ex)
                diffs = [Mp[t] @ d0 + sum(Mp[j] @ d0 for j in range(1, t + 1)) for t in range(T + 1)]
            else:
                d0 = P * (Hc[k] - Hx[k])
                diffs = [np.zeros(S * D) if t < k else Mp[t - k] @ d0 for t in range(T + 1)]
            ld_p[k, p] = ld_x + w @ diffs[T]
            gate[k, p] = [gsel @ (Hx[t] + diffs[t]) + ref["g0"] for t in range(1, T + 1)]
    return ld_c, ld_x, ld_p, gate


def test_patched_logit_difference_and_gate_equal_the_affine_closed_form():
    adapter, ref = _affine_adapter()
    rng = np.random.default_rng(1)
    clean = rng.integers(0, V, (3, S))
    corrupt = clean.copy()
    flipped, answer = np.array([1, 0, 2]), np.array([4, 3, 4])
    corrupt[np.arange(3), flipped] = (clean[np.arange(3), flipped] + 1) % V
    yc, yx = np.array([0, 1, 2]), np.array([3, 2, 0])
    out = adapter_causal_trace(adapter, torch.as_tensor(clean), torch.as_tensor(corrupt), answer, yc, yx)
    for b in range(3):
        ld_c, ld_x, ld_p, gate = _closed_form(ref, clean[b], corrupt[b], answer[b], yc[b], yx[b])
        assert out["ld_clean"][b] == pytest.approx(ld_c, rel=1e-10)
        assert out["ld_corrupt"][b] == pytest.approx(ld_x, rel=1e-10)
        np.testing.assert_allclose(out["ld_patched"][b], ld_p, rtol=1e-9, atol=1e-10)
        np.testing.assert_allclose(out["gate_patched"][b], gate, rtol=1e-9, atol=1e-10)
        np.testing.assert_allclose(out["gate_clean"][b], gate[0, flipped[b]], rtol=1e-9)  # e at f: the clean run
        # the cells run: states differ (p ≥ f) and p ≤ a (causal); nothing else is patched
        want = (np.arange(S)[None, :] >= flipped[b]) & (np.arange(S)[None, :] <= answer[b])
        want = np.broadcast_to(want, (T + 1, S)).copy()
        want[0] = np.arange(S) == flipped[b]  # h_0 = the embedding differs at f only (no prelude)
        np.testing.assert_array_equal(out["patched"][b], want)
    # patching the injection at the substituted position restores everything (nothing else differs)
    frac = restored_fraction(out)
    np.testing.assert_allclose(frac[np.arange(3), 0, flipped], 1.0, rtol=1e-9)
    np.testing.assert_allclose(frac[np.arange(3), T, answer], 1.0, rtol=1e-9)  # h_T[a] is what the readout reads


def test_flip_depth_by_hand():
    argmax = np.array([[1, 2, 1, 1], [3, 3, 3, 3], [1, 2, 3, 4], [1, 1, 2, 1], [2, 1, 1, 1]])
    np.testing.assert_array_equal(flip_depth(argmax), [3, 1, 4, 4, 2])
    raw = {"argmax": argmax, "correct": argmax == 1, "sequence": np.array([0, 0, 1, 2, 2]),
           "rho": np.full((5, 4), 2.0), "rho_bound": np.full((5, 4), 2.0), "rel_step": np.full((5, 4), 0.5),
           "entropy": np.tile([0.4, 0.3, 0.2, 0.1], (5, 1)), "exact": True,
           "gate_logit": np.array([[0.1, 0, 0, 0], [5, 5, 5, 5], [-5, -5, -5, -5], [0.1, 0, 0, 0], [-5, 5, 0, 0]])}
    cfg = LoopmapConfig(n_boot=50, eps=(0.1,), entropy_quantiles=1, gate_q=0.5)
    fd = flip_depth_table("m", raw, cfg, seed=0, regime={"kind": "joint"})
    f = fd.row(0, named=True)
    assert f["rule"] == "flip_depth" and f["mean_depth"] == pytest.approx(14 / 5) and f["share_before_flip"] == 0
    fixed = fd.filter(pl.col("rule") == "fixed")
    # fixed depth d exits before F on P(F > d): F = 3, 1, 4, 4, 2
    np.testing.assert_allclose(fixed["share_before_flip"].to_numpy(), [4 / 5, 3 / 5, 2 / 5, 0.0])
    np.testing.assert_allclose(fixed["mean_gap"].to_numpy(), np.arange(1, 5) - 14 / 5)
    # Q-exit at q = 0.5: CDF_1 = σ(g_1) ≥ 0.5 for g_1 > 0 -> 1; row 3 never (1 − (1 − σ(−5))⁴ = 0.026)
    q = fd.filter(pl.col("rule") == "q_exit").row(0, named=True)
    depths = np.array([1, 1, 4, 1, 2])  # row 5: 1 − (1 − σ(−5))(1 − σ(5)) ≥ 0.5 at loop 2
    assert q["threshold"] == 0.5 and q["mean_depth"] == pytest.approx(depths.mean())
    assert q["share_before_flip"] == pytest.approx(np.mean(depths < [3, 1, 4, 4, 2]))
    assert q["accuracy"] == pytest.approx(np.mean((argmax == 1)[np.arange(5), depths - 1]))
    assert q["before_lo"] <= q["share_before_flip"] <= q["before_hi"]
    # ρ̄ = 2 never certifies: the fixed-point exit is T everywhere
    cert = fd.filter(pl.col("rule") == "certified_fixed_point").row(0, named=True)
    assert cert["mean_depth"] == 4 and cert["share_before_flip"] == 0


def test_halting_distribution_and_the_native_exits_by_hand():
    g = np.zeros((1, 3))  # λ = 1/2 every loop
    np.testing.assert_allclose(halting_distribution(g), [[0.5, 0.25, 0.25]])
    assert expected_depth(g)[0] == pytest.approx(1.75)
    big = np.array([[-40.0, 40.0, 0.0]])  # λ ≈ (0, 1, ½): halts at loop 2
    np.testing.assert_allclose(halting_distribution(big), [[0.0, 1.0, 0.0]], atol=1e-15)
    rule, thr, depth = native_exit({"kind": "act", "eps": 0.2}, 0.5)
    assert (rule, thr) == ("act_exit", pytest.approx(0.8))
    assert depth(np.array([[0.0, 0.0, 0.0], [-40.0, -40.0, -40.0]])).tolist() == [2, 3]  # Σλ = .5, 1.0 ≥ .8 -> 2
    rule, thr, depth = native_exit({"kind": "recurtrace"}, 0.9)
    assert (rule, thr) == ("gate_step", 0.5) and depth(big).tolist() == [2]
    assert native_exit(None, 0.3)[:2] == ("q_exit", 0.3)


def _trace_dict(gate: bool = True) -> dict:
    """Three traced sequences of length 5 with T = 2 (loops 0..2): hand-made logit differences and gate logits."""
    n, K = 3, T_ + 1
    ld_p = np.zeros((n, K, S))
    ld_p[0] = np.arange(K * S).reshape(K, S) / 10.0
    ld_p[1] = -1.0
    ld_p[2] = 0.5
    out = {"sequence": np.array([0, 1, 2]), "answer": np.array([4, 4, 3]), "flipped": np.array([1, 3, 0]),
           "ld_clean": np.array([2.0, 1.0, 1.0]), "ld_corrupt": np.array([-2.0, -1.0, 0.5]),  # seq 2: not both ways
           "ld_patched": ld_p}
    pos = np.arange(S)[None, :]
    inside = (pos >= out["flipped"][:, None]) & (pos <= out["answer"][:, None])  # causal: the cells that differ
    out["patched"] = np.broadcast_to(inside[:, None, :], (n, K, S)).copy()
    if gate:
        out["gate_clean"] = np.array([[40.0, 40.0], [40.0, 40.0], [0.0, 0.0]])  # clean halts at loop 1
        out["gate_corrupt"] = np.array([[-40.0, 40.0], [-40.0, 40.0], [0.0, 0.0]])  # corrupt at loop 2
        out["gate_patched"] = np.broadcast_to(out["gate_corrupt"][:, None, None, :], (n, K, S, T_)).copy()
        out["gate_patched"][:, 1, 4, 0] = 40.0  # the state patch at (1, a = 4) restores the gate at loop 1
    return out


T_ = 2


def test_trace_table_roles_by_hand():
    tr = _trace_dict()
    cfg = LoopmapConfig(n_boot=30)
    tab = trace_table("m", tr, cfg, seed=0)
    # seq 2 has LD_corrupt > 0: left out; seq 0: frac = (x/10 + 2)/4, seq 1: (−1 + 1)/2 = 0
    f0 = (np.arange(3 * S).reshape(3, S) / 10.0 + 2.0) / 4.0

    def get(pos, k):
        return tab.filter((pl.col("position") == pos) & (pl.col("loop") == k)).row(0, named=True)

    for k in range(3):
        assert get("answer", k)["restored"] == pytest.approx((f0[k, 4] + 0.0) / 2)
        assert get("flipped", k)["restored"] == pytest.approx((f0[k, 1] + 0.0) / 2)
        # between: seq 0 has positions 2, 3; seq 1 none (f = 3, a = 4)
        b = get("between", k)
        assert b["restored"] == pytest.approx((f0[k, 2] + f0[k, 3]) / 2) and b["n_sequences"] == 1
        assert get("answer-1", k)["restored"] == pytest.approx(f0[k, 3]) and get("answer-1", k)["n_sequences"] == 1
    assert set(tab["position"]) == {"flipped", "between", "answer", "answer-1", "answer-2"}  # causal: no "other"
    assert tab["n_sequences"].max() == 2
    r = get("answer", 2)
    assert r["lo"] <= r["restored"] <= r["hi"]
    x = np.arange(2 * 3 * S, dtype=float).reshape(2, 3, S)
    roles = role_values(x, np.array([3, 4]), np.array([1, 0]), np.zeros((2, 3, S), dtype=bool))
    assert list(roles) == ["flipped", "between", "answer", "answer-1", "answer-2", "answer-3"]
    np.testing.assert_allclose(roles["between"][0], x[0, :, 2])
    np.testing.assert_allclose(roles["answer-3"][1], x[1, :, 1])
    assert np.isnan(roles["answer-3"][0]).all()
    other = role_values(x, np.array([3, 4]), np.array([1, 0]), np.ones((2, 3, S), dtype=bool))
    np.testing.assert_allclose(other["other"][0], (x[0, :, 0] + x[0, :, 4]) / 2)  # both ways: outside [f, a]


def test_gate_patching_by_hand():
    tr = _trace_dict()
    gp = gate_patch_table("m", tr, {"kind": "joint"}, LoopmapConfig(n_boot=30, gate_q=0.5), seed=0)
    ex = gp.filter((pl.col("measure") == "exit_depth") & (pl.col("patch") == "gate_input"))
    # clean exits at 1 (λ_1 = 1), corrupt at 2 (λ_1 = 0, CDF_2 = ½ ≥ q); the clean gate input at loop 1 restores it
    r1, r2 = ex.row(0, named=True), ex.row(1, named=True)
    assert (r1["clean"], r1["corrupt"], r1["patched"]) == (1.0, 2.0, 1.0)
    assert r1["shift"] == -1.0 and r1["restored"] == 1.0 and r1["n_sequences"] == 2
    assert r2["shift"] == 0.0 and r2["restored"] == 0.0  # loop 2's logits are equal in both runs
    ed = gp.filter((pl.col("measure") == "expected_depth") & (pl.col("patch") == "gate_input") & (pl.col("loop") == 1))
    assert ed.row(0, named=True)["corrupt"] == pytest.approx(2.0) and ed.row(0, named=True)["patched"] == 1.0
    st = gp.filter((pl.col("measure") == "exit_depth") & (pl.col("patch") == "state") & (pl.col("loop") == 1))
    assert st.filter(pl.col("position") == "answer").row(0, named=True)["restored"] == 1.0
    assert st.filter(pl.col("position") == "flipped").row(0, named=True)["shift"] == 0.0
    assert gate_patch_table("m", _trace_dict(gate=False), None, LoopmapConfig(), 0).height == 0


@pytest.mark.parametrize("kind,spec", [("running_sum", {"length": 8, "modulus": 3}),
                                       ("running_parity", {"length": 8}),
                                       ("parity", {"max_length": 8}),
                                       ("mano", {"modulus": 5, "max_ops": 3})])
def test_answer_flips_change_the_tasks_own_label(kind, spec):
    task = make_task("t", {"kind": kind, **spec})
    data = task.generate(40, np.random.default_rng(0))
    n_flips = 0
    for r in range(40):
        scored = np.flatnonzero(data.targets[r] != IGNORE)
        a = int(scored[-1])
        for f, v, y2 in task.answer_flips(data.tokens[r], a):
            assert f < a and v != data.tokens[r, f]
            z = data.tokens[r].copy()
            z[f] = v
            if kind.startswith("running"):
                want = int(z[:a + 1].sum() % spec.get("modulus", 2))
            elif kind == "parity":
                want = int(z[(z == 0) | (z == 1)].sum() % 2)
            else:
                want = task.evaluate(z)
            assert y2 == want != data.targets[r, a]
            n_flips += 1
        if kind == "mano":
            assert task.evaluate(data.tokens[r]) == data.targets[r, a]  # the evaluator is the generator's value
    assert n_flips > 40
    pairs = answer_pairs(task, data.tokens, data.targets, seed=3)
    assert (pairs.y_clean != pairs.y_corrupt).all() and (pairs.flipped < pairs.answer).all()
    assert ((pairs.clean != pairs.corrupt).sum(1) == 1).all()
    part = answer_pairs(task, data.tokens[:20], data.targets[:20], seed=3)  # a draw per sequence: the same
    np.testing.assert_array_equal(part.corrupt, pairs.corrupt[pairs.rows < 20])
    assert make_task("x", {"kind": "running_sum", "length": 4, "modulus": 3}).answer_flips(np.array([1, 2]), 0) == []


def test_trace_sample_does_not_depend_on_the_batch_size():
    from tests.builders import tiny_adapter_and_data, tiny_task

    adapter, data = tiny_adapter_and_data(n_seq=7, unscored=True, gate="linear")
    adapter.model.double()
    outs = [trace_sample(adapter, tiny_task(), data.tokens, data.targets, LoopmapConfig(sequences=7, batch_size=bs),
                         seed=1, progress=False) for bs in (7, 3)]
    assert outs[0]["gated"] and len(outs[0]["sequence"]) == 6  # row 2 is unscored
    for key in ("ld_clean", "ld_corrupt", "ld_patched", "gate_patched"):
        np.testing.assert_allclose(outs[1][key], outs[0][key], rtol=1e-9, atol=1e-12, err_msg=key)


def test_config_checks_gate_q():
    with pytest.raises(ConfigError, match="loopmap.gate_q must be in"):
        LoopmapConfig(gate_q=1.0)
