"""Whole-string parity: bits of length n (1..max_length, balanced by length), answer at the end.

Sequence layout (fixed length max_length + 1): left padding, the n bits, then ``=``; only the ``=``
position is scored, its target is the parity of the bits. Difficulty = n. Bidirectional attention
by default ([AD]'s setup); note it is solved at loop 1 on CPU budgets (no depth effect).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from looptrace.tasks.base import IGNORE, Task, TaskBatch


@dataclass
class ParityTask(Task):
    name: str
    max_length: int = 16
    min_length: int = 1
    causal: bool = False
    split_rule: str = "context"

    PAD, EQ = 2, 3

    @property
    def vocab(self) -> list[str]:
        return ["0", "1", "<pad>", "="]

    @property
    def seq_len(self) -> int:
        return self.max_length + 1

    @property
    def difficulty_levels(self) -> list[int]:
        return list(range(self.min_length, self.max_length + 1))

    @property
    def token_types(self) -> list[str]:
        return ["answer"]

    difficulty_name = "bit_length"

    def generate(self, n: int, rng: np.random.Generator) -> TaskBatch:
        S = self.seq_len
        lengths = rng.integers(self.min_length, self.max_length + 1, size=n)  # balanced by length
        bits = rng.integers(0, 2, size=(n, self.max_length))
        pos = np.arange(self.max_length)
        valid = pos[None, :] >= (self.max_length - lengths)[:, None]  # right-aligned bits
        tokens = np.full((n, S), self.PAD, dtype=np.int64)
        tokens[:, :-1] = np.where(valid, bits, self.PAD)
        tokens[:, -1] = self.EQ
        targets = np.full((n, S), IGNORE, dtype=np.int64)
        targets[:, -1] = (bits * valid).sum(1) % 2
        diff = np.full((n, S), -1, dtype=np.int64)
        diff[:, -1] = lengths
        ttype = np.full((n, S), -1, dtype=np.int64)
        ttype[:, -1] = 0
        return TaskBatch(tokens, targets, diff, ttype)

    def small_context_groups(self) -> list[np.ndarray]:
        """All 2^n rows of each bit length n with 2^n ≤ :attr:`small_context_max` (a row is the whole context:
        bidirectional attention, one scored position)."""
        out = []
        for n in range(self.min_length, self.max_length + 1):
            if 2 ** n > self.small_context_max:
                break
            bits = np.stack(np.unravel_index(np.arange(2 ** n), (2,) * n), axis=1) if n else np.zeros((1, 0), int)
            rows = np.full((len(bits), self.seq_len), self.PAD, dtype=np.int64)
            rows[:, self.max_length - n:self.max_length] = bits
            rows[:, -1] = self.EQ
            out.append(rows)
        return out

    def answer_flips(self, tokens: np.ndarray, position: int) -> list[tuple[int, int, int]]:
        """Each bit before ``position`` flipped (0 ↔ 1; padding and ``=`` stay): the parity flips with it."""
        x = np.asarray(tokens, dtype=np.int64)
        bits = (x[:position] == 0) | (x[:position] == 1)
        y = int(x[:position][bits].sum() % 2)
        return [(int(f), 1 - int(x[f]), 1 - y) for f in np.flatnonzero(bits)]

    def spec(self) -> dict:
        return {"kind": "parity", "max_length": self.max_length, "min_length": self.min_length,
                "causal": self.causal, "split_rule": self.split_rule}
