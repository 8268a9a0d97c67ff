"""MANO: prefix-notation modular arithmetic ([AD]).

An expression with k operations (drawn uniformly from min_ops..max_ops, so bins are balanced by
operation count) over operands in [0, modulus) is written in prefix notation, e.g. ``+ * 3 4 1``,
left-padded and followed by ``=``; only ``=`` is scored, its target is the value mod ``modulus``.
Difficulty = number of operations. Token type = the outermost operator.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from looptrace.tasks.base import IGNORE, Task, TaskBatch

_OPS = {"+": lambda a, b, m: (a + b) % m, "*": lambda a, b, m: (a * b) % m, "-": lambda a, b, m: (a - b) % m}


@dataclass
class ManoTask(Task):
    name: str
    modulus: int = 5
    max_ops: int = 3
    min_ops: int = 1
    ops: tuple[str, ...] = ("+", "*")
    causal: bool = True
    split_rule: str = "context"

    @property
    def vocab(self) -> list[str]:
        return [str(d) for d in range(self.modulus)] + list(self.ops) + ["<pad>", "="]

    @property
    def seq_len(self) -> int:
        return 2 * self.max_ops + 2

    @property
    def difficulty_levels(self) -> list[int]:
        return list(range(self.min_ops, self.max_ops + 1))

    @property
    def token_types(self) -> list[str]:
        return list(self.ops)

    difficulty_name = "n_ops"

    def _expr(self, k: int, rng: np.random.Generator) -> tuple[list[int], int, int]:
        """Random expression with k operations -> (prefix token ids, value, outer op index)."""
        if k == 0:
            v = int(rng.integers(0, self.modulus))
            return [v], v, -1
        oi = int(rng.integers(0, len(self.ops)))
        k_left = int(rng.integers(0, k))
        lt, lv, _ = self._expr(k_left, rng)
        rt, rv, _ = self._expr(k - 1 - k_left, rng)
        return [self.modulus + oi, *lt, *rt], _OPS[self.ops[oi]](lv, rv, self.modulus), oi

    def _all_exprs(self, k: int) -> list[list[int]]:
        """Every prefix expression (token ids) with exactly k operations."""
        if k == 0:
            return [[v] for v in range(self.modulus)]
        out = []
        for oi in range(len(self.ops)):
            for k_left in range(k):
                for lt in self._all_exprs(k_left):
                    for rt in self._all_exprs(k - 1 - k_left):
                        out.append([self.modulus + oi, *lt, *rt])
        return out

    def _n_exprs(self, k: int) -> int:
        catalan = math.comb(2 * k, k) // (k + 1)
        return catalan * len(self.ops) ** k * self.modulus ** (k + 1)

    def small_context_groups(self) -> list[np.ndarray]:
        """All padded rows of each operation count k whose number of expressions is ≤ :attr:`small_context_max`
        (the scored ``=`` sees the whole row, so a row is its context)."""
        S, pad, eq = self.seq_len, self.modulus + len(self.ops), self.modulus + len(self.ops) + 1
        out = []
        for k in range(self.min_ops, self.max_ops + 1):
            if self._n_exprs(k) > self.small_context_max:
                break
            exprs = self._all_exprs(k)
            rows = np.full((len(exprs), S), pad, dtype=np.int64)
            for i, toks in enumerate(exprs):
                rows[i, S - 1 - len(toks):S - 1] = toks
            rows[:, -1] = eq
            out.append(rows)
        return out

    def generate(self, n: int, rng: np.random.Generator) -> TaskBatch:
        S, pad, eq = self.seq_len, self.modulus + len(self.ops), self.modulus + len(self.ops) + 1
        tokens = np.full((n, S), pad, dtype=np.int64)
        targets = np.full((n, S), IGNORE, dtype=np.int64)
        diff = np.full((n, S), -1, dtype=np.int64)
        ttype = np.full((n, S), -1, dtype=np.int64)
        ks = rng.integers(self.min_ops, self.max_ops + 1, size=n)
        for i, k in enumerate(ks):
            toks, val, oi = self._expr(int(k), rng)
            tokens[i, S - 1 - len(toks):S - 1] = toks
            tokens[i, -1] = eq
            targets[i, -1], diff[i, -1], ttype[i, -1] = val, k, oi
        return TaskBatch(tokens, targets, diff, ttype)

    def evaluate(self, tokens: np.ndarray) -> int | None:
        """The value mod ``modulus`` of a row's prefix expression (the tokens between the padding and ``=``);
        None when they are not one well-formed expression."""
        pad, eq = self.modulus + len(self.ops), self.modulus + len(self.ops) + 1
        expr = [int(t) for t in np.asarray(tokens) if int(t) not in (pad, eq)]
        stack: list[int] = []
        for t in reversed(expr):  # prefix notation: right to left, an operator takes the two values after it
            if t < self.modulus:
                stack.append(t)
            elif len(stack) < 2:
                return None
            else:
                a, b = stack.pop(), stack.pop()
                stack.append(_OPS[self.ops[t - self.modulus]](a, b, self.modulus))
        return stack[0] if len(stack) == 1 else None

    def answer_flips(self, tokens: np.ndarray, position: int) -> list[tuple[int, int, int]]:
        """Each operand before ``position`` replaced by another digit, where the expression's value changes (a
        product with 0 may not)."""
        x = np.asarray(tokens, dtype=np.int64)
        y = self.evaluate(x[:position + 1])
        out = []
        for f in range(min(position, len(x))):
            if int(x[f]) >= self.modulus:
                continue  # an operator, the padding or ``=``
            for v in range(self.modulus):
                if v == int(x[f]):
                    continue
                z = x[:position + 1].copy()
                z[f] = v
                w = self.evaluate(z)
                if y is not None and w is not None and w != y:
                    out.append((f, v, w))
        return out

    def spec(self) -> dict:
        return {"kind": "mano", "modulus": self.modulus, "max_ops": self.max_ops, "min_ops": self.min_ops,
                "ops": list(self.ops), "causal": self.causal, "split_rule": self.split_rule}
