"""Task protocol, the batch container and the disjoint-split mechanism shared by every task."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

IGNORE = -100  # target id of positions that are not scored (torch cross_entropy's ignore_index)

SPLITS = ("fit", "val", "test")


@dataclass
class TaskBatch:
    """A batch of sequences with per-position scoring metadata (numpy, int64).

    Attributes:
        tokens: [batch, seq] input token ids.
        targets: [batch, seq] target id per position, ``IGNORE`` where the position is not scored.
        difficulty: [batch, seq] task-defined difficulty of each scored position (-1 elsewhere).
        token_type: [batch, seq] task-defined token type id of each scored position (-1 elsewhere).
    """

    tokens: np.ndarray
    targets: np.ndarray
    difficulty: np.ndarray
    token_type: np.ndarray

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def take(self, idx: np.ndarray | slice) -> TaskBatch:
        return TaskBatch(self.tokens[idx], self.targets[idx], self.difficulty[idx], self.token_type[idx])

    @staticmethod
    def concat(parts: list[TaskBatch]) -> TaskBatch:
        return TaskBatch(*(np.concatenate([getattr(p, f) for p in parts]) for f in
                           ("tokens", "targets", "difficulty", "token_type")))


def row_hash(tokens: np.ndarray) -> np.ndarray:
    """Content hash of each row: [batch, seq] int -> [batch] uint64 (splitmix64 chained over positions).

    Used to assign every distinct sequence to exactly one split, so fit / val / test are disjoint
    by content, not only by seed.
    """
    h = np.full(tokens.shape[0], 0x9E3779B97F4A7C15, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for col in tokens.T.astype(np.uint64):
            x = h ^ (col + np.uint64(0x632BE59BD9B4E019))
            x ^= x >> np.uint64(30)
            x *= np.uint64(0xBF58476D1CE4E5B9)
            x ^= x >> np.uint64(27)
            x *= np.uint64(0x94D049BB133111EB)
            x ^= x >> np.uint64(31)
            h = x
    return h


def split_of(tokens: np.ndarray) -> np.ndarray:
    """Split index (0 fit, 1 val, 2 test) of each row: [batch, seq] -> [batch]."""
    return (row_hash(tokens) % np.uint64(3)).astype(np.int64)


class Task(ABC):
    """A synthetic task: deterministic from seeds, with a difficulty label per scored position.

    Subclasses define the vocabulary and :meth:`generate`; :meth:`sample` adds split membership.
    """

    name: str
    causal: bool

    @property
    @abstractmethod
    def vocab(self) -> list[str]:
        """Token strings; the index is the token id (inputs and targets share one vocabulary)."""

    @property
    @abstractmethod
    def seq_len(self) -> int:
        """Sequence length of every example."""

    @property
    @abstractmethod
    def difficulty_levels(self) -> list[int]:
        """All difficulty values the task can produce, in increasing order."""

    @property
    @abstractmethod
    def token_types(self) -> list[str]:
        """Names of the token-type ids."""

    difficulty_name: str = "difficulty"

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    @abstractmethod
    def generate(self, n: int, rng: np.random.Generator) -> TaskBatch:
        """Draw ``n`` examples (ignoring splits)."""

    @abstractmethod
    def spec(self) -> dict:
        """The task's config as a plain dict (``make_task(spec)`` rebuilds it)."""

    def sample(self, split: str, n: int, rng: np.random.Generator) -> TaskBatch:
        """Draw ``n`` examples that belong to ``split`` (rejection on the content hash).

        Args:
            split: ``fit``, ``val`` or ``test``.
            n: number of sequences.
            rng: numpy generator; the draw is a deterministic function of its state.
        """
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        want = SPLITS.index(split)
        parts, have = [], 0
        for _ in range(1000):
            cand = self.generate(max(64, int(3.5 * (n - have))), rng)
            keep = np.flatnonzero(split_of(cand.tokens) == want)
            parts.append(cand.take(keep))
            have += len(keep)
            if have >= n:
                return TaskBatch.concat(parts).take(slice(0, n))
        raise RuntimeError(f"task {self.name}: could not draw {n} examples of split {split}")

    def dataset(self, split: str, n: int, seed: int) -> TaskBatch:
        """A fixed data set: ``n`` sequences of ``split`` from data seed ``seed``."""
        return self.sample(split, n, np.random.default_rng([seed, SPLITS.index(split)]))
