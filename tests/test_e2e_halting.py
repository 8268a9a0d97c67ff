"""End to end (slow): the halting profile (profiles/halting/) on tiny params in a copy of the project.

Every stage command of profiles/halting/dvc.yaml (matrix from the profile's params, topological order) runs in this
process through the ``looptrace`` CLI, as tests/test_e2e_gates.py runs the default pipeline, on params.yaml and the
profile's override both shrunk to the tiny sizes of that test. Then: every regime of the profile trained (RecurTrace
decoupled / flowing / with loop memory, ACT, geometric, joint), the loop-memory model's checkpoint and store record
the option, every gated model stored its gate and was read out by the native exits (q_exit, gate_step, act_exit),
the latency and generate stages ran them online, diagnose wrote the matched-compute table with each regime's own
native exit, and the report its page.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import polars as pl
import pytest
import yaml

from tests.test_e2e_gates import _merge, copy_tiny_project, run_in_process, stage_commands

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
PROFILE = "profiles/halting"
#: The profile's matrix, shrunk: one task, every regime, one seed.
TINY_PROFILE = {"train": {"tasks": ["running_parity"], "seeds": [0]}}


def build_halting_project(root: Path) -> dict:
    """Copy the code, dvc.yaml, the tiny params.yaml and the tiny halting profile into ``root``; returns the merged
    params the profile's stages run on."""
    params = copy_tiny_project(root)
    over = yaml.safe_load((REPO / PROFILE / "params.yaml").read_text())
    over["train"].update(TINY_PROFILE["train"])
    (root / PROFILE).mkdir(parents=True)
    (root / PROFILE / "params.yaml").write_text(yaml.safe_dump(over, sort_keys=False))
    shutil.copy(REPO / PROFILE / "dvc.yaml", root / PROFILE / "dvc.yaml")
    return {k: _merge(v, over[k]) if k in over and isinstance(v, dict) else v for k, v in params.items()}


def test_halting_profile_runs_end_to_end_on_tiny_params(tmp_path):
    import torch

    from looptrace.io.store.reader import open_store
    from looptrace.models.looped import load_checkpoint

    torch.set_num_threads(1)
    params = build_halting_project(tmp_path)
    dvc_yaml = yaml.safe_load((tmp_path / PROFILE / "dvc.yaml").read_text())
    for _, cmd in stage_commands(dvc_yaml, params):
        run_in_process(cmd, tmp_path)
    art = tmp_path / "artifacts" / "halting"
    regimes = params["train"]["regimes"]
    assert {"recurtrace", "recurtrace_flow", "recurtrace_mem", "act"} <= set(regimes)
    for r in regimes:
        name = f"running_parity-{r}-s0"
        model, ckpt = load_checkpoint(art / "train" / name / "model.pt")
        assert model.cfg.loop_memory == (r == "recurtrace_mem")
        assert (model.gate is not None) == (r != "geometric")
        store = open_store(art / "dump" / name / "test.zarr")
        assert ("gate_logit" in store) == store.has_gate == (r != "geometric")
        assert bool(store.attrs["model"]["config"].get("loop_memory")) == (r == "recurtrace_mem")
        points = pl.read_parquet(art / "readouts" / name / "operating_points.parquet")
        native = {"q_exit", "gate_step", "act_exit"}
        assert native <= set(points["rule"]) if r != "geometric" else not native & set(points["rule"])
    lat = pl.read_parquet(art / "latency" / "latency.parquet")
    assert {"gate_step", "act_exit"} <= set(lat["rule"])
    assert (art / "diagnose" / "summary.md").is_file() and (art / "report" / "index.html").is_file()
    table = pl.read_parquet(art / "diagnose" / "halting_table.parquet")
    native = table.filter(pl.col("method") == "native")
    assert dict(zip(native["regime"], native["rules"], strict=True)) == {
        "joint": "q_exit", "recurtrace": "gate_step", "recurtrace_flow": "gate_step", "recurtrace_mem": "gate_step",
        "act": "act_exit"}
    # the native exits at their methods' own thresholds; the same heads at a val-chosen γ in rows of their own
    tuned = table.filter(pl.col("method") == "native, γ calibrated on val")
    assert dict(zip(tuned["regime"], tuned["rules"], strict=True)) == {
        "recurtrace": "gate_step_calibrated", "recurtrace_flow": "gate_step_calibrated",
        "recurtrace_mem": "gate_step_calibrated", "act": "act_exit_calibrated"}
    eps = params["train"]["regime_defs"]["act"]["eps"]
    for name, rule, thr in (("act", "act_exit", 1.0 - eps), ("recurtrace", "gate_step", 0.5)):
        chosen = pl.read_parquet(art / "readouts" / f"running_parity-{name}-s0" / "chosen.parquet")
        assert chosen.filter(pl.col("rule") == rule)["threshold"].to_list() == [thr]
    summary = (art / "diagnose" / "summary.md").read_text()
    assert "## Halting methods at matched compute" in summary
    # the findings in words, every question answered or said untestable, never "nan"
    assert "## Halting findings" in summary and summary.count("\n### ") == 5
    findings = json.loads((art / "diagnose" / "metrics.json").read_text())["halting_findings"]
    assert {f["question"] for f in findings} == {"memory", "head_vs_joint", "flow", "collapse", "router"}
    # each regime's verdict reads its own exit
    verdicts = pl.read_parquet(art / "diagnose" / "verdicts.parquet")
    assert dict(zip(verdicts["regime"], verdicts["native_rule"], strict=True)) == {
        "geometric": None, "joint": "q_exit", "recurtrace": "gate_step", "recurtrace_flow": "gate_step",
        "recurtrace_mem": "gate_step", "act": "act_exit"}
    page = (art / "report" / "index.html").read_text()
    assert "<h2>Halting methods at matched compute</h2>" in page
    assert "<h2>Counterfactual faithfulness of halting signals</h2>" in page
