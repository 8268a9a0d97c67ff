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


def test_params_parsed_once_per_text_and_copies_handed_out(tmp_path):
    """read_params parses each distinct file text once per process; an edited file (even of the same size, within
    the same mtime tick) is read anew, and a caller's change to the returned mapping never reaches the next one."""
    from looptrace import config

    f = tmp_path / "params.yaml"
    f.write_text("base: {seed: 1}\n")
    config._parse.cache_clear()
    a = config.read_params(f)
    assert a == {"base": {"seed": 1}} and config._parse.cache_info().misses == 1
    a["base"]["seed"] = 99
    assert config.read_params(f) == {"base": {"seed": 1}} and config._parse.cache_info().hits == 1
    f.write_text("base: {seed: 2}\n")  # same size
    assert config.read_params(f)["base"]["seed"] == 2
    f.write_text("base: {seed: 2}\nbase: {seed: 3}\n")
    with pytest.raises(ConfigError, match=r"section 'base' is given twice \(line 1 and line 2\)"):
        config.read_params(f)
