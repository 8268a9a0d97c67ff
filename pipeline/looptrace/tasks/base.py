"""Task protocol, the batch container and the disjoint-split mechanism shared by every task."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

from looptrace.config import ConfigError

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


_GOLDEN = 0x9E3779B97F4A7C15
#: Start values of the two independent hash chains of :func:`prefix_keys` (the first one is :func:`row_hash`'s).
_CHAIN_SEEDS = (_GOLDEN, 0xD1B54A32D192ED03)
_CHAIN_SALTS = (0x632BE59BD9B4E019, 0x8CB92BA72F3D8DD7)


def _mix(h: np.ndarray, col: np.ndarray, salt: int) -> np.ndarray:
    """One splitmix64 step of a chained hash: state [n] uint64, next token [n] -> new state."""
    x = h ^ (col + np.uint64(salt))
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return x


def _chain(tokens: np.ndarray, chain: int) -> np.ndarray:
    """Prefix hashes of one chain: [batch, seq] int -> [batch, seq] uint64, entry i = hash of row[:i+1]."""
    tokens = np.asarray(tokens)
    out = np.empty(tokens.shape, dtype=np.uint64)
    h = np.full(tokens.shape[0], _CHAIN_SEEDS[chain], dtype=np.uint64)
    with np.errstate(over="ignore"):
        for i, col in enumerate(tokens.T.astype(np.uint64)):
            h = _mix(h, col, _CHAIN_SALTS[chain])
            out[:, i] = h
    return out


def row_hash(tokens: np.ndarray) -> np.ndarray:
    """Content hash of each row: [batch, seq] int -> [batch] uint64 (splitmix64 chained over positions).

    Equal to the last column of :func:`prefix_hashes`: the hash of a row is the hash of its longest prefix.
    """
    tokens = np.asarray(tokens)
    if tokens.shape[1] == 0:
        return np.full(tokens.shape[0], _GOLDEN, dtype=np.uint64)
    return _chain(tokens, 0)[:, -1]


def prefix_hashes(tokens: np.ndarray) -> np.ndarray:
    """64-bit hash of every prefix: [batch, seq] -> [batch, seq] uint64, entry (b, i) = hash of tokens[b, :i+1].

    A prefix's hash depends only on the prefix (its tokens and, through the chain, its length), so equal prefixes
    of different rows get equal hashes; this is what assigns a scored position to a split (:meth:`Task.context_split`).
    """
    return _chain(tokens, 0)


#: dtype of a 128-bit context key: two independent 64-bit hashes, compared as a pair by numpy's set routines.
KEY_DTYPE = np.dtype([("h0", np.uint64), ("h1", np.uint64)])


def prefix_keys(tokens: np.ndarray) -> np.ndarray:
    """128-bit key of every prefix (two independent hash chains): [batch, seq] -> [batch, seq] of :data:`KEY_DTYPE`.

    Used to count shared prefixes (:func:`shared_prefixes`) with ``np.unique`` / ``np.isin``; with 128 bits a
    false match between two different prefixes is out of reach (~10^-38 per pair).
    """
    a = _chain(tokens, 0)
    out = np.empty(a.shape, dtype=KEY_DTYPE)
    out["h0"], out["h1"] = a, _chain(tokens, 1)
    return out


def split_of(tokens: np.ndarray) -> np.ndarray:
    """Split index (0 fit, 1 val, 2 test) of each row by its content hash: [batch, seq] -> [batch].

    The sequence-level rule. Tasks score positions by the split of each position's context
    (:meth:`Task.context_split`); for a task whose only scored position sees the whole row (parity, MANO) the
    two agree except on the small difficulty levels that :meth:`Task.small_context_groups` balances.
    """
    return (row_hash(tokens) % np.uint64(3)).astype(np.int64)


#: Split order of the rank-balanced assignment of small context groups: rank 0 -> test, 1 -> fit, 2 -> val, ...
#: Test first so that every difficulty level with at least one context is reported; fit second so the model
#: is trained on every level with two or more contexts.
BALANCED_ORDER = (2, 0, 1)


class Task(ABC):
    """A synthetic task: deterministic from seeds, with a difficulty label per scored position.

    Subclasses define the vocabulary and :meth:`generate`; :meth:`sample` adds split membership.

    Splits are disjoint at the level of what a scored token conditions on (SPEC §6): the *context* of a scored
    position is ``tokens[:pos+1]`` under causal attention (its trajectory h_0..h_T and, for every task here, its
    label are functions of that prefix and nothing else) and the whole row under bidirectional attention. Each
    context belongs to exactly one split (:meth:`context_split`), and a sequence drawn for split s is scored only
    at the positions whose context belongs to s (the others keep their tokens, as unscored input). So no scored
    context occurs in two splits, while every split sees the same input distribution. Difficulty levels with few
    distinct contexts are split by rank (:meth:`small_context_groups`), or belong to fit whole when they have at
    most :attr:`fit_only_max` contexts (too few to both learn and hold out).
    """

    name: str
    causal: bool

    #: Context groups (:meth:`small_context_groups`) of at most this many contexts are split by rank, not by hash.
    small_context_max: int = 1024

    #: Context groups of at most this many contexts belong to fit entirely (0: none): a level that small cannot be
    #: both learnt and held out, so it is training material only and val/test do not score it (defaults by kind:
    #: :data:`looptrace.tasks.FIT_ONLY_MAX`).
    fit_only_max: int = 0

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

    def answer_flips(self, tokens: np.ndarray, position: int) -> list[tuple[int, int, int]]:
        """Every one-token substitution of a row that changes the answer at ``position`` (causal tracing's
        corruption, SPEC §2b): (position f < ``position``, new token id, the new answer at ``position``).

        Only substitutions that keep the row a well-formed input of the task, at positions before the answer's.
        Default: none (the task cannot say which substitution changes its answer; it is then not traced).

        Args:
            tokens: [seq] one row's token ids.
            position: the scored position whose answer must change.
        """
        return []

    # ---------------------------------------------------------------- contexts and splits

    def small_context_groups(self) -> list[np.ndarray]:
        """Every context of each *small* difficulty level, enumerated: a list of [n_contexts, context_len] arrays.

        A level with few distinct contexts (running parity: 2 prefixes of length 1) split by a hash mod 3 would often
        leave a split without that level; such a level is split by rank instead (:func:`balanced_split_table`), so
        test has every level with ≥ 1 context, fit every level with ≥ 2, val every level with ≥ 3 — or, with at most
        :attr:`fit_only_max` contexts, goes to fit whole. Each array holds
        complete contexts (for a causal task a prefix, for a bidirectional one a whole row), at most
        :attr:`small_context_max` of them. Default: none (every context is split by its hash).
        """
        return []

    #: ``context`` (the rule above) or ``sequence``: the rule before token-level splits — a row's split by its whole
    #: content, every position of a drawn row scored. ``sequence`` shares most short prefixes between splits
    #: (77 % of running-parity test tokens with fit); kept to reproduce old results, refused by the dump.
    split_rule: str = "context"

    def context_hashes(self, tokens: np.ndarray) -> np.ndarray:
        """64-bit hash of each position's context: [batch, seq] -> [batch, seq] uint64."""
        if self.causal:
            return prefix_hashes(tokens)
        return np.repeat(row_hash(tokens)[:, None], np.asarray(tokens).shape[1], axis=1)

    def context_keys(self, tokens: np.ndarray) -> np.ndarray:
        """128-bit key of each position's context (:func:`prefix_keys`): [batch, seq] -> [batch, seq]."""
        keys = prefix_keys(tokens)
        return keys if self.causal else np.repeat(keys[:, -1:], keys.shape[1], axis=1)

    def _split_table(self) -> tuple[np.ndarray, np.ndarray]:
        cache = self.__dict__.get("_split_table_cache")
        if cache is None:
            groups = self.small_context_groups()
            fit_only = [len(g) <= self.fit_only_max for g in groups]
            if fit_only and all(fit_only) and len(groups) == len(self.difficulty_levels):
                fit_only[-1] = False  # every level is small: the last one is still split, or val/test would be empty
            cache = balanced_split_table(groups, fit_only)
            self.__dict__["_split_table_cache"] = cache
        return cache

    def context_split(self, tokens: np.ndarray) -> np.ndarray:
        """Split index (0 fit, 1 val, 2 test) of each position's context: [batch, seq] -> [batch, seq] int64.

        Contexts of a small level (:meth:`small_context_groups`) get their rank-balanced split, every other
        context ``hash mod 3``. A function of the context alone, so equal contexts always share a split.
        """
        h = self.context_hashes(tokens)
        out = (h % np.uint64(3)).astype(np.int64)
        keys, vals = self._split_table()
        if len(keys):
            i = np.minimum(np.searchsorted(keys, h), len(keys) - 1)
            hit = keys[i] == h
            out[hit] = vals[i[hit]]
        return out

    def restrict(self, batch: TaskBatch, split: str | int) -> TaskBatch:
        """The rows of ``batch`` with at least one scored position of ``split``, scored only there.

        Positions whose context belongs to another split keep their input token but get ``targets = IGNORE``
        (difficulty and token type −1).
        """
        want = SPLITS.index(split) if isinstance(split, str) else int(split)
        if self.split_rule == "sequence":
            return batch.take(np.flatnonzero(split_of(batch.tokens) == want))
        mine = (batch.targets != IGNORE) & (self.context_split(batch.tokens) == want)
        keep = np.flatnonzero(mine.any(axis=1))
        mine = mine[keep]
        return TaskBatch(batch.tokens[keep], np.where(mine, batch.targets[keep], IGNORE),
                         np.where(mine, batch.difficulty[keep], -1), np.where(mine, batch.token_type[keep], -1))

    def sample(self, split: str, n: int, rng: np.random.Generator) -> TaskBatch:
        """Draw ``n`` sequences for ``split``, scored at the positions whose context belongs to it.

        Candidates come from :meth:`generate`; a candidate without any position of ``split`` is dropped
        (:meth:`restrict`). For a task that scores one position per row this is rejection on the row's context.

        Args:
            split: ``fit``, ``val`` or ``test``.
            n: number of sequences.
            rng: numpy generator; the draw is a deterministic function of its state.
        """
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        parts, have = [], 0
        for _ in range(1000):
            cand = self.restrict(self.generate(max(64, int(3.5 * (n - have))), rng), split)
            parts.append(cand)
            have += len(cand)
            if have >= n:
                return TaskBatch.concat(parts).take(slice(0, n))
        raise ConfigError(f"task {self.name}: could not draw {n} examples of split {split}")

    def dataset(self, split: str, n: int, seed: int) -> TaskBatch:
        """A fixed data set: ``n`` sequences of ``split`` from data seed ``seed``."""
        return self.sample(split, n, np.random.default_rng([seed, SPLITS.index(split)]))


def balanced_split_table(groups: list[np.ndarray], fit_only: list[bool] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Rank-balanced split of small context groups: (sorted context hashes [n] uint64, split [n] int64).

    Within each group (all contexts of one small difficulty level) contexts are ordered by hash and the r-th
    gets split ``BALANCED_ORDER[r % 3]`` (test, fit, val, test, ...): a deterministic function of the context
    (given the task), as balanced as the group size allows. A group flagged in ``fit_only`` goes to fit whole.
    """
    keys, vals = [], []
    for gi, g in enumerate(groups):
        g = np.asarray(g)
        if g.ndim != 2 or len(g) == 0:
            continue
        h = np.unique(row_hash(g))  # distinct contexts, sorted by hash
        keys.append(h)
        if fit_only is not None and fit_only[gi]:
            vals.append(np.zeros(len(h), dtype=np.int64))
        else:
            vals.append(np.asarray(BALANCED_ORDER, dtype=np.int64)[np.arange(len(h)) % 3])
    if not keys:
        return np.zeros(0, dtype=np.uint64), np.zeros(0, dtype=np.int64)
    k, v = np.concatenate(keys), np.concatenate(vals)
    order = np.argsort(k, kind="stable")
    return k[order], v[order]


def scored_keys(task: Task, batch: TaskBatch) -> np.ndarray:
    """Context key (:meth:`Task.context_keys`) of every scored position, in (row, position) order: [n_scored]."""
    return task.context_keys(batch.tokens)[batch.targets != IGNORE]


def shared_prefixes(keys: dict[str, np.ndarray]) -> dict:
    """Scored tokens of each split whose exact context is also a scored context of another split.

    Args:
        keys: split -> context keys of its scored tokens (:func:`scored_keys`; any hashable-by-value 1-D array).

    Returns:
        ``{"n_scored": {split: n}, "shared_with": {split: {other: n}}, "shared_any": {split: n}}`` where
        ``shared_with[a][b]`` counts tokens of ``a`` (not distinct contexts) whose context is scored in ``b`` and
        ``shared_any[a]`` those whose context is scored in any other split. All zero for disjoint splits.
    """
    uniq = {s: np.unique(k) for s, k in keys.items()}
    out: dict = {"n_scored": {s: int(len(k)) for s, k in keys.items()}, "shared_with": {}, "shared_any": {}}
    for a, ka in keys.items():
        out["shared_with"][a] = {}
        anyhit = np.zeros(len(ka), dtype=bool)
        for b in keys:
            if b == a:
                continue
            hit = np.isin(ka, uniq[b])
            out["shared_with"][a][b] = int(hit.sum())
            anyhit |= hit
        out["shared_any"][a] = int(anyhit.sum())
    return out


def split_overlap(task: Task, batches: dict[str, TaskBatch]) -> dict:
    """:func:`shared_prefixes` of a task's data sets (split -> :class:`TaskBatch`), contexts as the task defines them."""
    return shared_prefixes({s: scored_keys(task, b) for s, b in batches.items()})


def difficulty_counts(batch: TaskBatch) -> dict[int, int]:
    """Scored tokens per difficulty level of a batch."""
    d = batch.difficulty[batch.targets != IGNORE]
    lv, n = np.unique(d, return_counts=True)
    return {int(a): int(b) for a, b in zip(lv, n, strict=True)}
