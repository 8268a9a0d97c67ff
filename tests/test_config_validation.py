"""Every config value is validated where it is declared.

Types are exact (a bool is not an int, a string is not a number, NaN is not a finite float), ranges make the
computation meaningful, a device must exist on this machine, a section of the wrong shape and a misspelled
top-level section are named as such, and cross-section keys must name values the other stage computed. Each
case checks the one-line message names the key and the value.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import yaml

from looptrace.config import (
    BaseConfig,
    Check,
    ConfigError,
    from_dict,
    load_section,
    read_params,
    require_in,
)
from looptrace.gates.config import GatesConfig
from looptrace.models import check_device
from looptrace.models.train import TrainConfig
from looptrace.rules.readouts import ReadoutsConfig
from looptrace.rules.scoring import MIN_QUANTILES, CalibrationConfig

REPO = Path(__file__).resolve().parents[1]


def one_line(exc: pytest.ExceptionInfo) -> str:
    msg = str(exc.value)
    assert "\n" not in msg, msg
    return msg


@pytest.mark.parametrize(("cls", "section", "data", "needle"), [
    (BaseConfig, "base", {"threads": 0}, "base.threads = 0: must be ≥ 1"),
    (BaseConfig, "base", {"threads": True}, "base.threads = true: expected an integer, got a bool"),
    (BaseConfig, "base", {"threads": 2.5}, "base.threads = 2.5: expected an integer, got a number"),
    (BaseConfig, "base", {"seed": -1}, "base.seed = -1: must be in [0, 4294967296)"),
    (BaseConfig, "base", {"device": "gpu"}, "base.device = 'gpu': must be a string matching"),
    (CalibrationConfig, "calibration", {"n_quantiles": True}, "calibration.n_quantiles = true: expected an integer"),
    (CalibrationConfig, "calibration", {"n_quantiles": 1}, f"calibration.n_quantiles = 1: must be ≥ {MIN_QUANTILES}"),
    (CalibrationConfig, "calibration", {"delta": "half"}, "calibration.delta = 'half': expected a number, got a string"),
    (CalibrationConfig, "calibration", {"delta": math.nan}, "calibration.delta = nan: expected a finite number"),
    (CalibrationConfig, "calibration", {"dx": [95, 101]}, "calibration.dx[1] = 101.0: must be in (0, 100]"),
    (CalibrationConfig, "calibration", {"dx": []}, "calibration.dx = []: must be non-empty"),
    (ReadoutsConfig, "readouts", {"rules": []}, "readouts.rules = []: list at least one exit rule"),
    (TrainConfig, "train", {"steps": 0}, "train.steps = 0: must be ≥ 1 (optimiser steps; 0 would save an untrained"),
    (TrainConfig, "train", {"batch_size": 0}, "train.batch_size = 0: must be ≥ 1"),
    (TrainConfig, "train", {"val_sequences": 0}, "train.val_sequences = 0: must be ≥ 1"),
    (TrainConfig, "train", {"checkpoint_fractions": [1.5, -1]}, "train.checkpoint_fractions[0] = 1.5: must be in (0, 1)"),
    (TrainConfig, "train", {"model": {"d_model": 10, "n_head": 4}}, "train.model.d_model = 10 is not a multiple"),
    (TrainConfig, "train", {"model": {"loop_form": "mul"}}, "train.model.loop_form = 'mul': must be one of add"),
    (TrainConfig, "train", {"model": {"groups": [{"loops": 0}]}}, "train.model.groups[0].loops = 0: must be ≥ 1"),
    (TrainConfig, "train", {"lr": 1e-3, "min_lr": 1e-2}, "train.min_lr = 0.01 exceeds train.lr = 0.001"),
    (TrainConfig, "train", {"regime_defs": {"u": {"kind": "uniform", "lam": 1.5}}},
     "train.regime_defs.u.lam = 1.5: must be in (0, 1)"),
    (TrainConfig, "train", {"task_defs": {"a": {"kind": "mano", "min_ops": 4, "max_ops": 3}}},
     "min_ops = 4 exceeds max_ops = 3"),
    (GatesConfig, "gates", {"log_stats": 1}, "gates.log_stats = 1: expected true or false, got an integer"),
    (TrainConfig, "train", {"model": [1, 2]}, "train.model must be a mapping (key: value lines), got a list [1, 2]"),
])
def test_bad_value_is_one_line_naming_key_and_value(cls, section, data, needle):
    with pytest.raises(ConfigError) as exc:
        from_dict(cls, data, section)
    assert needle in one_line(exc)


def test_valid_values_keep_their_meaning():
    # An int is a float (exactly), a float list stays floats, a None-able field takes null.
    cal = from_dict(CalibrationConfig, {"n_quantiles": MIN_QUANTILES, "delta": 1, "dx": [95, 99.5]}, "calibration")
    assert (cal.n_quantiles, cal.delta, cal.dx) == (11, 1.0, (95.0, 99.5)) and isinstance(cal.delta, float)
    tr = from_dict(TrainConfig, {"threads_per_model": None, "checkpoint_fractions": [0.5]}, "train")
    assert tr.threads_per_model is None and tr.checkpoint_fractions == (0.5,)


def test_check_requirement_text():
    # The message states the interval with the bracket kinds the bounds have.
    assert Check(ge=0, lt=1).requirement() == "in [0, 1)"
    assert Check(gt=0, le=100).requirement() == "in (0, 100]"
    assert Check(ge=11).requirement() == "≥ 11"
    assert Check(choices=("a", "b")).requirement() == "one of a, b"


def write(tmp_path: Path, data, name: str = "params.yaml") -> Path:
    p = tmp_path / name
    p.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return p


def test_section_of_wrong_shape_is_named(tmp_path):
    p = write(tmp_path, {"readouts": ["bad"]})
    with pytest.raises(ConfigError) as exc:
        load_section(ReadoutsConfig, "readouts", p)
    assert one_line(exc) == "section 'readouts' must be a mapping (key: value lines), got a list ['bad']"


def test_misspelled_top_level_section_is_refused_with_a_suggestion(tmp_path):
    p = write(tmp_path, {"base": {"seed": 0}, "readout": {"rules": ["fixed"]}})
    with pytest.raises(ConfigError) as exc:
        read_params(p)
    msg = one_line(exc)
    assert f"unknown params section 'readout' in '{p}'; did you mean 'readouts'?" in msg


def test_empty_params_file_is_refused_for_a_stage_section(tmp_path):
    p = write(tmp_path, "")
    assert load_section(BaseConfig, "base", p) == BaseConfig()  # shared defaults are fine
    with pytest.raises(ConfigError) as exc:
        load_section(TrainConfig, "train", p, required=True)
    assert one_line(exc).startswith(f"params section 'train' is missing from {p}")


def test_repository_params_and_profiles_are_valid():
    # The shipped params (alone and with each profile layered) load through every stage's section.
    from looptrace.capture.dump import DumpConfig
    from looptrace.capture.dynamics import DynamicsConfig
    from looptrace.diagnose.config import DiagnoseConfig
    from looptrace.geometry.stage import GeometryConfig
    from looptrace.intervals import IntervalsConfig
    from looptrace.loopmap.config import LoopmapConfig
    from looptrace.online.generate import GenerateConfig
    from looptrace.online.latency import LatencyConfig
    from looptrace.report import ReportConfig

    sections = {"base": BaseConfig, "train": TrainConfig, "dump": DumpConfig, "geometry": GeometryConfig,
                "dynamics": DynamicsConfig, "loopmap": LoopmapConfig, "calibration": CalibrationConfig, "intervals": IntervalsConfig,
                "readouts": ReadoutsConfig, "gates": GatesConfig, "diagnose": DiagnoseConfig,
                "latency": LatencyConfig, "generate": GenerateConfig, "report": ReportConfig}
    layers = [[REPO / "params.yaml"]] + [[REPO / "params.yaml", p] for p in sorted(REPO.glob("profiles/*/params.yaml"))]
    for files in layers:
        for name, cls in sections.items():
            load_section(cls, name, files, required=True)


def test_require_in_names_both_keys():
    require_in("diagnose.x", 95, "calibration.dx", (95.0, 98.0))  # an int equals its float
    with pytest.raises(ConfigError) as exc:
        require_in("diagnose.x", 90.0, "calibration.dx", (95.0, 98.0))
    assert one_line(exc) == ("diagnose.x = 90.0 is not in calibration.dx = [95.0, 98.0]; set diagnose.x to one of "
                             "them or add it to calibration.dx")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_device_that_does_not_exist_is_refused():
    assert check_device("cpu") == "cpu"
    with pytest.raises(ConfigError) as exc:
        check_device("cuda")
    assert one_line(exc).startswith("base.device = 'cuda': this machine has no usable CUDA device")


def test_cuda_index_beyond_visible_devices_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert check_device("cuda:1") == "cuda:1"
    with pytest.raises(ConfigError) as exc:
        check_device("cuda:2")
    assert "only 2 CUDA device(s) are visible (cuda:0..cuda:1)" in one_line(exc)
