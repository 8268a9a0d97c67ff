"""End to end (slow): in a tiny copy of the project, changing only a ``gates`` parameter re-runs the
``gates`` stage and invalidates the stages downstream of it — never anything upstream (train, dump,
geometry, readouts); editing the model's code (pipeline/looptrace/models/looped.py) changes only the stages that
run the model (train, dump, dynamics, loopmap, latency, generate).

The project is built in tmp_path from the repository's own dvc.yaml, params.yaml (shrunk to a tiny
profile), pipeline/ and stages/. To stay within ~90 s on two shared cores, the first full run executes
every stage command of dvc.yaml (matrix expanded from params, topological order) *in this process*
through the ``looptrace`` CLI — one torch/sklearn import instead of one per stage — and records it with
``dvc commit`` (exactly what ``dvc repro`` records after running them). Then ``gates.oracle_delta`` is
edited and checked with ``dvc status``, ``dvc repro --dry`` and a real ``dvc repro gates`` (a subprocess),
against the set of stages that depend on gates' outputs, derived from dvc.yaml itself (so the test
follows whatever stages exist).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]

#: The tiny profile: every section that exists in params.yaml gets these overrides (others keep theirs).
TINY = {
    "base": {"threads": 1},
    "train": {"tasks": ["running_parity"], "regimes": ["uniform", "joint"],
              "task_defs": {"running_parity": {"kind": "running_parity", "length": 6}},
              "model": {"d_model": 16, "n_head": 2, "groups": [{"n_layer": 1, "loops": 3}], "gate_hidden": 8},
              "steps": 8, "steps_by_task": {}, "batch_size": 16, "warmup": 2, "val_sequences": 16,
              "checkpoint_fractions": [0.5]},
    "dump": {"sequences": {"fit": 24, "val": 16, "test": 16}, "batch_size": 16, "chunk_tokens": 64},
    "dynamics": {"enabled": False},
    "loopmap": {"sequences": 8, "batch_size": 4, "power_iters": 1, "n_boot": 10, "dpi": 50},
    "gates": {"gates": ["logreg-oracle", "ponder-linear", "logreg-converged"], "cross_gates": ["logreg-oracle"],
              "pca_components": 4, "mlp_max_iter": 5, "ponder": {"epochs": 3}},
    "latency": {"batch_sizes": [8], "bs1_sequences": 2, "repeats": 1, "require_exact": False},
    "generate": {"batch_sizes": [1, 4], "prompts": 4, "prompt_len": 3, "new_tokens": 3, "repeats": 1},
    "report": {"dpi": 50},
}


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) and k != "task_defs" else v
    return out


def _prefix(path: str) -> str:
    """The literal part of a dvc path (before any ``${...}``), without a trailing slash."""
    return path.split("${", 1)[0].rstrip("/")


def _paths(entries) -> list[str]:
    return [_prefix(next(iter(e)) if isinstance(e, dict) else e) for e in entries or []]


def downstream_of(dvc_yaml: dict, root: str) -> set[str]:
    """Stage ``root`` and every stage that (transitively) depends on an output of it."""
    stages = dvc_yaml["stages"]
    outs = {n: _paths(s.get("outs")) + _paths(s.get("metrics")) + _paths(s.get("plots")) for n, s in stages.items()}
    deps = {n: _paths(s.get("deps")) for n, s in stages.items()}

    def feeds(a: str, b: str) -> bool:  # an out of a is (under) a dep of b, or a dep of b is under an out of a
        return any(o == d or o.startswith(d + "/") or d.startswith(o + "/") for o in outs[a] for d in deps[b] if o and d)

    found, todo = {root}, [root]
    while todo:
        a = todo.pop()
        for b in stages:
            if b not in found and feeds(a, b):
                found.add(b)
                todo.append(b)
    return found


def _dvc(args: list[str], cwd: Path, env: dict, timeout: int = 240) -> str:
    res = subprocess.run([str(REPO / ".venv" / "bin" / "dvc"), *args], cwd=cwd, env=env, capture_output=True,
                         text=True, timeout=timeout)
    assert res.returncode == 0, f"dvc {' '.join(args)} failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    return res.stdout + res.stderr


def _stage_names(text: str, pattern: str) -> set[str]:
    """Base stage names (``train@x`` -> ``train``) of the lines matching ``pattern`` (one group: the name)."""
    return {m.split("@", 1)[0] for m in re.findall(pattern, text)}


def copy_tiny_project(root: Path) -> dict:
    """Copy the code, dvc.yaml and a tiny params.yaml (params.yaml with :data:`TINY` merged in) into ``root``;
    returns those params."""
    for d in ("pipeline", "stages"):
        shutil.copytree(REPO / d, root / d, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "dvc.yaml", root / "dvc.yaml")
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params = {k: _merge(v, TINY[k]) if k in TINY and isinstance(v, dict) else v for k, v in params.items()}
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    return params


def build_project(root: Path) -> tuple[dict, dict]:
    """:func:`copy_tiny_project` into ``root``, then ``dvc init --no-scm``."""
    copy_tiny_project(root)
    env = {**os.environ, "PATH": f"{REPO / '.venv' / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
           "DVC_NO_ANALYTICS": "1", "PYTHONPATH": str(root / "pipeline"), "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    _dvc(["init", "--no-scm", "-q"], root, env)
    return yaml.safe_load((root / "dvc.yaml").read_text()), env


def _lookup(params: dict, dotted: str):
    v = params
    for k in dotted.split("."):
        v = v[k]
    return v


def stage_commands(dvc_yaml: dict, params: dict) -> list[tuple[str, str]]:
    """(stage name, cmd) of every stage, ``matrix`` expanded from params, in a topological order."""
    stages = dvc_yaml["stages"]
    order, seen = [], set()

    def visit(n: str) -> None:
        if n in seen:
            return
        seen.add(n)
        for m in stages:
            if m != n and n in downstream_of(dvc_yaml, m):
                visit(m)
        order.append(n)

    for n in stages:
        visit(n)
    out = []
    for n in order:
        st = stages[n]
        if "foreach" in st:
            raise NotImplementedError(f"stage {n}: foreach stages are not expanded by this test; use matrix")
        items = [{}]
        for key, vals in (st.get("matrix") or {}).items():
            if isinstance(vals, str):
                vals = _lookup(params, vals.strip()[2:-1])  # "${train.tasks}"
            items = [{**it, key: v} for it in items for v in vals]
        for it in items:
            cmd = st["cmd"]
            for key, v in it.items():
                cmd = cmd.replace("${item." + key + "}", str(v))
            name = n + ("@" + "-".join(str(v) for v in it.values()) if it else "")
            out.append((name, cmd))
    return out


def run_in_process(cmd: str, cwd: Path) -> None:
    """``python stages/<name>.py args`` through the looptrace CLI in this process (same code path)."""
    import shlex

    from typer.testing import CliRunner

    from looptrace.cli import app

    argv = shlex.split(cmd)
    assert argv[0] == "python" and argv[1].startswith("stages/"), f"unexpected stage command {cmd!r}"
    stage = Path(argv[1]).stem
    old = Path.cwd()
    os.chdir(cwd)
    try:
        res = CliRunner().invoke(app, [stage, *argv[2:]])
    finally:
        os.chdir(old)
    assert res.exit_code == 0, f"{cmd} failed: {res.output[-3000:]} {res.exception!r}"


@pytest.mark.skipif(not (REPO / ".venv" / "bin" / "dvc").exists(), reason="needs the project's .venv with dvc")
def test_gates_param_change_reruns_only_gates_and_downstream(tmp_path):
    import torch

    torch.set_num_threads(1)
    dvc_yaml, env = build_project(tmp_path)
    assert "gates" in dvc_yaml["stages"], "dvc.yaml has no 'gates' stage"
    allowed = downstream_of(dvc_yaml, "gates")
    upstream = set(dvc_yaml["stages"]) - allowed
    assert {"train", "dump"} <= upstream and "gates" in allowed  # the DAG is what this test is about
    direct = {b for b in dvc_yaml["stages"] if b != "gates" and "artifacts/gates" in _paths(dvc_yaml["stages"][b].get("deps"))}

    params = yaml.safe_load((tmp_path / "params.yaml").read_text())
    for _, cmd in stage_commands(dvc_yaml, params):
        run_in_process(cmd, tmp_path)
    _dvc(["commit", "-f", "-q"], tmp_path, env)  # (an unrecorded stage would show in the status below)
    before = {p: p.stat().st_mtime_ns for p in (tmp_path / "artifacts").rglob("*")
              if p.is_file() and p.relative_to(tmp_path / "artifacts").parts[0] in {"train", "dump"}}
    assert before

    # editing the looped transformer's code changes exactly the stages that run the model, never the offline
    # analysis (geometry, readouts, gates, diagnose, report read stores and tables only)
    model_py = tmp_path / "pipeline" / "looptrace" / "models" / "looped.py"
    source = model_py.read_text()
    model_py.write_text(source + "\n# an edit\n")
    runs_model = {n for n, st in dvc_yaml["stages"].items() if "pipeline/looptrace/models/looped.py" in _paths(st.get("deps"))}
    assert runs_model == {"train", "dump", "dynamics", "loopmap", "latency", "generate"}, runs_model
    changed = _stage_names(_dvc(["status"], tmp_path, env), r"(?m)^(\S+):\s*$")
    assert changed == runs_model, f"dvc status after a model code edit lists {sorted(changed)}"
    model_py.write_text(source)

    params["gates"]["oracle_delta"] = float(params["gates"].get("oracle_delta", 0.01)) * 2 + 0.01
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))

    status = _dvc(["status"], tmp_path, env)
    changed = _stage_names(status, r"(?m)^(\S+):\s*$")
    assert changed == {"gates"}, f"dvc status after a gates param edit lists {sorted(changed)}:\n{status}"
    dry = _stage_names(_dvc(["repro", "--dry"], tmp_path, env), r"Running stage '([^']+)'")
    assert "gates" in dry and dry <= allowed, f"dry run would run {sorted(dry)}; allowed {sorted(allowed)}"

    ran = _stage_names(_dvc(["repro", "gates"], tmp_path, env, timeout=300), r"Running stage '([^']+)'")
    assert ran == {"gates"}, f"dvc repro gates ran {sorted(ran)}"
    assert {p: p.stat().st_mtime_ns for p in before} == before  # upstream artifacts untouched
    status = _dvc(["status"], tmp_path, env)
    changed = _stage_names(status, r"(?m)^(\S+):\s*$")
    # the new gates outputs invalidate exactly the stages that read them (and nothing upstream)
    assert direct <= changed <= allowed - {"gates"}, f"after re-running gates, dvc status lists {sorted(changed)}"
