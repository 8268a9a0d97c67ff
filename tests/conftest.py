"""Shared fixtures. The builders themselves live in :mod:`tests.builders` (tiny configs, models, data, stores,
tables and a tiny artifacts tree); the fixtures here are the ones several test files use."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from looptrace.config import BaseConfig
from looptrace.io.parallel import WORKERS_ENV
from tests import builders

REPO = Path(__file__).resolve().parents[1]

# The per-model stages run their models one after another in the stage's process here (a tiny project's models take
# less time than starting a pool's interpreters); tests/test_model_pool.py and the kill harness run the pool itself.
os.environ.setdefault(WORKERS_ENV, "1")


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


@pytest.fixture
def tiny_base() -> BaseConfig:
    """``base`` of a test: seed 0, one thread, CPU (:func:`tests.builders.tiny_base`)."""
    return builders.tiny_base()


@pytest.fixture(scope="module")
def tiny_artifacts(tmp_path_factory) -> Path:
    """dump (val, test) -> geometry -> readouts of one random-init model ``rs-tiny``
    (:func:`tests.builders.tiny_artifacts`), built once per test module."""
    return builders.tiny_artifacts(tmp_path_factory.mktemp("tiny") / "artifacts")


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The 1-process dump (on disk) of :func:`tests.builders.tiny_adapter_and_data` (60 sequences) with
    :func:`tests.builders.tiny_dump_config`: what the sharded, killed and repaired dumps must equal."""
    import torch

    from looptrace.capture.dump import dump_split

    torch.set_num_threads(1)
    adapter, data = builders.tiny_adapter_and_data(n_seq=60)
    path = tmp_path_factory.mktemp("ref") / "val.zarr"
    dump_split(adapter, data, path, builders.tiny_dump_config(), progress=False)
    return path
