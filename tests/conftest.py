"""Shared fixtures: the repo root and tiny configurations that train in seconds."""

from __future__ import annotations

from pathlib import Path

import pytest
from looptrace.config import BaseConfig
from looptrace.models.looped import GroupConfig
from looptrace.models.regimes import RegimeConfig
from looptrace.models.train import ModelParams, TrainConfig
from looptrace.tasks import TaskConfig

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


def tiny_train_config(steps: int = 30, loops: int = 4, **over) -> TrainConfig:
    """A train config that runs in about a second: d_model 16, 4 loops, 8-bit running parity."""
    kw = dict(
        tasks=("rp",), regimes=("uniform",),
        task_defs={"rp": TaskConfig(kind="running_parity", length=8),
                   "rs": TaskConfig(kind="running_sum", length=6, modulus=3),
                   "mano": TaskConfig(kind="mano", modulus=3, max_ops=2)},
        regime_defs={"uniform": RegimeConfig(kind="uniform"), "geometric": RegimeConfig(kind="geometric", lam=0.3),
                     "joint": RegimeConfig(kind="joint", gate="linear", beta=0.1),
                     "final": RegimeConfig(kind="final")},
        model=ModelParams(d_model=16, n_head=2, groups=(GroupConfig(1, loops),), gate_hidden=8),
        steps=steps, batch_size=16, warmup=5, val_sequences=64, checkpoint_fractions=(0.5,),
    )
    kw.update(over)
    return TrainConfig(**kw)


@pytest.fixture
def tiny_base() -> BaseConfig:
    return BaseConfig(seed=0, threads=1, device="cpu")
