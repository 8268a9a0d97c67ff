"""A user's own exit rule (tests/user_rules.py), named in params, runs through the whole pipeline like a
built-in: calibrated (operating_points, pareto), diagnosed (failure_classes), drawn (report figure) and run
with real early exit (latency, exact). Also: the entry-point route, the refusals (non-causal, cross-token,
unknown name, built-in name clash, not a rule) and the registry's built-ins."""

from __future__ import annotations

import textwrap

import numpy as np
import polars as pl
import pytest
import torch
import yaml

from looptrace.config import ConfigError, from_dict
from looptrace.io.tables import SplitArrays
from looptrace.rules import ExitRule, exit_rule, get_rule
from looptrace.rules.builtin import ALL_RULES
from looptrace.rules.evaluate import ReadoutsConfig, evaluate_model_rules
from looptrace.rules.scoring import CalibrationConfig
from tests import user_rules

RULE = "tests.user_rules:confident_and_stable"
NAME = "confident_and_stable"
MODEL = "running_sum-joint"  # a <task>-<regime> of params.yaml's train.task_defs × regime_defs


# ----------------------------------------------------------------------------------------------
# Independent evaluation of the user rule, straight from the dump stores (explicit per-token loops)
# ----------------------------------------------------------------------------------------------


def _store_arrays(st) -> dict[str, np.ndarray]:
    return {"max_prob": st.read("max_prob").astype(np.float64), "argmax": st.read("argmax").astype(np.int64),
            "target": st.read("target").astype(np.int64), "difficulty": st.read("difficulty").astype(np.int64)}


def _exit(mp: np.ndarray, am: np.ndarray, g: float) -> int:
    """1-based exit of one token: the first t ≥ 2 with max_prob_t ≥ γ and argmax_t = argmax_{t−1}, else T."""
    T = mp.size
    return next((t + 1 for t in range(1, T) if am[t] == am[t - 1] and mp[t] >= g), T)


def _independent(val: dict, test: dict, n_quantiles: int = 51, delta: float = 0.5) -> dict:
    same = val["argmax"][:, 1:] == val["argmax"][:, :-1]
    grid = np.percentile(val["max_prob"][:, 1:][same], np.linspace(0.5, 99.5, n_quantiles))
    out = {"grid": grid}
    for split, d in (("val", val), ("test", test)):
        ex = np.array([[_exit(d["max_prob"][i], d["argmax"][i], g) for i in range(d["target"].size)] for g in grid])
        right = d["argmax"][np.arange(d["target"].size)[None], ex - 1] == d["target"][None]
        out[split] = {"exits": ex, "depth": ex.mean(1), "acc": right.mean(1),
                      "full": float((d["argmax"][:, -1] == d["target"]).mean())}
    v = out["val"]
    ok = [k for k in range(grid.size) if v["acc"][k] >= v["full"] - delta / 100 - 1e-12]
    out["chosen"] = min(ok, key=lambda k: (v["depth"][k], -v["acc"][k], k))
    return out


def _front(depth: np.ndarray, acc: np.ndarray) -> set[tuple[float, float]]:
    pts = list(zip(depth.tolist(), acc.tolist(), strict=True))
    return {p for p in pts if not any(q[0] <= p[0] and q[1] >= p[1] and q != p for q in pts)}


# ----------------------------------------------------------------------------------------------
# The tiny pipeline: checkpoint -> dump -> geometry (library), then readouts, diagnose, latency, report (CLI)
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pipeline_run(tmp_path_factory):
    from pathlib import Path

    from typer.testing import CliRunner

    from looptrace.capture.dump import DumpConfig, dump_model
    from looptrace.cli import app
    from looptrace.geometry import GeometryConfig, geometry_model
    from looptrace.models.interface import LoopedTransformerAdapter
    from looptrace.models.looped import GroupConfig, LoopedTransformer, ModelConfig, save_checkpoint
    from looptrace.tasks import make_task

    torch.set_num_threads(1)
    repo = Path(__file__).resolve().parents[1]
    root = tmp_path_factory.mktemp("user_rule") / "artifacts"
    task = make_task("rs", {"kind": "running_sum", "length": 8, "modulus": 5})
    torch.manual_seed(3)
    model = LoopedTransformer(ModelConfig(vocab_size=5, block_size=8, d_model=16, n_head=2, gate="linear",
                                          groups=(GroupConfig(1, 5),))).eval()
    seeds = {"fit": 42, "val": 43, "test": 44}
    ckpt = root / "train" / MODEL / "model.pt"
    save_checkpoint(ckpt, model, name=MODEL, task={"name": "rs", **task.spec()}, data_seeds=seeds)
    adapter = LoopedTransformerAdapter.from_checkpoint(ckpt)
    stores = dump_model(adapter, task, {"val": 43, "test": 44}, root / "dump" / MODEL,
                        DumpConfig(sequences={"val": 40, "test": 40}, batch_size=8, chunk_tokens=64), progress=False)
    geometry_model(stores, GeometryConfig(splits=("val", "test"), eps={"kl_prev": (1e-3,)}),
                   root / "geometry" / MODEL, progress=False)

    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["train"]["tasks"], params["train"]["regimes"] = ["running_sum"], ["joint"]
    params["train"]["seeds"] = []  # one unsuffixed model, MODEL
    params["readouts"]["rules"] = ["fixed", "top1", RULE, "q_exit", "oracle"]
    params["latency"].update(rules=["top1", RULE], batch_sizes=[1, 16], bs1_sequences=8, repeats=1)
    pfile = root.parent / "params.yaml"
    pfile.write_text(yaml.safe_dump(params))
    drawn: dict[str, list[str]] = {}
    import looptrace.report.figures as report

    save = report._save

    def recording_save(fig, path, dpi):  # what each figure draws: legend entries and y tick labels
        drawn[path.name] = [t.get_text() for lg in fig.legends for t in lg.get_texts()] + [
            t.get_text() for ax in fig.axes for t in ax.get_yticklabels()] + [
            t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()]
        return save(fig, path, dpi)

    run = CliRunner()
    args = ["--params", str(pfile)]
    outs = {}
    mp = pytest.MonkeyPatch()
    mp.setattr(report, "_save", recording_save)
    try:
        outs["readouts"] = run.invoke(app, ["readouts", "--model", MODEL, *args, "--geometry-root",
                                            str(root / "geometry"), "--out", str(root / "readouts")])
        outs["diagnose"] = run.invoke(app, ["diagnose", *args, "--readouts-root", str(root / "readouts"),
                                            "--gates-root", str(root / "gates"), "--geometry-root",
                                            str(root / "geometry"), "--out", str(root / "diagnose")])
        outs["latency"] = run.invoke(app, ["latency", *args, "--train-root", str(root / "train"), "--dump-root",
                                           str(root / "dump"), "--readouts-root", str(root / "readouts"),
                                           "--gates-root", str(root / "gates"), "--out", str(root / "latency")])
        outs["report"] = run.invoke(app, ["report", *args, "--root", str(root), "--out", str(root / "report")])
    finally:
        mp.undo()
    for k, res in outs.items():
        assert res.exit_code == 0, (k, res.output)
    val = _store_arrays(stores["val"])
    test = _store_arrays(stores["test"])
    return {"root": root, "val": val, "test": test, "ref": _independent(val, test), "drawn": drawn,
            "outs": outs}


def test_user_rule_calibrated_and_on_the_pareto_front(pipeline_run):
    root, ref = pipeline_run["root"], pipeline_run["ref"]
    rd = root / "readouts" / MODEL
    ops = pl.read_parquet(rd / "operating_points.parquet")
    assert list(dict.fromkeys(ops["rule"].to_list())) == ["fixed", "top1", NAME, "q_exit", "oracle"]
    for split in ("val", "test"):
        o = ops.filter((pl.col("rule") == NAME) & (pl.col("split") == split))
        assert o["kind"].unique().to_list() == ["posthoc"] and o.height == 51
        np.testing.assert_array_equal(o["threshold"].to_numpy(), ref["grid"])
        np.testing.assert_allclose(o["mean_depth"].to_numpy(), ref[split]["depth"], rtol=0, atol=1e-12)
        np.testing.assert_allclose(o["accuracy"].to_numpy(), ref[split]["acc"], rtol=0, atol=1e-12)
    assert len(np.unique(ref["test"]["depth"])) > 3  # the rule really moves the exits
    par = pl.read_parquet(rd / "pareto.parquet").filter(pl.col("rule") == NAME)
    assert par.height > 0
    assert set(zip(par["mean_depth"].to_list(), par["accuracy"].to_list(), strict=True)) == \
        _front(ref["test"]["depth"], ref["test"]["acc"])
    k = ref["chosen"]
    ch = pl.read_parquet(rd / "chosen.parquet").filter(pl.col("rule") == NAME).row(0, named=True)
    assert ch["threshold"] == ref["grid"][k] and ch["index"] == k
    assert ch["test_depth"] == pytest.approx(ref["test"]["depth"][k], abs=1e-12)
    ex = pl.read_parquet(rd / "chosen_exits.parquet").filter(pl.col("rule") == NAME).sort("token")
    np.testing.assert_array_equal(ex["exit_depth"].to_numpy(), ref["test"]["exits"][k])


def test_user_rule_in_diagnose_failure_classes(pipeline_run):
    root, ref, test = pipeline_run["root"], pipeline_run["ref"], pipeline_run["test"]
    fc = pl.read_parquet(root / "diagnose" / "failure_classes.parquet")
    row = fc.filter((pl.col("rule") == NAME) & (pl.col("group") == "all")).row(0, named=True)
    ex = ref["test"]["exits"][ref["chosen"]]
    correct = test["argmax"] == test["target"][:, None]
    want = {"correct": 0, "trajectory": 0, "readout_early": 0, "readout_overthinking": 0}
    for i, d in enumerate(ex):  # SPEC §7, token by token
        c = correct[i]
        if c[d - 1]:
            want["correct"] += 1
        elif not c.any():
            want["trajectory"] += 1
        elif d < int(np.argmax(c)) + 1:
            want["readout_early"] += 1
        else:
            want["readout_overthinking"] += 1
    assert {k: row[k] for k in want} == want and row["source"] == "readouts" and row["kind"] == "posthoc"
    assert row["n_tokens"] == ex.size and sum(want.values()) == ex.size


def test_user_rule_drawn_in_the_report(pipeline_run):
    root, drawn = pipeline_run["root"], pipeline_run["drawn"]
    assert f"{NAME} — user rule" in drawn["pareto_running_sum.png"]   # its Pareto front, in colour (issue 25)
    assert NAME in drawn["failure_classes.png"]      # its failure classes
    assert f"rule: {NAME}" in drawn["latency.png"]   # its real early exit
    assert (root / "report" / "figures" / "pareto_running_sum.png").stat().st_size > 0
    assert "pareto_running_sum.png" in (root / "report" / "index.html").read_text()


def test_user_rule_runs_with_real_early_exit_exactly(pipeline_run):
    root, ref, test = pipeline_run["root"], pipeline_run["ref"], pipeline_run["test"]
    lat = pl.read_parquet(root / "latency" / "latency.parquet").filter(pl.col("rule") == NAME).sort("batch_size")
    assert lat["batch_size"].to_list() == [1, 16] and lat["exact"].all() and lat["source"].to_list() == ["readouts"] * 2
    ex = ref["test"]["exits"][ref["chosen"]]
    seq = pl.read_parquet(root / "geometry" / MODEL / "token_loop.parquet").filter(
        (pl.col("split") == "test") & (pl.col("loop") == 1)).sort("token")["sequence"].to_numpy()
    assert lat["n_tokens"].to_list() == [int((seq < 8).sum()), ex.size]
    assert lat["mean_exit_depth"].to_list() == pytest.approx([ex[seq < 8].mean(), ex.mean()], abs=1e-12)
    right = test["argmax"][np.arange(ex.size), ex - 1] == test["target"]
    assert lat["accuracy_real"][1] == pytest.approx(right.mean(), abs=1e-12)
    assert lat["threshold"][0] == ref["grid"][ref["chosen"]]


# ----------------------------------------------------------------------------------------------
# The entry-point route, refusals, and the registry itself (synthetic splits)
# ----------------------------------------------------------------------------------------------


def _split(seed: int, n: int = 60, T: int = 4) -> SplitArrays:
    rng = np.random.default_rng(seed)
    return SplitArrays(np.arange(n), {"correct": rng.random((n, T)) < 0.5 + 0.1 * np.arange(T),
                                      "target_logprob": -rng.random((n, T)), "entropy": rng.random((n, T)),
                                      "max_prob": rng.random((n, T)), "argmax": rng.integers(0, 3, (n, T))})


def test_entry_point_rule(tmp_path, monkeypatch):
    """A rule registered under the looptrace.rules entry-point group is found by its entry-point name and
    evaluated like a built-in (fixed thresholds: depths derived here by hand)."""
    from looptrace.rules import registry

    (tmp_path / "ep_rules_pkg.py").write_text(textwrap.dedent("""
        from looptrace.rules import exit_rule

        @exit_rule(signals=("entropy",), op="le", min_loop=2, thresholds=(0.25, 0.5))
        def low_entropy(s):
            return s["entropy"]
    """))
    dist = tmp_path / "ep_rules_pkg-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: ep-rules-pkg\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[looptrace.rules]\nsharp = ep_rules_pkg:low_entropy\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry, "RULES", registry.RULES.copy())
    r = get_rule("sharp")
    assert isinstance(r, ExitRule) and r.name == "sharp" and "entry point ep_rules_pkg:low_entropy" in r.origin
    val, test = _split(1), _split(2)
    res = evaluate_model_rules(val, test, ReadoutsConfig(rules=("fixed", "sharp")), CalibrationConfig(),
                               progress=False)
    assert [x.rule for x in res] == ["fixed", "sharp"]
    r = res[1]
    np.testing.assert_array_equal(r.thresholds, [0.25, 0.5])
    for k, g in enumerate((0.25, 0.5)):
        e = test.loop["entropy"]
        d = [next((t + 1 for t in range(1, 4) if e[i, t] <= g), 4) for i in range(60)]
        assert r.test.mean_depth[k] == pytest.approx(np.mean(d), abs=1e-12)
        assert r.test.accuracy[k] == pytest.approx(np.mean(test.correct[np.arange(60), np.array(d) - 1]), abs=1e-12)


def test_register_a_rule_defined_in_this_process(monkeypatch):
    """register(): a rule defined here (a notebook, a script) is found by its name; built-in names are refused."""
    from looptrace.rules import register, registry

    monkeypatch.setattr(registry, "RULES", registry.RULES.copy())
    rule = exit_rule(signals=("max_prob",), op="ge", name="confident")(lambda s: s["max_prob"])
    assert register(rule) is rule and get_rule("confident") is rule
    val, test = _split(7), _split(8)
    r = evaluate_model_rules(val, test, ReadoutsConfig(rules=("confident",)), CalibrationConfig(n_quantiles=5),
                             progress=False)[0]
    np.testing.assert_array_equal(r.thresholds, np.percentile(val.loop["max_prob"], [0.5, 25.25, 50, 74.75, 99.5]))
    with pytest.raises(ValueError, match="the name is a built-in rule"):
        register(user_rules.entropy)


def test_explicit_thresholds_and_loop_signal():
    """``thresholds=`` replaces the quantile grid; ``loop`` is t = 1..T."""
    val, test = _split(3), _split(4)
    r = evaluate_model_rules(val, test, ReadoutsConfig(), CalibrationConfig(), progress=False,
                             rules=["tests.user_rules:entropy_scaled"])[0]
    assert r.rule == "entropy_by_depth"
    np.testing.assert_array_equal(r.thresholds, [0.5, 1.0])
    e = val.loop["entropy"]
    d = [next((t + 1 for t in range(4) if e[i, t] * (t + 1) <= 0.5), 4) for i in range(60)]
    assert r.val.mean_depth[0] == pytest.approx(np.mean(d), abs=1e-12)


def test_non_causal_and_cross_token_rules_refused():
    val, test = _split(5), _split(6)
    with pytest.raises(ValueError, match=r"'peeks_ahead' .* is not causal: its score at loop 1 changes") as e:
        evaluate_model_rules(val, test, ReadoutsConfig(), CalibrationConfig(), progress=False,
                             rules=["tests.user_rules:peeks_ahead"])
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="depends on other tokens"):
        evaluate_model_rules(val, test, ReadoutsConfig(), CalibrationConfig(), progress=False,
                             rules=["tests.user_rules:batch_normalised"])


def test_stage_refuses_bad_rules_in_one_line(pipeline_run, tmp_path):
    """readouts (and latency's params) name a non-causal rule or an unknown one: exit 2, one line."""
    from typer.testing import CliRunner

    from looptrace.cli import app

    root = pipeline_run["root"]
    params = yaml.safe_load((root.parent / "params.yaml").read_text())
    cases = {"tests.user_rules:peeks_ahead": "is not causal", "entropyy": "unknown rule 'entropyy'",
             "tests.user_rules:entropy": "a built-in rule", "tests.user_rules:not_a_rule": "is not an exit rule",
             "tests.nope:rule": "cannot import module 'tests.nope'"}
    for name, msg in cases.items():
        params["readouts"]["rules"] = ["fixed", name]
        (tmp_path / "p.yaml").write_text(yaml.safe_dump(params))
        res = CliRunner().invoke(app, ["readouts", "--model", MODEL, "--params", str(tmp_path / "p.yaml"),
                                       "--geometry-root", str(root / "geometry"), "--out", str(tmp_path / "r")])
        assert res.exit_code == 2 and msg in res.output, (name, res.output)
        assert len(res.output.strip().splitlines()) == 1, res.output
    assert not (tmp_path / "r").exists()


def test_unknown_rule_message_lists_builtins_and_how_to_name_a_user_rule():
    with pytest.raises(ConfigError) as e:
        from_dict(ReadoutsConfig, {"rules": ["fixed", "entropyy"]}, "readouts")
    msg = str(e.value)
    assert msg.startswith("readouts.rules: unknown rule 'entropyy'; built-ins: fixed, entropy, top1")
    assert "'package.module:function'" in msg and "'looptrace.rules' entry-point group" in msg and "\n" not in msg
    from looptrace.online.latency import LatencyConfig

    with pytest.raises(ConfigError, match="latency.rules: rule 'oracle' cannot run online"):
        LatencyConfig(rules=("oracle",))
    with pytest.raises(ConfigError, match="latency.rules: unknown rule 'nope'"):
        LatencyConfig(rules=("nope",))
    assert LatencyConfig(rules=(RULE, "argmax_stable", "fixed", "gate")).rules[0] == RULE
    with pytest.raises(ConfigError, match="both have the name 'entropy_by_depth'"):
        ReadoutsConfig(rules=("tests.user_rules:entropy_scaled", "tests.user_rules:entropy_scaled"))


def test_decorator_refuses_bad_declarations():
    with pytest.raises(ValueError, match="cannot read 'kl_final' .*needs loop T"):
        exit_rule(signals=("kl_final",), op="le")(lambda s: s["kl_final"])
    with pytest.raises(ValueError, match="cannot read 'target_logprob'"):
        exit_rule(signals=("target_logprob",), op="ge")(lambda s: s["target_logprob"])
    with pytest.raises(ValueError, match="unknown signal 'entropi'"):
        exit_rule(signals=("entropi",), op="le")(lambda s: s)
    with pytest.raises(ValueError, match="op must be 'le' or 'ge'"):
        exit_rule(signals=("entropy",), op="lt")(lambda s: s)
    undeclared = exit_rule(signals=("entropy",), op="le")(lambda s: s["margin"])
    with pytest.raises(ValueError, match="reads signal 'margin' that it does not declare"):
        undeclared.score_of({"entropy": np.zeros((2, 3)), "margin": np.zeros((2, 3))})
    flat = exit_rule(signals=("entropy",), op="le")(lambda s: s["entropy"].mean(1))
    with pytest.raises(ValueError, match=r"returned a score of shape \(2,\)"):
        flat.score_of({"entropy": np.zeros((2, 3))})
    # the decorated object is still callable on a signal dict, and named after the function
    assert user_rules.confident_and_stable.name == NAME
    out = user_rules.confident_and_stable({"max_prob": np.array([[0.2, 0.3, 0.9]]), "argmax": np.array([[1, 1, 2]])})
    np.testing.assert_array_equal(out, [[np.nan, 0.3, np.nan]])


def test_builtins_are_registered_in_output_order():
    assert ALL_RULES == ("fixed", "entropy", "top1", "margin", "kl_prev", "kl_prev_rev", "logit_change",
                         "hidden_change", "rel_step", "state_cosine", "accel_two_hit", "argmax_stable", "q_exit",
                         "oracle")
    spec = {r: (get_rule(r).signals, get_rule(r).op, get_rule(r).min_loop, get_rule(r).two_hit, get_rule(r).kind)
            for r in ALL_RULES}
    assert spec["top1"] == (("max_prob",), "ge", 1, False, "posthoc")
    assert spec["state_cosine"] == (("state_cos_dist",), "le", 2, False, "posthoc")
    assert spec["accel_two_hit"] == (("accel",), "le", 3, True, "posthoc")
    assert spec["q_exit"] == (("gate_logit",), "ge", 1, False, "native")
    assert spec["fixed"][4] == "fixed" and spec["oracle"][4] == "oracle"
    assert get_rule("fixed").calibration_values(5).tolist() == [1, 2, 3, 4, 5]
    assert get_rule("argmax_stable").calibration_values(5, ReadoutsConfig(argmax_stable_n=(2, 4))).tolist() == [2, 4]
