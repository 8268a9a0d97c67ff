"""Tiny model and data shared by tests/test_dump.py and its SIGKILL child process (light imports only)."""

from __future__ import annotations

import numpy as np
import torch
from looptrace.capture.dump import DumpConfig
from looptrace.models.interface import LoopedTransformerAdapter
from looptrace.models.looped import GroupConfig, LoopedTransformer, ModelConfig
from looptrace.tasks import IGNORE, TaskBatch, make_task

KILL_CFG = DumpConfig(batch_size=7, chunk_tokens=16, writer_queue=2)


def model_and_data(n_seq: int = 30, gate: str = "linear", loops: int = 3, d_model: int = 16,
                   unscored: bool = True):
    """A tiny random-init model on running sum mod 5 (vocab 5) and data; with ``unscored``, row 2 is
    entirely unscored and every 3rd row is scored only at even positions."""
    torch.manual_seed(0)
    task = make_task("rs", {"kind": "running_sum", "length": 8, "modulus": 5})
    cfg = ModelConfig(vocab_size=task.vocab_size, block_size=task.seq_len, d_model=d_model, n_head=2,
                      groups=(GroupConfig(1, loops),), gate=gate)
    adapter = LoopedTransformerAdapter(LoopedTransformer(cfg), "rs-test", checkpoint_hash="abc",
                                       extra={"task": task.spec(), "regime": {"name": "uniform"}})
    data = task.generate(n_seq, np.random.default_rng(7))  # every position scored (no split: the dump's tests)
    if not unscored:
        return adapter, data
    targets = data.targets.copy()
    targets[2] = IGNORE
    targets[::3, 1::2] = IGNORE
    data = TaskBatch(data.tokens, targets, np.where(targets == IGNORE, -1, data.difficulty),
                     np.where(targets == IGNORE, -1, data.token_type))
    return adapter, data
