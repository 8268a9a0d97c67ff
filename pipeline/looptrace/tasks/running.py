"""Running tasks, scored at every position under causal attention: per-token trajectories like an LM's.

- running parity: bits x_1..x_L, target at position i is x_1 xor ... xor x_i.
- running sum mod m: digits in [0, m), target at position i is (x_1 + ... + x_i) mod m.

Difficulty = prefix length i (1..L): the number of inputs the answer depends on.

The label and (causal attention, learned positions) the trajectory of position i are functions of the prefix
x_1..x_i alone, so the prefix is the context that assigns the position to a split (:meth:`Task.context_split`);
the prefixes of a short length are enumerated: lengths with at most ``fit_only_max`` prefixes (defaults by kind,
:data:`looptrace.tasks.FIT_ONLY_MAX`: running parity 1–6, ≤ 64 prefixes; running sum mod 5 1–4, ≤ 1024) belong to
fit whole — a level that small cannot be both learnt and
held out, and with such levels split three ways the default models learnt nothing that generalised (val accuracy
at chance, below on test: a model that memorises its fit prefixes answers an unseen short prefix with a seen
one's label) — so val and test have no such levels; longer enumerable lengths (≤ 1024 prefixes) are split by
rank so each split gets its share, longer ones by hash. Training sequences keep every token as input; only the
positions whose prefix is fit's are scored.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from looptrace.tasks.base import Task, TaskBatch


@dataclass
class RunningTask(Task):
    """Running parity (``modulus`` = 2) or running sum mod ``modulus`` over ``length`` inputs."""

    name: str
    length: int = 12
    modulus: int = 2
    causal: bool = True
    fit_only_max: int = 64  # make_task uses looptrace.tasks.FIT_ONLY_MAX by kind
    split_rule: str = "context"

    @property
    def vocab(self) -> list[str]:
        return [str(d) for d in range(self.modulus)]

    @property
    def seq_len(self) -> int:
        return self.length

    @property
    def difficulty_levels(self) -> list[int]:
        return list(range(1, self.length + 1))

    @property
    def token_types(self) -> list[str]:
        return ["keep", "change"]

    difficulty_name = "prefix_length"

    def generate(self, n: int, rng: np.random.Generator) -> TaskBatch:
        x = rng.integers(0, self.modulus, size=(n, self.length))  # [n, L]
        y = np.cumsum(x, axis=1) % self.modulus  # [n, L]
        prev = np.concatenate([np.zeros((n, 1), dtype=y.dtype), y[:, :-1]], axis=1)
        ttype = (y != prev).astype(np.int64)
        diff = np.broadcast_to(np.arange(1, self.length + 1), (n, self.length)).copy()
        return TaskBatch(x.astype(np.int64), y.astype(np.int64), diff.astype(np.int64), ttype)

    def small_context_groups(self) -> list[np.ndarray]:
        """All modulus^i prefixes of each length i with modulus^i ≤ :attr:`small_context_max`."""
        out, i = [], 1
        while i <= self.length and self.modulus ** i <= self.small_context_max:
            n = self.modulus ** i
            out.append(np.stack(np.unravel_index(np.arange(n), (self.modulus,) * i), axis=1).astype(np.int64))
            i += 1
        return out

    def answer_flips(self, tokens: np.ndarray, position: int) -> list[tuple[int, int, int]]:
        """Any other digit at any position f < ``position``: the running sum at ``position`` moves by v − x_f ≠ 0
        (mod m), so every such substitution changes the answer."""
        x = np.asarray(tokens, dtype=np.int64)
        y = int(x[:position + 1].sum() % self.modulus)
        return [(f, v, (y + v - int(x[f])) % self.modulus) for f in range(min(position, len(x)))
                for v in range(self.modulus) if v != int(x[f])]

    def spec(self) -> dict:
        kind = "running_parity" if self.modulus == 2 else "running_sum"
        return {"kind": kind, "length": self.length, "modulus": self.modulus, "causal": self.causal,
                "fit_only_max": self.fit_only_max, "split_rule": self.split_rule}


