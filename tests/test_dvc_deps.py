"""dvc.yaml (and every profiles/*/dvc.yaml) declares exactly what each stage runs and reads.

- Code: a stage's ``pipeline/`` + ``stages/`` deps are exactly the static import closure of its script
  (tests/import_graph.py: AST walk, function-level imports and package ``__init__`` files included). Fewer
  would let DVC keep outputs of code that changed; more re-run a stage for code it never runs.
- Layering: the offline stages (geometry, readouts, diagnose, report) import no torch, transformers,
  ``looptrace.models``, ``looptrace.capture`` or ``looptrace.online``; gates may use torch (the PonderNet gate,
  torch thread limits) and ``looptrace.models.regimes`` (the halting distribution and priors of SPEC §5 it
  shares with training), never the model, its interface, the adapters, training, capture or online code.
  Checked statically and at run time: importing the stage script in a fresh interpreter loads no torch (torch
  is imported only inside the gates' functions that need it) and only modules the static closure names.
- Params: the keys a stage reads, derived from its script (``load_section(Cls, "x", ...)`` -> section ``x``;
  attributes of ``load_base(...)`` followed into the library functions it is passed to; ``model_names`` ->
  ``train.tasks``/``train.regimes``; ``model_meta`` -> ``train.task_defs``/``train.regime_defs``), are exactly
  the keys declared for params.yaml; for an override file layered by ``--params``, exactly those of them the
  file sets (DVC refuses a declared key the file lacks).
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from tests.import_graph import GRAPH, REPO, ImportGraph, closure, module_file, rel

OFFLINE = ("geometry", "readouts", "diagnose", "report")
#: looptrace packages/modules each stage must never reach, and external packages likewise.
FORBIDDEN = {
    **{s: (("looptrace.models", "looptrace.capture", "looptrace.online", "looptrace.online.live_gate"),
           ("torch", "transformers")) for s in OFFLINE},
    "gates": (("looptrace.models.looped", "looptrace.models.interface", "looptrace.models.adapters",
               "looptrace.models.train", "looptrace.capture", "looptrace.online", "looptrace.online.live_gate"),
              ("transformers",)),
}
#: Stage modules that must import without torch (torch, where a stage needs it, only inside functions).
TORCH_FREE_IMPORT = (*OFFLINE, "gates")
#: params keys that the project.py helpers read.
PROJECT_READS = {"model_names": ("train.tasks", "train.regimes", "train.seeds"), "model_meta": ("train.task_defs", "train.regime_defs")}


def dvc_files() -> list[Path]:
    return [REPO / "dvc.yaml", *sorted((REPO / "profiles").glob("*/dvc.yaml"))]


def _expand(stages: dict) -> list[tuple[str, dict]]:
    return list(stages.items())  # matrix stages share deps/params across items (item vars only in artifact paths)


def _wdir(dvc_file: Path, stage: dict) -> Path:
    return (dvc_file.parent / stage.get("wdir", ".")).resolve()


def _argv(cmd: str) -> list[str]:
    import shlex

    argv = shlex.split(cmd)
    assert argv[:1] == ["python"] and len(argv) > 1 and argv[1].startswith("stages/"), \
        f"stage command {cmd!r} is not `python stages/<name>.py ...`"
    return argv


def stage_script(dvc_file: Path, stage: dict) -> Path:
    """The stage's script (``python stages/<name>.py`` run from its wdir)."""
    return (_wdir(dvc_file, stage) / _argv(stage["cmd"])[1]).resolve()


def params_files_of(dvc_file: Path, stage: dict) -> list[str]:
    """The ``--params`` files of a stage command, repo-relative, in layering order (default params.yaml)."""
    argv = _argv(stage["cmd"])
    files = [argv[i + 1] for i, a in enumerate(argv) if a == "--params"] or ["params.yaml"]
    return [rel(_wdir(dvc_file, stage) / f) for f in files]


def declared_params(dvc_file: Path, stage: dict) -> dict[str, set[str]]:
    """params file (repo-relative) -> declared keys; a bare key belongs to the wdir's params.yaml."""
    out: dict[str, set[str]] = {}
    default = rel(_wdir(dvc_file, stage) / "params.yaml")
    for entry in stage.get("params") or []:
        if isinstance(entry, dict):
            for f, keys in entry.items():
                out.setdefault(rel(_wdir(dvc_file, stage) / f), set()).update(keys or [])
        else:
            out.setdefault(default, set()).add(entry)
    return out


def code_deps(dvc_file: Path, stage: dict, graph: ImportGraph = GRAPH) -> set[str]:
    """The deps of a stage inside pipeline/ or stages/, repo-relative."""
    paths = (next(iter(e)) if isinstance(e, dict) else e for e in stage.get("deps") or [])
    out = {graph.rel(_wdir(dvc_file, stage) / d) for d in paths if "${" not in d}
    return {d for d in out if d.startswith(("pipeline/", "stages/"))}


# ---------------------------------------------------------------------------------------------- params reads

def _parents(tree: ast.AST) -> dict[ast.AST, ast.AST]:
    return {c: p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}


def _functions(path: Path) -> tuple[ast.Module, dict[str, ast.FunctionDef], dict[str, str]]:
    """A module's tree, its top-level functions, and its ``from looptrace.x import f`` names (name -> module)."""
    tree = ast.parse(path.read_text())
    funcs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    imported = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("looptrace"):
            for a in node.names:
                imported[a.asname or a.name] = node.module
    return tree, funcs, imported


def attribute_reads(path: Path, func: ast.FunctionDef, var: str, depth: int = 0) -> set[str]:
    """Attributes read from ``var`` in ``func`` (of the file ``path``), following ``var`` into the looptrace
    functions it is passed to; ``{"*"}`` when it is used any other way (the whole object may be read)."""
    if depth > 4:
        return {"*"}
    _, funcs, imported = _functions(path)
    parents = _parents(func)
    out: set[str] = set()
    for node in ast.walk(func):
        if not (isinstance(node, ast.Name) and node.id == var and isinstance(node.ctx, ast.Load)):
            continue
        parent = parents.get(node)
        if isinstance(parent, ast.Attribute) and parent.value is node:
            out.add(parent.attr)
        elif isinstance(parent, ast.Compare) and all(isinstance(c, ast.Constant) and c.value is None
                                                     for c in parent.comparators):
            continue  # `base is None`
        elif isinstance(parent, ast.Call) and node in [*parent.args, *(k.value for k in parent.keywords)]:
            callee = parent.func.id if isinstance(parent.func, ast.Name) else None
            target = None
            if callee in funcs:
                target = (path, funcs[callee])
            elif callee in imported and module_file(imported[callee]) is not None:
                f = module_file(imported[callee])
                target = (f, _functions(f)[1].get(callee))
            if target is None or target[1] is None:
                return {"*"}
            fn = target[1]
            names = [a.arg for a in [*fn.args.posonlyargs, *fn.args.args]]
            if node in parent.args:
                pname = names[parent.args.index(node)]
            else:
                pname = next(k.arg for k in parent.keywords if k.value is node)
            out |= attribute_reads(target[0], fn, pname, depth + 1)
        else:
            return {"*"}
    return out


def stage_entry(script: Path) -> Path:
    """The file whose ``main`` a stage script runs: the launcher ``stages/<name>.py`` imports it from
    ``looptrace.stages.<name>`` (a script that defines ``main`` itself is its own entry)."""
    _, funcs, imported = _functions(script)
    if "main" in funcs or "main" not in imported:
        return script
    return module_file(imported["main"])


def params_reads(script: Path) -> set[str]:
    """The params keys a stage script reads (module docstring of this file), from the entry it runs."""
    script = stage_entry(script)
    tree, funcs, _ = _functions(script)
    keys: set[str] = set()
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
            continue
        name = node.func.id
        if name == "load_section":
            sec = node.args[1]
            assert isinstance(sec, ast.Constant), f"{rel(script)}: load_section with a computed section name"
            keys.add(sec.value)
        elif name in PROJECT_READS:
            keys.update(PROJECT_READS[name])
    for fn in funcs.values():  # main and the per-model function a pool of workers runs
        base_vars = [t.id for n in ast.walk(fn) if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call)
                     and isinstance(n.value.func, ast.Name) and n.value.func.id == "load_base" for t in n.targets]
        for var in base_vars:
            attrs = attribute_reads(script, fn, var)
            keys |= {"base"} if "*" in attrs else {f"base.{a}" for a in attrs}
    return keys


def _has_key(data: dict, dotted: str) -> bool:
    v = data
    for k in dotted.split("."):
        if not isinstance(v, dict) or k not in v:
            return False
        v = v[k]
    return True


# ---------------------------------------------------------------------------------------------- the checks

def all_stages() -> list[tuple[Path, str, dict]]:
    return [(f, n, s) for f in dvc_files() for n, s in _expand(yaml.safe_load(f.read_text())["stages"])]


def code_problems(dvc_file: Path, name: str, stage: dict, graph: ImportGraph = GRAPH) -> list[str]:
    """A stage's code deps against its script's import closure (a directory dep counts as the files in it)."""
    files, _, _ = graph.closure(stage_script(dvc_file, stage))
    want, have = {graph.rel(f) for f in files}, code_deps(dvc_file, stage, graph)
    covered = {w for w in want if w in have or any(w.startswith(h.rstrip("/") + "/") for h in have)}
    listed = {h for h in have if h in want or any(w.startswith(h.rstrip("/") + "/") for w in want)}
    out = []
    if want - covered:
        out.append(f"{graph.rel(dvc_file)}:{name} lacks code deps {sorted(want - covered)}")
    if have - listed or have - want:
        out.append(f"{graph.rel(dvc_file)}:{name} lists code it never imports (or whole directories) "
                   f"{sorted(have - want)}")
    return out


def params_problems(dvc_file: Path, name: str, stage: dict) -> list[str]:
    reads = params_reads(stage_script(dvc_file, stage))
    declared = declared_params(dvc_file, stage)
    files = params_files_of(dvc_file, stage)
    out = []
    for i, f in enumerate(files):
        data = yaml.safe_load((REPO / f).read_text()) or {}
        want = reads if i == 0 else {k for k in reads if _has_key(data, k)}
        have = declared.get(f, set())
        if want != have:
            out.append(f"{rel(dvc_file)}:{name} params of {f}: reads {sorted(want)}, declares {sorted(have)}")
    for f in set(declared) - set(files):
        out.append(f"{rel(dvc_file)}:{name} declares params of {f}, which its command never reads")
    return out


def layering_problems(name: str, script: Path) -> list[str]:
    if Path(script).stem not in FORBIDDEN:
        return []
    mods_bad, ext_bad = FORBIDDEN[Path(script).stem]
    _, modules, ext = closure(script)
    bad = sorted(m for m in modules if any(m == b or m.startswith(b + ".") for b in mods_bad))
    bad += sorted(e for e in ext if e in ext_bad)
    return [f"{name} reaches {bad}"] if bad else []


def test_every_stage_declares_exactly_its_code():
    problems = [p for f, n, s in all_stages() for p in code_problems(f, n, s)]
    assert not problems, "\n".join(problems)


def test_every_stage_declares_exactly_the_params_it_reads():
    problems = [p for f, n, s in all_stages() for p in params_problems(f, n, s)]
    assert not problems, "\n".join(problems)


def test_offline_stages_never_reach_torch_model_or_capture_code():
    problems = [p for s in FORBIDDEN for p in layering_problems(s, REPO / "stages" / f"{s}.py")]
    assert not problems, "\n".join(problems)


def test_params_are_loaded_only_by_stage_scripts():
    """The derivation above reads the stage scripts only: no library module may open params itself."""
    loaders = {"read_params", "load_section", "load_base"}
    bad = []
    for f in sorted((REPO / "pipeline").rglob("*.py")):
        if rel(f) in ("pipeline/looptrace/config.py", "pipeline/looptrace/project.py") or f.parent.name == "stages":
            continue
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in loaders:
                bad.append(f"{rel(f)}:{node.lineno} calls {node.func.id}")
    assert not bad, "\n".join(bad)
    src = (REPO / "pipeline" / "looptrace" / "project.py").read_text()  # the keys PROJECT_READS assumes
    for key in ("tasks", "regimes", "task_defs", "regime_defs"):
        assert f'train.get("{key}")' in src, key


def test_value_modules_of_the_dump_are_its_deps():
    """The dump hashes the source of VALUE_MODULES into the store; each is a dep of the dump stage."""
    from looptrace.capture.resume import VALUE_MODULES

    stage = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]["dump"]
    have = code_deps(REPO / "dvc.yaml", stage)
    assert {rel(module_file(m)) for m in VALUE_MODULES} <= have


def test_train_modules_are_the_train_stages_value_code():
    """The train fingerprint hashes the source of TRAIN_MODULES (a finished model dir of the same fingerprint is
    kept, not retrained): each is a dep of the train stage, and every task, regime, model and halting module the
    stage imports is one of them."""
    from looptrace.models.train import TRAIN_MODULES

    stage = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]["train"]
    have = code_deps(REPO / "dvc.yaml", stage)
    listed = {rel(module_file(m)) for m in TRAIN_MODULES}
    assert listed <= have
    value_code = {d for d in have if d.startswith(("pipeline/looptrace/tasks/", "pipeline/looptrace/signals/halting"))
                  or d in ("pipeline/looptrace/models/looped.py", "pipeline/looptrace/models/regimes.py",
                           "pipeline/looptrace/models/train.py")}
    assert value_code <= listed, sorted(value_code - listed)


@pytest.mark.parametrize("stage", TORCH_FREE_IMPORT)
def test_stage_import_loads_no_torch_and_only_its_closure(stage):
    script = REPO / "stages" / f"{stage}.py"
    code = textwrap.dedent(f"""
        import importlib.util, json, sys
        spec = importlib.util.spec_from_file_location("stage_under_test", {str(script)!r})
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
        print(json.dumps(sorted(sys.modules)))
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO.parent, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    loaded = set(json.loads(res.stdout.strip().splitlines()[-1]))
    assert "torch" not in loaded and "transformers" not in loaded
    ours = {m for m in loaded if m == "looptrace" or m.startswith("looptrace.")}
    _, static, _ = closure(script)
    assert ours <= static, f"loaded at run time but missing from the static closure: {sorted(ours - static)}"


def test_the_check_fails_on_the_pre_redesign_tree(tmp_path):
    """Run on main before the redesign (54c1cea: its code, with its top-level ``pipeline``/``stages`` packages,
    and its dvc.yaml), the same checks fail: gates lacks the precision module every store read decodes
    through (and regimes' tasks), latency and diagnose lack modules they import, and geometry reaches torch and
    the model through training dynamics."""
    try:
        archive = subprocess.run(["git", "archive", "54c1cea", "pipeline", "stages", "dvc.yaml"], cwd=REPO,
                                 capture_output=True, check=True).stdout
    except (subprocess.CalledProcessError, FileNotFoundError):
        pytest.skip("no git history (54c1cea) in this checkout")
    import io
    import tarfile

    tarfile.open(fileobj=io.BytesIO(archive)).extractall(tmp_path, filter="data")
    graph = ImportGraph(tmp_path, {"pipeline": "pipeline", "stages": "stages"})
    stages = yaml.safe_load((tmp_path / "dvc.yaml").read_text())["stages"]
    problems = {n: code_problems(tmp_path / "dvc.yaml", n, s, graph) for n, s in stages.items()}
    gates = " ".join(problems["gates"])
    assert "gates lacks code deps" in gates and "pipeline/precision.py" in gates, problems["gates"]
    _, modules, ext = graph.closure(tmp_path / "stages" / "geometry.py")
    assert "torch" in ext and {"pipeline.model", "pipeline.dump", "pipeline.train"} <= modules
    print("\n".join(p for ps in problems.values() for p in ps))
    print("geometry reaches torch and", sorted(m for m in modules if m in ("pipeline.model", "pipeline.dump",
                                                                           "pipeline.train", "pipeline.interface")))


def test_model_code_edit_leaves_analysis_stages_untouched():
    """Editing the looped transformer (pipeline/models/looped.py) changes only stages that run it: train, dump,
    dynamics, loopmap, latency and generate; never geometry, readouts, gates, diagnose or report."""
    touched = {n for f, n, s in all_stages() if f == REPO / "dvc.yaml" and "pipeline/looptrace/models/looped.py" in code_deps(f, s)}
    assert touched == {"train", "dump", "dynamics", "loopmap", "latency", "generate"}, touched


ADAPTERS = REPO / "pipeline" / "looptrace" / "models" / "adapters"


def test_every_adapter_module_is_a_dep_of_each_stage_that_loads_adapters():
    """The kinds table's modules are reached only through string references (looptrace.registry); the static scan
    reads them, so every module of ``models/adapters`` — each kind's adapter and decoder, the base, the shim — is a
    dep of every stage that can load an adapter (dump, generate, and dynamics, which checks the dump section's
    ``dump.adapter``; in dvc.yaml and every profile)."""
    from looptrace.models.adapters.kinds import KINDS

    kinds = {rel(module_file(ref.split(":")[0])) for ref in KINDS.refs().values()}
    package = {rel(f) for f in ADAPTERS.glob("*.py")}
    assert len(kinds) == len(KINDS) and kinds <= package
    loaders = set()
    for f, n, s in all_stages():
        have = code_deps(f, s)
        if rel(ADAPTERS / "loading.py") in have:
            loaders.add((rel(f), n))
            assert package <= have, f"{rel(f)}:{n} lacks {sorted(package - have)}"
    assert {n for _, n in loaders} == {"dump", "dynamics", "generate"} and ("dvc.yaml", "dump") in loaders, loaders


def test_a_new_kind_is_one_module_and_one_table_line_and_a_dep_of_the_dump(tmp_path):
    """In a scratch copy of the tree, a new adapter module plus its line in the kinds table is in the dump's closure
    (hence written into its deps by ``python -m tests.test_dvc_deps``); without the line, it is not."""
    shutil.copytree(REPO / "pipeline", tmp_path / "pipeline", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "stages", tmp_path / "stages", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    adapters = tmp_path / "pipeline" / "looptrace" / "models" / "adapters"
    (adapters / "probe.py").write_text("from looptrace.models.adapters.base import HFAdapter\n\n\n"
                                       "class ProbeAdapter(HFAdapter):\n    pass\n")

    def dump_closure() -> set[str]:
        graph = ImportGraph(tmp_path)
        return {graph.rel(f) for f in graph.closure(tmp_path / "stages" / "dump.py")[0]}

    probe = "pipeline/looptrace/models/adapters/probe.py"
    assert probe not in dump_closure()
    table = adapters / "kinds.py"
    text = table.read_text()
    line = '    "huginn": "looptrace.models.adapters.huginn:HuginnAdapter",\n'
    assert line in text
    table.write_text(text.replace(line, line + '    "probe": "looptrace.models.adapters.probe:ProbeAdapter",\n'))
    assert probe in dump_closure()


def _dvc_bin() -> str | None:
    own = REPO / ".venv" / "bin" / "dvc"
    return str(own) if own.exists() else shutil.which("dvc")


@pytest.mark.skipif(_dvc_bin() is None, reason="needs dvc (the project's .venv)")
def test_an_adapter_edit_makes_the_dump_stale(tmp_path):
    """In a scratch copy of the project with the dump recorded as up to date (placeholder inputs and outputs: DVC
    compares hashes), editing one adapter kind's module — which the dump reaches only through the kinds table —
    makes ``dvc status`` list the dump stage (every model in one), and no stage that cannot load an adapter."""
    from looptrace.project import model_names
    from tests.test_e2e_gates import copy_tiny_project

    params = copy_tiny_project(tmp_path)
    env = {**os.environ, "DVC_NO_ANALYTICS": "1", "PYTHONPATH": str(tmp_path / "pipeline")}

    def dvc(*args: str) -> str:
        res = subprocess.run([_dvc_bin(), *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
        assert res.returncode == 0, f"dvc {' '.join(args)}: {res.stdout[-2000:]}{res.stderr[-2000:]}"
        return res.stdout + res.stderr

    def stale() -> set[str]:
        return set(re.findall(r"(?m)^(\S+):\s*$", dvc("status", "dump")))

    dvc("init", "--no-scm", "-q")
    models = model_names(params)
    for m in models:
        for f in (tmp_path / "artifacts" / "train" / m / "model.pt", tmp_path / "artifacts" / "dump" / m / "x"):
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_text(m)
    dvc("commit", "-f", "-q", "dump")
    assert stale() == set()
    module = tmp_path / "pipeline" / "looptrace" / "models" / "adapters" / "huginn.py"
    module.write_text(module.read_text() + "\n# an edit\n")
    got = stale()
    assert got == {"dump"}, dvc("status", "dump")  # one stage dumps every model of the matrix
    touched = {n for n, s in yaml.safe_load((tmp_path / "dvc.yaml").read_text())["stages"].items()
               if rel(ADAPTERS / "huginn.py") in s["deps"]}
    assert touched == {"dump", "dynamics", "generate"}, touched


def test_design_stage_table_lists_the_params_each_stage_reads():
    """docs/DESIGN.md's "Stages, params, artifacts" table: its params column is each stage's derived reads."""
    import re

    text = (REPO / "docs" / "DESIGN.md").read_text()
    section = text.split("## Stages, params, artifacts", 1)[1].split("\n### ", 1)[0]
    rows = {cells[0]: cells[1] for line in section.splitlines() if line.startswith("| ")
            for cells in [[c.strip() for c in line.strip("|").split("|")]] if cells[0] not in ("stage", "---")}
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    assert set(rows) == set(stages), sorted(set(rows) ^ set(stages))
    for name, cell in rows.items():
        assert set(re.findall(r"`([\w.]+)`", cell)) == params_reads(REPO / "stages" / f"{name}.py"), name


# ---------------------------------------------------------------------------------------------- the fixer

def rewrite_code_deps(dvc_file: Path) -> bool:
    """Rewrite the ``pipeline/``/``stages/`` entries of every stage's ``deps`` in ``dvc_file`` to its closure
    (stage script first, then sorted), keeping every other line (artifact deps, comments) as it is."""
    import re

    stages = yaml.safe_load(dvc_file.read_text())["stages"]
    lines = dvc_file.read_text().splitlines(keepends=True)
    out, i, name = [], 0, None
    while i < len(lines):
        m = re.match(r"^  ([\w-]+):\s*$", lines[i])
        if m:
            name = m.group(1)
        out.append(lines[i])
        if lines[i].strip() == "deps:" and name in stages:
            i += 1
            kept, indent = [], None
            while i < len(lines) and (lines[i].lstrip().startswith("- ") or lines[i].lstrip().startswith("#")):
                item = lines[i].strip()[2:]
                indent = indent or lines[i][:len(lines[i]) - len(lines[i].lstrip())]
                if not item.startswith(("pipeline/", "stages/")):
                    kept.append(lines[i])
                i += 1
            files, _, _ = closure(stage_script(dvc_file, stages[name]))
            code = sorted(rel(f) for f in files)
            code = [c for c in code if c.startswith("stages/")] + [c for c in code if not c.startswith("stages/")]
            out += [f"{indent}- {c}\n" for c in code] + kept
            continue
        i += 1
    text = "".join(out)
    changed = text != dvc_file.read_text()
    dvc_file.write_text(text)
    return changed


if __name__ == "__main__":  # python -m tests.test_dvc_deps: rewrite every dvc.yaml's code deps to the closures
    for f in dvc_files():
        print(f"{rel(f)}: {'rewritten' if rewrite_code_deps(f) else 'up to date'}")
