"""Property-based tests of the config surface.

Random mutations of the repository's params.yaml — a value of the wrong type, out of range or non-finite, an
unknown key, a missing key, a section or sub-mapping of the wrong shape — for every stage:

- loading the section gives a one-line :class:`ConfigError` that names the section, or a config whose loaded
  value *is* the mutated value (type-exact: a bool never passes for a number, a number never for a string); no
  other exception (a traceback) and no silent change of meaning;
- the stage's command (over input roots that do not exist) exits 2 with one line and no traceback: either the
  config error, or — for a valid mutation — the missing-input error that names what to run first.

Examples are derandomised (the same on every run) so CI is reproducible; a failure prints the mutation.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from looptrace.config import BaseConfig, ConfigError, from_dict, read_params, to_dict
from looptrace.intervals import IntervalsConfig
from looptrace.rules.scoring import CalibrationConfig
from looptrace.stages import registered

REPO = Path(__file__).resolve().parents[1]
PARAMS = read_params([REPO / "params.yaml"])
#: Every params section's dataclass: the shared ones and each registered stage's (looptrace.stages).
SECTIONS = {"base": BaseConfig, "calibration": CalibrationConfig, "intervals": IntervalsConfig,
            **{s.name: s.config for s in registered()}}

# ------------------------------------------------------------------------------------------- mutations

#: Values a user may write by mistake: wrong types, out of range, non-finite, empty, wrong shapes.
WRONG = st.one_of(
    st.none(), st.booleans(), st.sampled_from([0, -1, 1, 2, 7, 10**12, -(10**12)]),
    st.sampled_from([0.0, -1.5, 0.5, 1.0, 1.5, 100.5, math.nan, math.inf, -math.inf]),
    st.sampled_from(["", "x", "auto", "cpu", "cuda", "none", "1", "true", "entropy", "running_sum"]),
    st.sampled_from([[], [0], [1, 2], ["a"], [None], [[1]], [{"a": 1}], [1.5, -1]]),
    st.sampled_from([{}, {"x": 1}, {"kind": "nope"}, {"a": {"b": 1}}]),
    st.integers(-5, 5), st.floats(-3, 3, allow_nan=False), st.text(max_size=5),
)


def leaf_paths(obj: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path to a value (mapping keys and list indices), the containers included."""
    out = [prefix] if prefix else []
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += leaf_paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += leaf_paths(v, (*prefix, i))
    return out


def get_at(obj: Any, path: tuple) -> Any:
    for p in path:
        obj = obj[p]
    return obj


@st.composite
def mutation(draw, section: str) -> tuple[Any, str, tuple, Any]:
    """(mutated section, what was done, path, new value)."""
    data = copy.deepcopy(PARAMS[section])
    kind = draw(st.sampled_from(["replace", "replace", "replace", "unknown_key", "delete", "whole"]))
    if kind == "whole":
        v = draw(st.sampled_from([None, [], [1], "x", 3, True]))
        return v, "whole section", (), v
    paths = leaf_paths(data)
    path = draw(st.sampled_from(paths)) if paths else ()
    if kind == "unknown_key":
        dicts = [()] + [p for p in paths if isinstance(get_at(data, p), dict)]
        at = draw(st.sampled_from(dicts))
        get_at(data, at)["zz_not_a_key"] = 1
        return data, "unknown key", (*at, "zz_not_a_key"), 1
    parent = get_at(data, path[:-1])
    if kind == "delete":
        if isinstance(parent, dict):
            del parent[path[-1]]
        else:
            parent.pop(path[-1])
        return data, "delete", path, None
    value = draw(WRONG)
    parent[path[-1]] = value
    return data, "replace", path, value


def same(loaded: Any, written: Any) -> bool:
    """The loaded value is the written one, type-exact (bools are not numbers; ints may load as floats)."""
    if isinstance(written, bool) or isinstance(loaded, bool):
        return type(written) is type(loaded) and written == loaded
    if isinstance(written, int | float) and isinstance(loaded, int | float):
        return (math.isnan(written) and math.isnan(loaded)) if isinstance(written, float) and math.isnan(written) \
            else float(written) == float(loaded)
    if isinstance(written, list | tuple) and isinstance(loaded, list | tuple):
        return len(written) == len(loaded) and all(same(a, b) for a, b in zip(loaded, written, strict=True))
    if isinstance(written, dict) and isinstance(loaded, dict):
        return set(map(str, written)) <= set(map(str, loaded)) and all(same(loaded[k], v) for k, v in written.items())
    return type(written) is type(loaded) and written == loaded


def check_section(section: str, mutated: Any, what: str, path: tuple, value: Any) -> None:
    try:
        cfg = from_dict(SECTIONS[section], mutated, section)
    except ConfigError as exc:
        msg = str(exc)
        assert "\n" not in msg, msg
        assert section in msg, f"{what} {path}: the message does not name the section: {msg}"
        return
    assert what != "whole section", f"{what}: accepted"
    if what == "unknown key":
        # accepted only inside a mapping whose keys are the user's names (task_defs, steps_by_task, eps ...):
        # then it is kept, not dropped
        try:
            kept = get_at(to_dict(cfg), path)
        except (KeyError, IndexError, TypeError):
            kept = None
        assert kept is not None, f"unknown key {path}: accepted and dropped"
        return
    if what == "replace":
        loaded = to_dict(cfg)
        try:
            got = get_at(loaded, path)
        except (KeyError, IndexError, TypeError):
            return  # a value the config normalises into another shape (checked by its own tests)
        assert same(got, value), f"{section}.{'.'.join(map(str, path))} = {value!r} loaded as {got!r}"


@pytest.mark.parametrize("section", sorted(SECTIONS))
def test_random_mutations_of_a_section_are_refused_in_one_line_or_loaded_as_written(section):
    @settings(max_examples=120, derandomize=True, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(mutation(section))
    def run(m):
        check_section(section, *m)

    run()


# ------------------------------------------------------------------------------------------- the commands

#: Each stage's command over input roots that do not exist (a valid config then fails on the first input).
def _cmd(stage: str, tmp: Path) -> list[str]:
    nothing = str(tmp / "nothing")
    roots = {"dump": ["--model", "running_sum-uniform-s0", "--train-root", nothing],
             "dynamics": ["--model", "running_sum-uniform-s0", "--train-root", nothing],
             "loopmap": ["--model", "running_sum-uniform-s0", "--train-root", nothing],
             "geometry": ["--model", "running_sum-uniform-s0", "--dump-root", nothing],
             "readouts": ["--model", "running_sum-uniform-s0", "--geometry-root", nothing],
             "gates": ["--models", "running_sum-uniform-s0", "--dump-root", nothing],
             "diagnose": ["--models", "running_sum-uniform-s0", "--readouts-root", nothing],
             "latency": ["--models", "running_sum-uniform-s0", "--train-root", nothing],
             "generate": ["--models", "running_sum-uniform-s0", "--train-root", nothing],
             "report": ["--models", "running_sum-uniform-s0", "--root", nothing]}
    return [stage, *roots[stage], "--out", str(tmp / "out" / stage)]


#: The sections each command reads (``base`` by all). ``train`` is left out here: a valid mutation would train a
#: model (its section is covered by the loader property above and by tests/test_bad_inputs.py).
STAGE_SECTIONS = {"dump": ["dump", "base"], "dynamics": ["dynamics", "dump", "base"], "loopmap": ["loopmap", "base"],
                  "geometry": ["geometry", "base"],
                  "readouts": ["readouts", "calibration", "intervals", "base"],
                  "gates": ["gates", "calibration", "intervals", "base"],
                  "diagnose": ["diagnose", "calibration", "intervals", "base"],
                  "latency": ["latency", "readouts", "base"], "generate": ["generate", "dump", "intervals", "base"],
                  "report": ["report", "geometry", "calibration", "base"]}


@pytest.mark.parametrize("stage", sorted(STAGE_SECTIONS))
def test_random_params_mutations_never_give_a_traceback_at_the_command(stage, tmp_path):
    from typer.testing import CliRunner

    from looptrace.cli import app

    runner = CliRunner()
    counter = iter(range(10**6))

    @settings(max_examples=25, derandomize=True, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(st.sampled_from(STAGE_SECTIONS[stage]).flatmap(lambda s: st.tuples(st.just(s), mutation(s))))
    def run(sm):
        section, (mutated, what, path, value) = sm
        d = tmp_path / f"case{next(counter)}"
        d.mkdir()
        params = {**copy.deepcopy(PARAMS), section: mutated}
        (d / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False, allow_unicode=True))
        res = runner.invoke(app, [*_cmd(stage, d), "--params", str(d / "params.yaml")])
        out = res.output.strip()
        label = f"{stage}: {what} {section}.{'.'.join(map(str, path))} = {value!r}"
        assert res.exit_code == 2, f"{label}: exit {res.exit_code}\n{out}\n{res.exception!r}"
        assert "Traceback" not in out and len(out.splitlines()) == 1, f"{label}:\n{out}"
        assert not (d / "out" / stage).exists() or not any((d / "out" / stage).rglob("*.parquet")), label

    run()
