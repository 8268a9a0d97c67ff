"""The halting regimes of the field (docs/SPEC.md §5): RecurTrace's oracle-supervised head ([RT]) and ACT (Graves
2016), each against a hand computation of its loss on a tiny case; the decoupled head's gradient stops at the
trajectory; the regimes (and a loop-memory model) train end to end; options added after the first checkpoints do
not change the recorded config of the regimes and models that do not use them."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from looptrace.config import ConfigError, to_dict
from looptrace.gates.labels import oracle_continue
from looptrace.models.looped import LoopedTransformer, ModelConfig
from looptrace.models.regimes import (
    RegimeConfig,
    act_halting,
    act_loss,
    oracle_continue_torch,
    oracle_head_loss,
    per_depth_loss,
    regime_loss,
)
from looptrace.models.train import training_gate_logits
from tests.test_regimes import _logits_with_losses

torch.set_num_threads(1)


def _sig(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


# ---------------------------------------------------------------------------------------------- RecurTrace

def test_oracle_labels_equal_the_gates_labels():
    ell = torch.rand(50, 6, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    ell[:5] = 1.0  # ties: no improvement
    for delta in (0.0, 0.01, 0.3):
        got = oracle_continue_torch(ell, delta).numpy()
        assert np.array_equal(got, oracle_continue(ell.numpy(), delta))
        assert not got[:, -1].any()


def test_recurtrace_loss_hand_case():
    ell = [1.0, 0.5, 0.3]
    z, y = _logits_with_losses(ell), torch.tensor([[0]])
    g = [0.2, -0.4, 1.0]
    gates = torch.tensor(g).view(1, 1, 3)
    # delta 0.25: continue_1 = [0.3 < 0.75] = 1, continue_2 = [0.3 < 0.25] = 0, continue_3 = 0 -> stop = 0, 1, 1
    stop = [0.0, 1.0, 1.0]
    bce = [-(s * math.log(_sig(x)) + (1 - s) * math.log(1 - _sig(x))) for s, x in zip(stop, g, strict=True)]
    head = sum(bce) / 3
    uni = sum(ell) / 3
    cfg = RegimeConfig("recurtrace", delta=0.25, head_weight=2.0)
    assert math.isclose(regime_loss(cfg, z, y, gates).item(), uni + 2.0 * head, rel_tol=1e-5)
    geo = RegimeConfig("recurtrace", prior="geometric", lam=0.5, delta=0.25)
    want = 0.5 * 1.0 + 0.25 * 0.5 + 0.25 * 0.3 + head
    assert math.isclose(regime_loss(geo, z, y, gates).item(), want, rel_tol=1e-5)
    assert math.isclose(oracle_head_loss(gates, per_depth_loss(z, y), 0.25).item(), head, rel_tol=1e-5)
    with pytest.raises(ConfigError, match="halting gate"):
        regime_loss(cfg, z, y, None)


def _grads(detach: bool) -> tuple[dict, dict]:
    torch.manual_seed(0)
    cfg = RegimeConfig("recurtrace", detach=detach)
    m = LoopedTransformer(ModelConfig(vocab_size=5, block_size=6, d_model=8, n_head=2, gate=cfg.model_gate))
    idx = torch.randint(0, 5, (3, 6), generator=torch.Generator().manual_seed(1))
    tgt = torch.randint(0, 5, (3, 6), generator=torch.Generator().manual_seed(2))
    out = m(idx)
    gl = training_gate_logits(cfg, m, out)
    assert torch.equal(gl, out.gate_logits)  # same values either way
    oracle_head_loss(gl, per_depth_loss(out.logits, tgt), cfg.delta).sum().backward()
    gate = {n: p.grad for n, p in m.named_parameters() if n.startswith("gate.")}
    rest = {n: p.grad for n, p in m.named_parameters() if not n.startswith("gate.")}
    return gate, rest


def test_decoupled_head_gradient_stops_at_the_trajectory():
    gate, rest = _grads(detach=True)
    assert all(g is not None and g.abs().sum() > 0 for g in gate.values())
    assert all(g is None or g.abs().sum() == 0 for g in rest.values())  # state, norm, head, embeddings: nothing
    gate, rest = _grads(detach=False)  # the variant: the head's gradient flows into the trajectory
    assert sum(float(g.abs().sum()) for g in rest.values() if g is not None) > 0


# ---------------------------------------------------------------------------------------------- ACT

@pytest.mark.parametrize(("lam", "N", "R", "p"), [
    ([0.3, 0.5, 0.4, 0.9], 3, 0.2, [0.3, 0.5, 0.2, 0.0]),  # Σ reaches 1 − ε at loop 3: 0.3 + 0.5 + 0.4 = 1.2
    ([0.1, 0.1, 0.1, 0.1], 4, 0.7, [0.1, 0.1, 0.1, 0.7]),  # never: N = T, R = 1 − 0.3
    ([0.995, 0.5, 0.5, 0.5], 1, 1.0, [1.0, 0.0, 0.0, 0.0]),  # at once: R = 1 − (empty sum)
    ([0.5, 0.495, 0.2, 0.2], 2, 0.5, [0.5, 0.5, 0.0, 0.0]),  # 0.995 ≥ 1 − 0.01
])
def test_act_halting_hand_cases(lam, N, R, p):
    g = torch.logit(torch.tensor(lam, dtype=torch.float64))
    pp, NN, RR = act_halting(g, 0.01)
    assert int(NN) == N and math.isclose(float(RR), R, abs_tol=1e-12)
    np.testing.assert_allclose(pp.numpy(), p, atol=1e-12)
    assert math.isclose(float(pp.sum()), 1.0, abs_tol=1e-12)


def test_act_loss_hand_case_and_ponder_gradient():
    lam = [0.3, 0.5, 0.4, 0.9]
    p, N, R = [0.3, 0.5, 0.2, 0.0], 3, 0.2
    zs = [[0.5, -1.0, 0.2], [1.5, 0.0, -0.3], [2.0, 0.1, 0.0], [-3.0, 4.0, 0.0]]  # [T, V]
    zbar = [sum(p[t] * zs[t][v] for t in range(4)) for v in range(3)]
    ce = math.log(sum(math.exp(x) for x in zbar)) - zbar[0]
    tau = 0.05
    g = torch.logit(torch.tensor(lam, dtype=torch.float64)).view(1, 1, 4)
    z = torch.tensor(zs, dtype=torch.float64).view(1, 1, 4, 3)
    y = torch.tensor([[0]])
    assert math.isclose(act_loss(z, y, g, 0.01, tau).item(), ce + tau * (N + R), rel_tol=1e-12)
    cfg = RegimeConfig("act", tau=tau)
    assert cfg.model_gate == "linear"
    assert math.isclose(regime_loss(cfg, z, y, g).item(), ce + tau * (N + R), rel_tol=1e-12)
    # equal outputs at every loop: the mean field is that output whatever p is, so only the ponder cost moves the
    # gate: d τ(N + R)/d g_t = −τ σ'(g_t) for t < N (R = 1 − Σ_{t<N} λ_t), 0 from N on
    g = g.clone().requires_grad_(True)
    act_loss(torch.tensor(zs[0], dtype=torch.float64).expand(1, 1, 4, 3), y, g, 0.01, tau).sum().backward()
    want = [-tau * lam_t * (1 - lam_t) for lam_t in lam[:2]] + [0.0, 0.0]
    np.testing.assert_allclose(g.grad.flatten().numpy(), want, atol=1e-12)


# ---------------------------------------------------------------------------------------------- config + training

def test_recorded_config_of_existing_regimes_and_models_is_unchanged():
    assert set(to_dict(RegimeConfig("joint"))) == {"kind", "lam", "prior", "gate", "beta"}
    assert to_dict(RegimeConfig("act", tau=0.1))["tau"] == 0.1
    from looptrace.models.train import ModelParams

    assert "loop_memory" not in to_dict(ModelParams())
    assert to_dict(ModelParams(loop_memory=True))["loop_memory"] is True
    with pytest.raises(ConfigError, match="eps"):
        RegimeConfig("act", eps=1.0)


@pytest.mark.parametrize("regime", ["recurtrace", "recurtrace_flow", "recurtrace_mem", "act"])
def test_regimes_train_end_to_end(tmp_path, regime):
    from looptrace.config import BaseConfig
    from looptrace.models.looped import load_checkpoint
    from looptrace.models.train import train_model
    from tests.builders import tiny_train_config

    defs = {"recurtrace": RegimeConfig("recurtrace"), "recurtrace_flow": RegimeConfig("recurtrace", detach=False),
            "recurtrace_mem": RegimeConfig("recurtrace", loop_memory=True), "act": RegimeConfig("act")}
    cfg = tiny_train_config(steps=6, loops=3)
    cfg = dataclasses.replace(cfg, regime_defs={**cfg.regime_defs, **defs})
    metrics = train_model(BaseConfig(threads=1), cfg, "rp", regime, tmp_path / regime, progress=False)
    assert len(metrics["val"]["acc_per_loop"]) == 3
    model, ckpt = load_checkpoint(tmp_path / regime / "model.pt")
    assert model.gate is not None and model.cfg.loop_memory == (regime == "recurtrace_mem")
    assert ckpt["regime"]["kind"] == defs[regime].kind


# ---------------------------------------------------------------------------------------------- native exit rules

def test_native_halting_rules_hand_cases_and_act_consistency():
    from looptrace.rules.registry import get_rule
    from looptrace.rules.scoring import exit_depths

    lam = np.array([[0.3, 0.5, 0.4, 0.9], [0.6, 0.2, 0.7, 0.1]])
    g = np.log(lam / (1 - lam))
    step, act = get_rule("gate_step"), get_rule("act_exit")
    assert step.kind == act.kind == "native" and step.needs_gate
    np.testing.assert_allclose(step.score_of({"gate_logit": g}), lam, atol=1e-12)
    np.testing.assert_allclose(act.score_of({"gate_logit": g}), np.cumsum(lam, axis=1), atol=1e-12)
    assert exit_depths(step.score_of({"gate_logit": g}), np.array([0.55]), "ge")[0].tolist() == [4, 1]
    assert exit_depths(act.score_of({"gate_logit": g}), np.array([0.99]), "ge")[0].tolist() == [3, 3]
    # ACT's inference exit at its native γ = 1 − ε is the N its training loss used
    gl = torch.randn(400, 6, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    _p, N, _R = act_halting(gl, 0.01)
    got = exit_depths(act.score_of({"gate_logit": gl.numpy()}), np.array([0.99]), "ge")[0]
    assert np.array_equal(got, N.numpy())


#: Three hand-made halting sequences λ_t = σ(g_t) over T = 6 loops, and ACT's N for them at ε = 0.1 and ε = 0.01 by
#: the training's definition (act_halting: the first t < T with Σ_{j≤t} λ_j ≥ 1 − ε, else T), worked by hand:
HAND_LAMBDA = np.array([[0.2, 0.3, 0.45, 0.3, 0.1, 0.1],   # Σ = 0.2, 0.5, 0.95, 1.25: ≥ 0.9 at 3, ≥ 0.99 at 4
                        [0.95, 0.5, 0.5, 0.5, 0.5, 0.5],   # Σ = 0.95, 1.45: ≥ 0.9 at 1, ≥ 0.99 at 2
                        [0.1, 0.1, 0.1, 0.1, 0.1, 0.1]])   # Σ ≤ 0.5 before T: N = T = 6 at either ε
HAND_N = {0.1: [3, 1, 6], 0.01: [4, 2, 6]}
#: RecurTrace's head at its own decision, σ(g_t) ≥ 0.5: never for the first (6), at once for the second, never (6).
HAND_GATE_STEP = [6, 1, 6]


def _hand_token_loop(path, reps: int = 10):
    """token_loop.parquet of a gated T = 6 model whose val and test tokens repeat the three sequences of
    :data:`HAND_LAMBDA` ``reps`` times (the other columns: :func:`tests.builders.token_loop_splits`)."""
    from tests.builders import token_loop_splits, write_token_loop

    n = 3 * reps
    splits = token_loop_splits(n=n, T=6, seed=5, gate=True)
    g = np.log(HAND_LAMBDA / (1 - HAND_LAMBDA))
    for cols in splits.values():
        cols["gate_logit"] = np.tile(g, (reps, 1)).astype(np.float32)
    return write_token_loop(path, splits)


@pytest.mark.parametrize("eps", [0.1, 0.01])
def test_act_native_exit_is_the_training_N_in_readouts_and_the_halting_table(tmp_path, eps):
    """ACT's native exit reported by the readouts and the halting table is the N of its training loss, with the ε
    the model's regime trained with (no val calibration); the calibrated reading is its own, separate row."""
    import polars as pl

    from looptrace.diagnose.halting_table import CALIBRATED, halting_table
    from looptrace.rules.readouts import ReadoutsConfig, readouts_model
    from looptrace.rules.scoring import CalibrationConfig

    g = torch.tensor(np.log(HAND_LAMBDA / (1 - HAND_LAMBDA)), dtype=torch.float32)
    assert act_halting(g, eps)[1].tolist() == HAND_N[eps]  # the training code agrees with the hand computation
    geo = _hand_token_loop(tmp_path / "geometry" / "rp-act-s0" / "token_loop.parquet").parent
    regime = {"kind": "act", "gate": "linear", "tau": 0.01, "eps": eps}
    meta = {"model": "rp-act-s0", "task": "rp", "regime": "act", "regime_kind": "act", "regime_def": regime}
    cfg = ReadoutsConfig(rules=("fixed", "gate_step", "act_exit", "act_exit_calibrated", "oracle"))
    out = tmp_path / "readouts"
    readouts_model(geo, cfg, CalibrationConfig(n_quantiles=11), out / "rp-act-s0", meta=meta, progress=False)

    chosen = pl.read_parquet(out / "rp-act-s0" / "chosen.parquet")
    act = chosen.filter(pl.col("rule") == "act_exit").row(0, named=True)
    assert act["threshold"] == 1.0 - eps  # declared by the rule from the regime, not a val quantile
    exits = pl.read_parquet(out / "rp-act-s0" / "chosen_exits.parquet")
    for rule, want in (("act_exit", HAND_N[eps]), ("gate_step", HAND_GATE_STEP)):
        got = exits.filter(pl.col("rule") == rule).sort("token")["exit_depth"].to_list()
        assert got == want * 10, rule  # test tokens 1000.. repeat the three sequences in order
    ops = pl.read_parquet(out / "rp-act-s0" / "operating_points.parquet")
    assert ops.filter((pl.col("rule") == "act_exit") & (pl.col("split") == "test")).height == 1  # one point
    assert ops.filter((pl.col("rule") == "act_exit_calibrated") & (pl.col("split") == "test")).height > 1

    table = halting_table(["rp-act-s0"], out, None)
    native = table.filter(pl.col("method") == "native").row(0, named=True)
    assert native["rules"] == "act_exit" and native["loops"] == pytest.approx(sum(HAND_N[eps]) / 3)
    assert table.filter(pl.col("method") == CALIBRATED)["rules"].to_list() == ["act_exit_calibrated"]


def test_native_rules_declare_their_methods_thresholds():
    from looptrace.rules.registry import get_rule
    from looptrace.signals.halting import ACT_EPS

    act, step = get_rule("act_exit"), get_rule("gate_step")
    assert act.calibration_values(6, None, {"kind": "act", "eps": 0.05}).tolist() == [0.95]
    # an act regime that leaves eps out trains with the regime's default: the same ε here
    assert RegimeConfig("act").eps == ACT_EPS == 0.01
    assert act.calibration_values(6, None, {"kind": "act"}).tolist() == [1.0 - ACT_EPS]
    # a gated model trained otherwise (joint), or outside the train matrix: Graves' ε
    assert act.calibration_values(6, None, {"kind": "joint", "eps": 0.3}).tolist() == [1.0 - ACT_EPS]
    assert act.calibration_values(6, None, None).tolist() == [1.0 - ACT_EPS]
    assert step.calibration_values(6).tolist() == [0.5]
    for name in ("gate_step_calibrated", "act_exit_calibrated", "q_exit"):  # q is a user setting: calibrated
        assert get_rule(name).calibration_values(6, None, {"kind": "act"}) is None


@pytest.mark.parametrize("rule", ["gate_step", "act_exit"])
def test_native_halting_rules_run_online_exactly(rule):
    from tests import test_latency

    test_latency.test_online_rules_reproduce_offline_exit_depths(rule)


def test_halting_profile_trains_the_methods_of_the_field():
    """profiles/halting/params.yaml over params.yaml: RecurTrace (decoupled, flowing, with loop memory) and ACT
    beside geometric and joint, ≥ 3 seeds, every model config buildable; the default matrix has no loop memory."""
    from looptrace.config import load_section
    from looptrace.models.train import TrainConfig, build_model_config
    from looptrace.rules.registry import get_rule
    from tests.import_graph import REPO

    files = [REPO / "params.yaml", REPO / "profiles" / "halting" / "params.yaml"]
    cfg = load_section(TrainConfig, "train", files)
    kinds = {r: cfg.regime(r).kind for r in cfg.regimes}
    assert {"recurtrace", "act", "joint", "geometric"} <= set(kinds.values()) and len(cfg.seeds) >= 3
    mem = {r: build_model_config(cfg.model, cfg.task(t), cfg.regime(r)).loop_memory
           for t in cfg.tasks for r in cfg.regimes}
    assert mem == {r: r == "recurtrace_mem" for r in cfg.regimes}
    assert not cfg.regime("recurtrace_flow").detach and cfg.regime("recurtrace").detach
    default = load_section(TrainConfig, "train", [REPO / "params.yaml"])
    assert not default.model.loop_memory
    import yaml

    readouts = yaml.safe_load(files[1].read_text())["readouts"]["rules"]
    for r in ("gate_step", "act_exit"):
        assert r in readouts and get_rule(r).needs_gate


def test_decoupled_recurtrace_trains_the_fixed_prior_trajectory_bit_for_bit(tmp_path):
    """Same seed, same prior: a decoupled RecurTrace model's every non-head weight equals the `geometric` model's
    (the head's gradient never reaches them, and it is clipped on its own); the flowing variant's do not."""
    from looptrace.config import BaseConfig
    from looptrace.models.looped import load_checkpoint
    from looptrace.models.train import train_model
    from tests.builders import tiny_train_config

    cfg = tiny_train_config(steps=8, loops=3)
    cfg = dataclasses.replace(cfg, regime_defs={
        **cfg.regime_defs, "rt": RegimeConfig("recurtrace", prior="geometric", lam=0.3),
        "rt_flow": RegimeConfig("recurtrace", prior="geometric", lam=0.3, detach=False)})
    sd = {}
    for r in ("geometric", "rt", "rt_flow"):
        train_model(BaseConfig(threads=1), cfg, "rp", r, tmp_path / r, progress=False)
        sd[r] = load_checkpoint(tmp_path / r / "model.pt")[0].state_dict()
    assert set(sd["rt"]) - set(sd["geometric"]) == {"gate.net.weight", "gate.net.bias"}
    assert all(torch.equal(v, sd["rt"][k]) for k, v in sd["geometric"].items())
    assert not all(torch.equal(v, sd["rt_flow"][k]) for k, v in sd["geometric"].items())
