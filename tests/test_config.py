"""Config loading: unknown keys are rejected with a one-line error naming key and section."""

import pytest

from looptrace.config import BaseConfig, ConfigError, from_dict, load_section
from looptrace.models.train import TrainConfig


def test_unknown_key_names_key_and_section():
    with pytest.raises(ConfigError, match=r"unknown key 'sed' in params section 'base'"):
        from_dict(BaseConfig, {"sed": 1}, "base")


def test_nested_unknown_key_names_nested_section():
    with pytest.raises(ConfigError, match=r"'lamda' in params section 'train.regime_defs.geo'"):
        from_dict(TrainConfig, {"regime_defs": {"geo": {"kind": "geometric", "lamda": 0.3}}}, "train")
    with pytest.raises(ConfigError, match=r"'n_layers' in params section 'train.model.groups\[0\]'"):
        from_dict(TrainConfig, {"model": {"groups": [{"n_layers": 1}]}}, "train")


def test_type_error_and_int_to_float():
    with pytest.raises(ConfigError, match=r"train.steps = .many.: expected an integer, got a string"):
        from_dict(TrainConfig, {"steps": "many"}, "train")
    cfg = from_dict(TrainConfig, {"lr": 1, "betas": [0.9, 0.95]}, "train")
    assert cfg.lr == 1.0 and isinstance(cfg.lr, float) and cfg.betas == (0.9, 0.95)


def test_repo_params_load(repo_root):
    cfg = load_section(TrainConfig, "train", repo_root / "params.yaml")
    for t in cfg.tasks:
        cfg.task(t)
    for r in cfg.regimes:
        cfg.regime(r)
    with pytest.raises(ValueError, match="task 'nope' is not defined"):
        cfg.task("nope")


def test_missing_params_file(tmp_path):
    with pytest.raises(ConfigError, match="params file .* not found"):
        load_section(BaseConfig, "base", tmp_path / "params.yaml")


def test_ad_profile_loads(repo_root):
    cfg = load_section(TrainConfig, "train", [repo_root / "params.yaml", repo_root / "profiles" / "ad" / "params.yaml"])
    assert cfg.model.d_model == 512 and cfg.batch_size == 1024 and cfg.steps == 40000
    mano = cfg.task("mano")
    assert mano.modulus == 23 and mano.max_ops == 10
