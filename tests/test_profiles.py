"""Profiles run without touching tracked files: ``profiles/<name>/params.yaml`` is an override layered over
params.yaml (``--params params.yaml --params profiles/<name>/params.yaml``), and ``profiles/<name>/dvc.yaml`` runs
the stages on it with every output under ``artifacts/<name>/``.

- Layering: :func:`looptrace.config.read_params` merges left to right (mappings key by key, lists and scalars
  replace), rejects an unknown section in an override file, and a stage's unknown key is still an error.
- profiles/ad/dvc.yaml is the default pipeline (dvc.yaml) moved under artifacts/ad/ with the AD override: it is
  generated from dvc.yaml by :func:`profile_pipeline` (``python -m tests.test_profiles`` rewrites it) and this
  test fails when it is stale. Its code and params deps are checked by tests/test_dvc_deps.py like dvc.yaml's.
- No profile writes where another pipeline writes (DVC refuses overlapping outputs, and a profile run must never
  clobber the default artifacts), and ``dvc status dvc.yaml`` lists only the default pipeline.
"""

from __future__ import annotations

import importlib
import inspect
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from looptrace.config import ConfigError, load_section, merge_params, read_params
from tests.import_graph import REPO
from tests.test_dvc_deps import _has_key, params_reads, stage_script

PROFILES = ("ad", "lm", "study", "halting")
#: Profiles whose dvc.yaml is generated from dvc.yaml (the default pipeline on the profile's override).
GENERATED = ("ad", "study", "halting")


# ---------------------------------------------------------------------------------------------- layering

def test_merge_params_mappings_merge_everything_else_replaces():
    base = {"a": {"x": 1, "y": [1, 2], "z": {"p": 1, "q": 2}}, "b": 3}
    over = {"a": {"y": [9], "z": {"q": None}}, "b": {"new": 1}}
    assert merge_params(base, over) == {"a": {"x": 1, "y": [9], "z": {"p": 1, "q": None}}, "b": {"new": 1}}
    assert base == {"a": {"x": 1, "y": [1, 2], "z": {"p": 1, "q": 2}}, "b": 3}  # inputs untouched


def test_layered_params_files(tmp_path):
    from looptrace.geometry import GeometryConfig

    base, over = tmp_path / "params.yaml", tmp_path / "over.yaml"
    base.write_text("geometry: {splits: [val, test], eps: {kl_prev: [0.001]}}\nbase: {seed: 3}\n")
    over.write_text("geometry: {eps: {rel_step: [0.5]}}\n")
    cfg = load_section(GeometryConfig, "geometry", [base, over])
    assert cfg.splits == ("val", "test") and cfg.eps == {"kl_prev": (0.001,), "rel_step": (0.5,)}
    assert read_params([base, over])["base"] == {"seed": 3}
    over.write_text("geometri: {eps: {}}\n")  # a typo'd section in an override is refused, naming the file
    with pytest.raises(ConfigError, match=r"unknown params section 'geometri' in '.*over.yaml'; did you mean 'geometry'"):
        read_params([base, over])
    over.write_text("geometry: {epz: {}}\n")  # a typo'd key inside a section: refused when the stage loads it
    with pytest.raises(ConfigError, match=r"unknown key 'epz' in params section 'geometry'"):
        load_section(GeometryConfig, "geometry", [base, over])
    with pytest.raises(ConfigError, match="not found"):
        read_params([base, tmp_path / "missing.yaml"])


def test_stage_cli_layers_repeated_params(tmp_path):
    """``--params a --params b`` reaches the stage's config (here: readouts' rules from the override)."""
    import json

    import typer
    from typer.testing import CliRunner

    import looptrace.stages.readouts as stage
    from tests.builders import token_loop_splits, write_token_loop

    write_token_loop(tmp_path / "geometry" / "m" / "token_loop.parquet", token_loop_splits(n=120))
    over = tmp_path / "over.yaml"
    over.write_text("readouts: {rules: [fixed, top1]}\ncalibration: {n_quantiles: 11}\n")
    app = typer.Typer()
    app.command()(stage.main)
    res = CliRunner().invoke(app, ["--model", "m", "--params", str(REPO / "params.yaml"), "--params", str(over),
                                   "--geometry-root", str(tmp_path / "geometry"), "--out", str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    m = json.loads((tmp_path / "out" / "m" / "metrics.json").read_text())
    assert set(m["rules"]) == {"fixed", "top1"}
    assert m["params"]["calibration"]["n_quantiles"] == 11 and m["params"]["calibration"]["dx"] == [95, 98, 99]


def test_profile_overrides_name_only_known_sections_and_load():
    """Every profile's layered params load into every section's dataclass (unknown keys would raise)."""
    from looptrace.config import SECTIONS, BaseConfig
    from looptrace.intervals import IntervalsConfig
    from looptrace.rules.scoring import CalibrationConfig
    from looptrace.stages import registered

    classes = {"base": BaseConfig, "calibration": CalibrationConfig, "intervals": IntervalsConfig,
               **{s.name: s.config for s in registered()}}
    assert sorted(classes) == sorted(SECTIONS)
    sections = list(yaml.safe_load((REPO / "params.yaml").read_text()))
    assert sorted(sections) == sorted(SECTIONS) and sections[0] == "base"
    for name in PROFILES:
        files = [REPO / "params.yaml", REPO / "profiles" / name / "params.yaml"]
        for section, cls in classes.items():
            load_section(cls, section, files)
    ad = load_section(classes["train"], "train", [REPO / "params.yaml", REPO / "profiles" / "ad" / "params.yaml"])
    assert ad.tasks == ("mano", "parity") and ad.model.d_model == 512 and ad.steps == 40000
    assert ad.task("mano").modulus == 23 and ad.regime("geometric_05").lam == 0.5


# ---------------------------------------------------------------------------------------------- the AD pipeline

def _prefix_artifacts(path: str, profile: str) -> str:
    if path == "artifacts":
        return f"artifacts/{profile}"
    return f"artifacts/{profile}/" + path[len("artifacts/"):] if path.startswith("artifacts/") else path


def _map_paths(entries, profile: str):
    out = []
    for e in entries or []:
        if isinstance(e, dict):
            (k, v), = e.items()
            out.append({_prefix_artifacts(k, profile): v})
        else:
            out.append(_prefix_artifacts(e, profile))
    return out


def _artifact_options(stage: str, profile: str) -> list[str]:
    """``--<option> artifacts/<profile>/...`` for every option of the stage whose default is under artifacts/."""
    main = importlib.import_module(f"looptrace.stages.{stage}").main
    args = []
    for name, p in inspect.signature(main).parameters.items():
        default = getattr(p.default, "default", None)
        # (a str default too: the dump's --out is a directory or a URL; without this every profile's dump wrote
        # to the default artifacts/dump)
        if isinstance(default, Path | str) and Path(default).parts[:1] == ("artifacts",):
            args += [f"--{name.replace('_', '-')}", _prefix_artifacts(Path(default).as_posix(), profile)]
    return args


#: What each generated profile is, for its header (the rest of the header is the same for every profile).
ABOUT = {
    "ad": ("The [AD] GPU-scale profile (SPEC §9)", "dvc repro profiles/ad/dvc.yaml          (on a GPU machine; "
           "dvc status profiles/ad/dvc.yaml)"),
    "study": ("The study profile (the full 18-model matrix: both tasks x three regimes x three seeds)",
              "make study   (= dvc repro profiles/study/dvc.yaml; dvc status profiles/study/dvc.yaml)"),
    "halting": ("The halting profile (RecurTrace +- loop memory, ACT, beside geometric and joint; issue 26)",
                "dvc repro profiles/halting/dvc.yaml     (dvc status profiles/halting/dvc.yaml)"),
}


def header(profile: str) -> str:
    what, how = ABOUT[profile]
    return (f"# GENERATED from dvc.yaml by `python -m tests.test_profiles` (tests/test_profiles.py fails when it is stale).\n"
            f"# {what}: the default pipeline on params.yaml + profiles/{profile}/params.yaml, every\n"
            f"# output under artifacts/{profile}/, so it never touches the default artifacts or any tracked file.\n"
            f"#   {how}\n"
            f"# The matrix comes from profiles/{profile}/params.yaml (DVC loads the params.yaml beside this file as its "
            f"vars).\n")


#: Outputs a profile's stages write beyond the default pipeline's (a params switch the profile turns on).
EXTRA_OUTS = {"halting": {"diagnose": ["artifacts/halting/diagnose/halting_table.parquet"]}}


def profile_pipeline(profile: str = "ad") -> dict:
    """The default pipeline (dvc.yaml) run on a profile: commands layer ``profiles/<profile>/params.yaml`` over
    params.yaml and write under artifacts/<profile>/; params deps are declared per file (an override key only
    where the file sets it)."""
    override = f"profiles/{profile}/params.yaml"
    data = yaml.safe_load((REPO / override).read_text()) or {}
    root = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    stages = {}
    for name, st in root.items():
        script = stage_script(REPO / "dvc.yaml", st)
        new = {}
        if "matrix" in st:
            new["matrix"] = st["matrix"]
        new["wdir"] = "../.."
        new["cmd"] = " ".join([st["cmd"], "--params params.yaml", f"--params {override}",
                               *_artifact_options(script.stem, profile)])
        new["deps"] = _map_paths(st.get("deps"), profile)
        declared = [k for k in st.get("params") or [] if isinstance(k, str)]
        over_keys = [k for k in declared if _has_key(data, k)]
        new["params"] = declared + ([{override: over_keys}] if over_keys else [])
        for key in ("outs", "metrics", "plots"):
            if key in st:
                new[key] = _map_paths(st[key], profile)
        new["outs"] = new.get("outs", []) + EXTRA_OUTS.get(profile, {}).get(name, [])
        stages[name] = new
    return {"stages": stages}


def render_profile(profile: str = "ad") -> str:
    return header(profile) + yaml.safe_dump(profile_pipeline(profile), sort_keys=False, width=120)


@pytest.mark.parametrize("profile", GENERATED)
def test_generated_profile_pipelines_are_fresh(profile):
    path = REPO / "profiles" / profile / "dvc.yaml"
    assert path.read_text() == render_profile(profile), f"{path} is stale: python -m tests.test_profiles"


def test_ad_pipeline_is_the_default_pipeline_on_the_profile():
    path = REPO / "profiles" / "ad" / "dvc.yaml"  # (fresh: test_generated_profile_pipelines_are_fresh)
    # the params declared for the override are what the stage reads of it (tests/test_dvc_deps.py checks all)
    st = yaml.safe_load(path.read_text())["stages"]["train"]
    assert "--params params.yaml --params profiles/ad/params.yaml" in st["cmd"]
    assert params_reads(REPO / "stages" / "train.py") == {"base.seed", "base.threads", "base.device", "train"}


def _outs(dvc_file: Path) -> set[str]:
    stages = yaml.safe_load(dvc_file.read_text())["stages"]
    wdir = {n: (dvc_file.parent / s.get("wdir", ".")).resolve() for n, s in stages.items()}
    out = set()
    for n, s in stages.items():
        for key in ("outs", "metrics", "plots"):
            for e in s.get(key) or []:
                p = next(iter(e)) if isinstance(e, dict) else e
                out.add((wdir[n] / p.split("${", 1)[0]).resolve().relative_to(REPO).as_posix().rstrip("/"))
    return out


def test_profiles_write_only_under_their_own_artifacts():
    default = _outs(REPO / "dvc.yaml")
    assert all(p.startswith("artifacts/") and not p.startswith(tuple(f"artifacts/{q}/" for q in PROFILES))
               for p in default)
    for name in PROFILES:
        outs = _outs(REPO / "profiles" / name / "dvc.yaml")
        assert outs and all(p.startswith(f"artifacts/{name}/") for p in outs), (name, sorted(outs))
        stages = yaml.safe_load((REPO / "profiles" / name / "dvc.yaml").read_text())["stages"]
        for n, s in stages.items():
            assert f"--params params.yaml --params profiles/{name}/params.yaml" in s["cmd"], (name, n)
            arts = [d for d in (next(iter(e)) if isinstance(e, dict) else e for e in s.get("deps") or [])
                    if d.startswith("artifacts")]
            assert all(d.startswith(f"artifacts/{name}/") for d in arts), (name, n, arts)


@pytest.mark.slow
@pytest.mark.skipif(not (REPO / ".venv" / "bin" / "dvc").exists(), reason="needs the project's .venv with dvc")
def test_dvc_sees_every_pipeline_and_status_of_the_default_one_stays_its_own(tmp_path):
    """In a copy of the project: DVC parses all three pipelines together (any command collects every dvc.yaml
    and refuses overlapping outputs), the AD profile's dry run runs its stages on the layered params, and
    `dvc status dvc.yaml` names only default stages (a bare `dvc status` also lists the profiles' stages)."""
    import shutil

    for d in ("pipeline", "stages", "profiles"):
        shutil.copytree(REPO / d, tmp_path / d, ignore=shutil.ignore_patterns("__pycache__"))
    for f in ("dvc.yaml", "params.yaml"):
        shutil.copy(REPO / f, tmp_path / f)
    env = {**os.environ, "DVC_NO_ANALYTICS": "1"}
    dvc = str(REPO / ".venv" / "bin" / "dvc")

    def run(*args):
        res = subprocess.run([dvc, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
        assert res.returncode == 0, f"dvc {' '.join(args)}:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
        return res.stdout

    run("init", "--no-scm", "-q")
    dry = run("repro", "--dry", "profiles/ad/dvc.yaml:train")  # (later stages need train's outputs to exist)
    assert "Running stage 'profiles/ad/dvc.yaml:train'" in dry
    assert "--params params.yaml --params profiles/ad/params.yaml --out artifacts/ad/train" in dry
    status = run("status", "dvc.yaml")
    names = {line.split(":")[0] for line in status.splitlines() if line and not line[0].isspace()}
    assert names and not any(n.startswith("profiles/") for n in names), status


if __name__ == "__main__":  # python -m tests.test_profiles: regenerate the generated profiles' dvc.yaml from dvc.yaml
    for name in GENERATED:
        (REPO / "profiles" / name / "dvc.yaml").write_text(render_profile(name))
        print(f"profiles/{name}/dvc.yaml written")
