"""The layout is what docs/DESIGN.md says: its module graph is the real package-level import graph, the installed
distribution holds only ``looptrace`` (no top-level ``pipeline``/``stages``), and ``tests.builders`` is imported by
tests only."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from tests.import_graph import GRAPH, REPO


def unit(module: str) -> str:
    """``looptrace.rules.scoring`` -> ``rules``; ``looptrace.stages.x`` -> ``stages``; ``looptrace`` -> ``looptrace``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def package_edges() -> dict[str, set[str]]:
    """unit -> the units it imports (anywhere in its files, function-level imports included)."""
    edges: dict[str, set[str]] = {}
    for f in sorted((REPO / "pipeline").rglob("*.py")):
        u = unit(GRAPH.module_name(f))
        ours, _ = GRAPH.direct_imports(f)
        edges.setdefault(u, set()).update(v for v in map(unit, ours) if v not in (u, "looptrace"))
    return edges


def drawn_edges() -> dict[str, set[str]]:
    text = (REPO / "docs" / "DESIGN.md").read_text()
    block = re.search(r"```mermaid\n(.*?)```", text, re.S)
    assert block, "docs/DESIGN.md has no mermaid module graph"
    edges: dict[str, set[str]] = {}
    for a, b in re.findall(r"^\s*(\w+)\s*-->\s*(\w+)\s*$", block.group(1), re.M):
        edges.setdefault(a, set()).add(b)
        edges.setdefault(b, set())
    for node in re.findall(r"^\s*(\w+)\s*(?:\[|$)", block.group(1), re.M):
        edges.setdefault(node, set())
    edges.pop("graph", None)
    return edges


def test_design_module_graph_is_the_import_graph():
    real, drawn = package_edges(), drawn_edges()
    real.pop("looptrace", None)  # pipeline/__init__.py imports nothing
    missing = sorted(f"{a} --> {b}" for a, bs in real.items() for b in bs - drawn.get(a, set()))
    false = sorted(f"{a} --> {b}" for a, bs in drawn.items() for b in bs - real.get(a, set()))
    assert not missing and not false, f"DESIGN.md graph lacks {missing}; draws imports that do not exist {false}"
    assert set(drawn) == set(real), sorted(set(drawn) ^ set(real))


def assert_acyclic(edges: dict[str, set[str]]) -> None:
    """Fail naming the first import cycle of ``edges`` (depth-first, in sorted order)."""
    state: dict[str, int] = {}

    def visit(n, path):
        if state.get(n) == 1:
            pytest.fail(f"import cycle {' -> '.join([*path[path.index(n):], n])}")
        if state.get(n) == 2:
            return
        state[n] = 1
        for m in sorted(edges.get(n, ())):
            visit(m, [*path, n])
        state[n] = 2

    for n in sorted(edges):
        visit(n, [])


def test_package_graph_has_no_cycle():
    assert_acyclic(package_edges())


def module_edges() -> dict[str, set[str]]:
    """module -> the package's modules it imports (anywhere in its file), read as grimp reads an import: the module
    named (``from a.b import c`` is ``a.b.c`` when that is a module, else ``a.b``), not the packages above it."""
    import ast

    files = {GRAPH.module_name(f): f for f in sorted((REPO / "pipeline").rglob("*.py"))}
    edges: dict[str, set[str]] = {}
    for m, f in files.items():
        named: set[str] = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                named.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                named.update(f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in files else node.module
                             for a in node.names)
        edges[m] = {n for n in named if n in files and n != m}
    return edges


def test_module_graph_has_no_cycle():
    """No two modules import each other, directly or through others (function-level imports included)."""
    assert_acyclic(module_edges())


def test_test_builders_live_under_tests():
    """The tests' builders are ``tests/builders.py``: not a module of the package (so not in the wheel), and no
    library module imports anything of ``tests``."""
    assert (REPO / "tests" / "builders.py").is_file() and not (REPO / "pipeline" / "looptrace" / "testing.py").exists()
    users = sorted(str(f.relative_to(REPO)) for f in (REPO / "pipeline").rglob("*.py")
                   if re.search(r"^\s*(from|import) tests\b", f.read_text(), re.M))
    assert users == [], users


def test_import_path_is_the_file_path():
    """Source layout: every module of the package is ``pipeline/<dotted path>.py``, so tools that know nothing of
    setuptools (mypy, pyright, editors, import-graph drawers) resolve ``looptrace.*`` from ``pipeline/``; and the
    launchers in stages/ are scripts, not a package."""
    cfg = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert cfg["packages"]["find"]["where"] == ["pipeline"] and "package-dir" not in cfg
    assert sorted(p.name for p in (REPO / "pipeline").iterdir() if not p.name.endswith((".egg-info", "__pycache__"))) == ["looptrace"]
    for f in (REPO / "pipeline").rglob("*.py"):
        assert GRAPH.module_name(f) == ".".join(f.relative_to(REPO / "pipeline").with_suffix("").parts).removesuffix(
            ".__init__")
        if f.name != "__init__.py":
            assert (f.parent / "__init__.py").is_file(), f"{f}: its folder is not a package"
    assert not (REPO / "stages" / "__init__.py").exists()
    for f in (REPO / "stages").glob("*.py"):
        assert f"from looptrace.stages.{f.stem} import main" in f.read_text(), f


#: The most modules over 600 lines (docs/DESIGN.md, "One concern per module").
MAX_LARGE = 3


def test_design_lists_every_module_over_600_lines():
    """DESIGN.md's table of large modules is the tree's: every module of more than 600 lines (``wc -l``) has a row
    with its reason, every row is such a module with a line count within 10 % of the one given, and there are at most
    :data:`MAX_LARGE`."""
    text = (REPO / "docs" / "DESIGN.md").read_text()
    section = text.split("### One concern per module", 1)[1].split("\n### ", 1)[0]
    rows = re.findall(r"^\| `([\w.]+)` \| ~?(\d+) \| (.+?) \|$", section, re.M)
    listed = {m: (int(n), why) for m, n, why in rows}
    actual = {GRAPH.module_name(f).removeprefix("looptrace."): f.read_text().count("\n")
              for f in (REPO / "pipeline").rglob("*.py")}
    large = {m for m, n in actual.items() if n > 600}
    assert set(listed) == large, f"DESIGN.md's large-module table: missing {sorted(large - set(listed))}, " \
                                 f"not over 600 lines {sorted(set(listed) - large)}"
    for m, (n, why) in listed.items():
        assert abs(actual[m] - n) <= 0.1 * actual[m], f"{m}: {actual[m]} lines, DESIGN.md says ~{n}"
        assert len(why.split()) >= 8, f"{m}: say why it is one module"
    assert len(large) <= MAX_LARGE, f"{len(large)} modules over 600 lines (at most {MAX_LARGE}): split one"


#: Names several modules share because each is the same role in its own package (reason beside each).
SHARED_ROLES = {
    "config": "a package's config dataclasses (the params loader at the top)",
    "base": "a package's base class (adapters, rules, tasks)",
    "stage": "the driver of a stage package (gates, diagnose)",
    "registry": "the registry mechanism, and the rules' registry built on it",
}


def test_no_two_modules_share_a_name_for_different_things():
    """Every module or package name under looptrace names one thing: a name used twice is a stage's entry
    (``looptrace.stages.<name>``) beside its library, or a role of :data:`SHARED_ROLES`."""
    from looptrace.stages import registered

    libraries = {s.name: s.library for s in registered()}
    names: dict[str, set[str]] = {}
    for f in (REPO / "pipeline" / "looptrace").rglob("*.py"):
        mod = GRAPH.module_name(f)
        if mod != "looptrace":
            names.setdefault(mod.rsplit(".", 1)[-1], set()).add(mod)
    clashes = {}
    for name, mods in sorted(names.items()):
        if len(mods) < 2 or name in SHARED_ROLES:
            continue
        lib = libraries.get(name, "")
        stage_pair = {f"looptrace.stages.{name}", lib, lib.removesuffix(".stage")}
        if not mods <= stage_pair:
            clashes[name] = sorted(mods)
    assert not clashes, f"one name, several things (rename one, or add a shared role): {clashes}"


def test_installed_names_do_not_squat(tmp_path):
    """From a directory outside the repository (no cwd on sys.path), ``pipeline`` and ``stages`` are not importable;
    ``looptrace`` and ``looptrace.stages`` are, from this checkout's folders."""
    code = ("import importlib.util as u, json; print(json.dumps([u.find_spec('pipeline') is None, "
            "u.find_spec('stages') is None, u.find_spec('looptrace').origin, u.find_spec('looptrace.stages').origin]))")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stderr
    import json

    no_pipeline, no_stages, lt, st = json.loads(res.stdout)
    assert no_pipeline and no_stages
    assert Path(lt) == REPO / "pipeline" / "looptrace" / "__init__.py"
    assert Path(st) == REPO / "pipeline" / "looptrace" / "stages" / "__init__.py"


def test_wheel_holds_only_looptrace(tmp_path):
    """A regular (non-editable) build, what ``pip install .`` installs: one top-level package, ``looptrace``, with
    every module of pipeline/looptrace/ in it."""
    src = tmp_path / "src"
    for d in ("pipeline",):
        shutil.copytree(REPO / d, src / d, ignore=shutil.ignore_patterns("__pycache__"))
    for f in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / f, src / f)
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                          "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    if res.returncode != 0 and "No module named" in res.stderr:
        pytest.skip(f"cannot build here: {res.stderr.strip().splitlines()[-1]}")
    assert res.returncode == 0, res.stderr[-2000:]
    names = zipfile.ZipFile(next((tmp_path / "dist").glob("looptrace-*.whl"))).namelist()
    assert {n.split("/")[0] for n in names} == {"looptrace", "looptrace-0.1.0.dist-info"}
    want = {p.relative_to(REPO / "pipeline").as_posix() for p in (REPO / "pipeline").rglob("*.py")}
    assert want <= set(names), sorted(want - set(names))


def test_domain_reference_lives_in_the_repository():
    """A clone has its definitions: docs/SPEC.md is in the repository, README and DESIGN link it, and nothing
    points outside the repository for it (../shared/SPEC.md)."""
    spec = REPO / "docs" / "SPEC.md"
    assert spec.is_file() and spec.read_text().startswith("# looptrace — reference definitions")
    assert "(docs/SPEC.md)" in (REPO / "README.md").read_text()
    assert "(SPEC.md)" in (REPO / "docs" / "DESIGN.md").read_text()
    texts = [p for p in [REPO / "README.md", *(REPO / "docs").glob("*.md"), *(REPO / "pipeline").rglob("*.py")]
             if "shared/SPEC" in p.read_text()]
    assert not texts, texts
