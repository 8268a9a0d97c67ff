"""``looptrace --help`` and each stage's help: written for users, valid names listed from the code's registries."""

from __future__ import annotations

import re

import pytest
import yaml
from typer.testing import CliRunner

from looptrace.cli import STAGES, app, rule_line
from looptrace.models.adapters.kinds import KINDS as ADAPTER_KINDS
from looptrace.models.regimes import KINDS as REGIMES
from looptrace.rules import exit_rule
from looptrace.rules.builtin import OURO_Q_EXIT_RULES
from looptrace.rules.registry import builtin_rules
from looptrace.stages import registered
from looptrace.tasks import KINDS as TASKS
from tests.conftest import REPO
from tests.test_e2e_gates import downstream_of

ADAPTERS = ADAPTER_KINDS.names()


def _help(*args: str) -> str:
    res = CliRunner().invoke(app, [*args, "--help"])
    assert res.exit_code == 0, res.output
    return re.sub(r"[\s│╭╮╰╯─]+", " ", res.output)  # the text without box drawing or wrapping


def test_root_help_is_for_users_and_lists_every_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no params.yaml here: the registries only
    text = _help()
    for must in ("dvc repro", "docs/SPEC.md", "artifacts/report/index.html", "params.yaml"):
        assert must in text
    assert "Typer app" not in text and "Models in" not in text
    for name in (*TASKS, *REGIMES, *ADAPTERS):
        assert re.search(rf"\b{name}\b", text), name
    for name in (*builtin_rules(), *OURO_Q_EXIT_RULES):
        assert f" {name}: " in text, name
    assert "'package.module:function'" in text  # how to name a user rule


def test_each_stage_lists_the_names_it_takes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert [s.name for s in STAGES] == [s.name for s in registered()]  # the registry's pipeline order
    dvc_yaml = yaml.safe_load((REPO / "dvc.yaml").read_text())
    for i, stage in enumerate(STAGES):  # each stage before every stage that reads its outputs (dvc.yaml)
        assert downstream_of(dvc_yaml, stage.name) - {stage.name} <= {s.name for s in STAGES[i + 1:]}, stage.name
    for stage in STAGES:
        name, blocks = stage.name, stage.help_blocks
        text = _help(name)
        assert "<task>-<regime>-s<seed>" in text, name
        assert (" entropy: exit when entropy ≤ threshold" in text) == ("rules" in blocks), name
        assert ("running_parity, running_sum, parity, mano" in text) == ("tasks" in blocks), name
        assert ("final, uniform, geometric, joint" in text) == ("regimes" in blocks), name
        assert (", ".join(ADAPTERS) in text) == ("adapters" in blocks), name


def test_help_lists_what_the_params_file_here_defines(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"train": {
        "tasks": ["alpha"], "regimes": ["uni", "geo"], "seeds": [0, 7],
        "task_defs": {"alpha": {"kind": "running_parity"}, "beta": {"kind": "parity"}},
        "regime_defs": {"uni": {"kind": "uniform"}, "geo": {"kind": "geometric"}}}}, sort_keys=False))
    text = _help("train")
    assert "Tasks (--task) in ./params.yaml: alpha, beta." in text
    assert "Regimes (--regime) in ./params.yaml: uni, geo." in text
    assert ("Models in ./params.yaml (train.tasks × train.regimes × train.seeds): alpha-uni-s0, alpha-uni-s7, "
            "alpha-geo-s0, alpha-geo-s7.") in text
    (tmp_path / "params.yaml").write_text("train: [not, a, mapping]\n")  # a broken file: help still prints
    assert "Models in" not in _help("train")


def test_rule_lines_are_said_from_the_registry_entry():
    rules = builtin_rules()
    assert rule_line(rules["entropy"]) == "entropy: exit when entropy ≤ threshold"
    assert rule_line(rules["top1"]) == "top1: exit when max_prob ≥ threshold"
    assert rule_line(rules["kl_prev"]) == "kl_prev: exit when kl_prev ≤ threshold (from loop 2)"
    assert rule_line(rules["accel_two_hit"]) == "accel_two_hit: exit when accel ≤ threshold (from loop 3, two loops in a row)"
    assert rule_line(rules["fixed"]).startswith("fixed: exit at loop k")

    @exit_rule(signals=["entropy", "margin"], op="le", min_loop=2, name="help_probe")
    def probe(s):
        """exit when entropy minus margin is small."""
        return s["entropy"] - s["margin"]

    assert rule_line(probe) == "help_probe: exit when entropy minus margin is small."

    @exit_rule(signals=["entropy"], op="ge", name="help_probe2")
    def bare(s):
        return s["entropy"]

    assert rule_line(bare) == "help_probe2: exit when entropy ≥ threshold"


@pytest.mark.parametrize("stage", ["readouts", "report"])
def test_stage_help_starts_with_what_it_does(stage):
    from looptrace.stages import readouts, report

    first = {"readouts": readouts, "report": report}[stage].main.__doc__.strip().splitlines()[0]
    assert first in _help(stage)
