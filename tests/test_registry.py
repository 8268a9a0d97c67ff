"""The one registry mechanism (looptrace.registry): lazy references resolved on first use, objects registered by the
module that defines them, entry points, and one-line errors; and what listing a registry costs."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap

import pytest

from looptrace.config import ConfigError
from looptrace.registry import Registry, RegistryError, UnknownName
from tests.conftest import REPO


@pytest.fixture
def modules(tmp_path, monkeypatch):
    """Two throw-away modules: ``reg_defs`` defines objects; ``reg_self`` registers one in ``reg_host.REG`` when
    imported (and counts its imports)."""
    (tmp_path / "reg_defs.py").write_text("VALUE = 41\nclass Box:\n    size = 2\n")
    (tmp_path / "reg_host.py").write_text(textwrap.dedent("""
        from looptrace.registry import Registry
        REG = Registry("thing", {"lazy": "reg_self", "ref": "reg_defs:VALUE"})
    """))
    (tmp_path / "reg_self.py").write_text(textwrap.dedent("""
        import reg_host
        IMPORTS = getattr(reg_host, "IMPORTS", 0) + 1
        reg_host.IMPORTS = IMPORTS

        @reg_host.REG.register("lazy")
        def thing():
            return "registered by reg_self"
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    for m in ("reg_defs", "reg_host", "reg_self"):
        sys.modules.pop(m, None)
    yield
    for m in ("reg_defs", "reg_host", "reg_self"):
        sys.modules.pop(m, None)


def test_references_resolve_on_first_use_and_once(modules):
    import reg_host

    reg = reg_host.REG
    assert list(reg) == ["lazy", "ref"] and "reg_defs" not in sys.modules and "reg_self" not in sys.modules
    assert reg["ref"] == 41 and "reg_defs" in sys.modules
    assert reg["lazy"]() == "registered by reg_self" and reg["lazy"] is reg["lazy"]
    assert reg_host.IMPORTS == 1 and reg.entry("lazy") is sys.modules["reg_self"].thing
    assert dict(reg.items()) == {"lazy": sys.modules["reg_self"].thing, "ref": 41}


def test_only_the_referenced_module_replaces_its_reference(modules):
    reg = Registry("thing", {"a": "reg_defs:Box"})
    with pytest.raises(ValueError, match="'a' is registered twice"):
        reg.add("a", object(), module="elsewhere")
    reg.add("a", "reg_defs:Box")  # the same reference again: nothing changes
    reg.add("b", 1)
    reg.add("b", 1)  # an equal object again (a module imported twice)
    with pytest.raises(ValueError, match="'b' is registered twice"):
        reg.add("b", 2)
    reg.add("b", 2, replace=True)
    assert reg["b"] == 2 and reg["a"].size == 2


def test_errors_are_one_line_and_typed(modules):
    reg = Registry("thing", {"gone": "reg_nowhere:X", "bad": "reg_defs:NOPE", "mute": "reg_defs"},
                   check=lambda obj: None if isinstance(obj, int) else "is not an int")
    reg.add("typed", "reg_defs:Box")
    cases = {"gone": "thing 'gone': cannot import module 'reg_nowhere' (No module named 'reg_nowhere')",
             "bad": "thing 'bad': module 'reg_defs' has no attribute 'NOPE'",
             "mute": "thing 'mute': module 'reg_defs' registers no thing of that name",
             "typed": "thing 'typed': 'reg_defs:Box' is not an int"}
    for name, msg in cases.items():
        with pytest.raises(RegistryError) as info:
            reg[name]
        assert str(info.value) == msg and isinstance(info.value, ConfigError)
    with pytest.raises(UnknownName) as info:
        reg["nothing"]
    assert str(info.value) == "unknown thing 'nothing'" and isinstance(info.value, KeyError)
    assert reg.get("nothing") is None and "nothing" not in reg


def test_references_by_name_and_entry_points(modules, tmp_path):
    dist = tmp_path / "reg_pkg-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: reg-pkg\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[looptrace.test_registry]\nforty_one = reg_defs:VALUE\n")
    reg = Registry("thing", group="looptrace.test_registry", references=True,
                   adopt=lambda obj, name, value: (obj + 1, name, value))
    assert reg.names() == ("forty_one",) and list(reg) == [] and "forty_one" in reg
    assert reg["forty_one"] == (42, "forty_one", "reg_defs:VALUE")
    assert reg["reg_defs:Box.size"] == 2  # a reference used as a name (dotted attribute)
    with pytest.raises(RegistryError, match="'reg_defs:': name it 'package.module:object'"):
        reg["reg_defs:"]


def test_listing_adapter_kinds_and_stages_imports_none_of_them():
    """The CLI's help lists every adapter kind without importing an adapter module (nor torch); the stage names come
    from the entry files (looptrace.config.STAGE_NAMES), not from importing the entries."""
    code = ("import json, sys; from looptrace.config import STAGE_NAMES; from looptrace.models.adapters.kinds import "
            "KINDS; from looptrace.stages import STAGES; print(json.dumps([list(KINDS.names()), list(STAGES), "
            "list(STAGE_NAMES), sorted(m for m in sys.modules if m == 'torch' or m.startswith("
            "('looptrace.models.adapters.', 'looptrace.stages.')))]))")
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    kinds, stages, stage_names, loaded = json.loads(res.stdout.strip().splitlines()[-1])
    table = (REPO / "pipeline" / "looptrace" / "models" / "adapters" / "kinds.py").read_text()
    assert kinds == re.findall(r'^    "(\w+)": "looptrace\.models\.adapters\.', table, re.M)
    assert stages == stage_names and loaded == ["looptrace.models.adapters.kinds"]
