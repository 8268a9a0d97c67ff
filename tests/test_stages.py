"""The stage registry (looptrace.stages): every entry registers itself, and what lists the stages derives from it —
the CLI, ``config.SECTIONS``, dvc.yaml's stages, the launchers and docs/DESIGN.md's stage table; each stage's library
follows the one rule of DESIGN.md ("Where a stage's code lives")."""

from __future__ import annotations

import importlib
import re

import pytest
import yaml

from looptrace.config import SECTIONS, SHARED_SECTIONS, STAGE_NAMES
from looptrace.stages import Stage, register_stage, registered
from tests.conftest import REPO

STAGES = registered()


def test_every_entry_registers_its_own_stage_and_everything_lists_the_same_stages():
    names = [s.name for s in STAGES]
    assert sorted(names) == list(STAGE_NAMES) and all(re.fullmatch(r"[a-z_]+", n) for n in names)
    assert SECTIONS == (*SHARED_SECTIONS, *STAGE_NAMES)
    assert sorted(yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]) == sorted(names)
    assert sorted(p.stem for p in (REPO / "stages").glob("*.py")) == sorted(names)
    assert [s.order for s in STAGES] == sorted({s.order for s in STAGES}), "two stages share an order"
    for s in STAGES:
        assert s.main.__module__ == f"looptrace.stages.{s.name}"


def test_the_cli_has_one_command_per_registered_stage():
    from typer.main import get_command

    from looptrace.cli import app

    assert list(get_command(app).commands) == [s.name for s in STAGES]


@pytest.mark.parametrize("stage", STAGES, ids=lambda s: s.name)
def test_library_follows_the_rule(stage: Stage):
    """The library is a module outside looptrace.stages; the section's config dataclass is named for the stage and
    reachable from the library (defined there, or imported by it from its own concern package)."""
    assert not stage.library.startswith("looptrace.stages"), stage.library
    lib = importlib.import_module(stage.library)
    assert stage.config.__name__.lower() == f"{stage.name}config"
    assert getattr(lib, stage.config.__name__) is stage.config
    assert stage.config.__module__.split(".")[:2] == stage.library.split(".")[:2], (stage.config.__module__,
                                                                                     stage.library)
    entry = (REPO / "pipeline" / "looptrace" / "stages" / f"{stage.name}.py").read_text()
    assert f"from {stage.library} import" in entry, f"the {stage.name} entry does not call its library"


@pytest.mark.parametrize("stage", STAGES, ids=lambda s: s.name)
def test_library_is_found_from_the_stage_name(stage: Stage):
    """A stage's library is named for the stage: the module ``looptrace.<concern>.<name>`` (or
    ``looptrace.<name>``), or the package ``looptrace.<name>`` whose ``stage`` module drives it."""
    parts = stage.library.split(".")
    assert parts[-1] == stage.name or parts[-2:] == [stage.name, "stage"], (
        f"stage {stage.name!r}: its library {stage.library} is not named for it (DESIGN.md, \"Where a stage's code lives\")")


def test_design_stage_table_is_the_registry():
    text = (REPO / "docs" / "DESIGN.md").read_text()
    section = text.split("## Stages, params, artifacts", 1)[1].split("\n### ", 1)[0]
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in section.splitlines()
            if line.startswith("| ")]
    header, rows = rows[0], [r for r in rows[1:] if set(r[0]) != {"-"}]
    col = {h: i for i, h in enumerate(header)}
    assert [r[0] for r in rows] == [s.name for s in STAGES], "DESIGN.md's stage table: one row per stage, in order"
    for row, s in zip(rows, STAGES, strict=True):
        assert row[col["config dataclass"]].startswith(f"`{s.config.__name__}` (`{s.config.__module__}`)"), s.name
        assert row[col["library"]] == f"`{s.library}`", s.name


def test_registration_is_checked():
    def main():
        """x"""

    with pytest.raises(ValueError, match="must be registered by looptrace.stages.nope"):
        register_stage("nope", 1, config=object, library="x")(main)
    main.__module__ = "looptrace.stages.nope"
    with pytest.raises(ValueError, match="unknown help blocks"):
        register_stage("nope", 1, config=object, library="x", help_blocks=("colours",))(main)
    assert "nope" not in [s.name for s in registered()]


def test_loading_params_imports_no_entry():
    """config.SECTIONS comes from the entries' file names: reading params imports no stage entry (nor torch)."""
    import subprocess
    import sys

    code = ("import sys; from looptrace.config import read_params; read_params(['params.yaml']); "
            "print(sorted(m for m in sys.modules if m.startswith('looptrace.stages') or m == 'torch'))")
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]", res.stdout
