"""Synthetic tasks: hand-checked labels, determinism, disjoint splits, balance."""

import numpy as np
import pytest
from looptrace.tasks import IGNORE, TaskConfig, make_task, split_of


def _eval_prefix(tokens, task):
    """Independent recursive evaluator of MANO prefix expressions (token ids -> value)."""
    m, ops = task.modulus, task.ops
    it = iter(tokens)

    def ev():
        t = next(it)
        if t < m:
            return t
        op = ops[t - m]
        a, b = ev(), ev()
        return {"+": a + b, "*": a * b, "-": a - b}[op] % m

    return ev()


def test_running_parity_hand_case():
    task = make_task("rp", TaskConfig(kind="running_parity", length=5))
    b = task.dataset("fit", 50, seed=1)
    x = b.tokens[0]
    expect = [int(sum(x[: i + 1]) % 2) for i in range(5)]
    assert b.targets[0].tolist() == expect
    assert b.difficulty[0].tolist() == [1, 2, 3, 4, 5]
    # token type 'change' (1) exactly where the running answer flips
    prev = [0] + expect[:-1]
    assert b.token_type[0].tolist() == [int(a != p) for a, p in zip(expect, prev, strict=True)]


def test_running_sum_hand_case():
    task = make_task("rs", TaskConfig(kind="running_sum", length=6, modulus=5))
    b = task.dataset("val", 10, seed=3)
    for row, tgt in zip(b.tokens, b.targets, strict=True):
        assert tgt.tolist() == [int(sum(row[: i + 1]) % 5) for i in range(6)]


def test_mano_values_and_balance():
    task = make_task("mano", TaskConfig(kind="mano", modulus=7, max_ops=4, ops=("+", "*", "-")))
    b = task.dataset("test", 2000, seed=5)
    pad, eq = 7 + 3, 7 + 4
    for i in range(200):
        toks = [t for t in b.tokens[i] if t not in (pad, eq)]
        assert b.tokens[i, -1] == eq
        assert b.targets[i, -1] == _eval_prefix(toks, task)
        n_ops = sum(t >= 7 for t in toks)
        assert b.difficulty[i, -1] == n_ops and len(toks) == 2 * n_ops + 1
    assert (b.targets[:, :-1] == IGNORE).all()
    counts = np.bincount(b.difficulty[:, -1], minlength=5)[1:]
    assert counts.min() > 0.8 * counts.mean()  # balanced over difficulty


def test_parity_labels():
    task = make_task("p", TaskConfig(kind="parity", max_length=10))
    b = task.dataset("fit", 300, seed=0)
    for i in range(300):
        bits = [t for t in b.tokens[i, :-1] if t in (0, 1)]
        assert len(bits) == b.difficulty[i, -1]
        assert b.targets[i, -1] == sum(bits) % 2
    assert task.causal is False


@pytest.mark.parametrize("kind", ["running_parity", "mano"])
def test_determinism_and_disjoint_splits(kind):
    task = make_task("t", TaskConfig(kind=kind, length=10, modulus=5, max_ops=3))
    a = task.dataset("fit", 400, seed=42)
    b = task.dataset("fit", 400, seed=42)
    assert np.array_equal(a.tokens, b.tokens) and np.array_equal(a.targets, b.targets)
    splits = {s: task.dataset(s, 400, seed=s_seed) for s, s_seed in (("fit", 42), ("val", 43), ("test", 44))}
    rows = {s: {r.tobytes() for r in d.tokens} for s, d in splits.items()}
    assert not rows["fit"] & rows["val"] and not rows["fit"] & rows["test"] and not rows["val"] & rows["test"]
    for i, s in enumerate(("fit", "val", "test")):
        assert (split_of(splits[s].tokens) == i).all()


def test_unknown_kind():
    with pytest.raises(ValueError, match="kind must be one of"):
        make_task("x", TaskConfig(kind="sorting"))
