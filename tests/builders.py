"""Tiny builders the tests share: configs, models, data, stores, tables and a whole small artifacts tree, each in
seconds on one CPU thread.

They live under ``tests/`` (``tests.builders``), not in the package: the wheel ships no test code, and no library
module or stage can import them. ``tests/conftest.py`` exposes the common ones as fixtures; child processes
(tests/dump_child.py, tests/kill_child.py) put the repository on ``sys.path`` to import them. torch is imported
only inside the builders that need it, so a test of an offline stage that builds a store from arrays stays
torch-free.

Groups:

- configs: :func:`tiny_base`, :func:`tiny_train_config`, :func:`tiny_dump_config`;
- models and data: :func:`tiny_task`, :func:`tiny_model`, :func:`tiny_adapter_and_data`,
  :func:`tiny_checkpoint`;
- stores from arrays: :func:`random_store_arrays` (every array of SPEC §1, random), :func:`random_signal_arrays`
  (states plus [0, 1) statistics, NaN where t − 1 is needed), :func:`two_group_arrays` (a problem whose optimal
  exit is obvious), :func:`write_arrays`, :func:`two_group_stores`;
- tables: :func:`token_loop_splits`, :func:`write_token_loop` (``token_loop.parquet`` as the geometry stage
  writes it);
- a pipeline's outputs: :func:`tiny_artifacts` (dump -> geometry -> readouts of one random-init model).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from looptrace.signals.names import LOGIT_STATS, SIGNALS, add_aliases

#: The data seeds of every tiny checkpoint (the train stage's defaults).
DATA_SEEDS = {"fit": 42, "val": 43, "test": 44}


# ---------------------------------------------------------------------------------------------- configs

def tiny_base():
    """``base`` section of a test: seed 0, one thread, CPU."""
    from looptrace.config import BaseConfig

    return BaseConfig(seed=0, threads=1, device="cpu")


def tiny_train_config(steps: int = 30, loops: int = 4, **over):
    """A train config that runs in about a second: d_model 16, ``loops`` loops, 8-bit running parity (``rp``).

    Task defs ``rp``, ``rs`` (running sum mod 3, length 6), ``mano`` (mod 3, ≤ 2 ops); regimes ``uniform``,
    ``geometric`` (λ 0.3), ``joint`` (linear gate, β 0.1), ``final``. ``over`` replaces any TrainConfig field.
    """
    from looptrace.models.looped import GroupConfig
    from looptrace.models.regimes import RegimeConfig
    from looptrace.models.train import ModelParams, TrainConfig
    from looptrace.tasks import TaskConfig

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


def tiny_dump_config(**over):
    """A dump config with small batches and chunks (7 sequences, 16 rows), so a tiny split spans many chunks."""
    from looptrace.capture.dump import DumpConfig

    return DumpConfig(**{"batch_size": 7, "chunk_tokens": 16, "writer_queue": 2, **over})


# ---------------------------------------------------------------------------------------------- models and data

def tiny_task(kind: str = "running_sum", name: str = "rs", **spec):
    """A synthetic task; default running sum mod 5 over 8 digits (vocab 5)."""
    from looptrace.tasks import make_task

    defaults = {"running_sum": {"length": 8, "modulus": 5}, "running_parity": {"length": 8}}.get(kind, {})
    return make_task(name, {"kind": kind, **defaults, **spec})


def tiny_model(vocab: int = 5, seq: int = 8, loops: int = 4, d_model: int = 16, gate: str = "none",
               causal: bool = True, groups: Sequence | None = None, n_coda: int = 0, seed: int = 0):
    """A random-init :class:`~looptrace.models.looped.LoopedTransformer` in eval mode (``torch.manual_seed(seed)``
    right before it is built, so the same arguments give the same weights)."""
    import torch

    from looptrace.models.looped import GroupConfig, LoopedTransformer, ModelConfig

    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=vocab, block_size=seq, d_model=d_model, n_head=2, causal=causal, gate=gate,
                      groups=tuple(groups) if groups else (GroupConfig(1, loops),), n_coda=n_coda)
    return LoopedTransformer(cfg).eval()


def tiny_adapter_and_data(n_seq: int = 30, gate: str = "linear", loops: int = 3, d_model: int = 16,
                          unscored: bool = True):
    """A tiny random-init model on running sum mod 5 (vocab 5) behind the dump's model interface, and its val data.

    With ``unscored``, row 2 is entirely unscored and every 3rd row is scored only at even positions (the dump's
    row selection is then exercised).

    Returns:
        (LoopedTransformerAdapter named ``rs-test``, TaskBatch of ``n_seq`` sequences, data seed 7).
    """
    import torch

    from looptrace.models.interface import LoopedTransformerAdapter
    from looptrace.models.looped import GroupConfig, LoopedTransformer, ModelConfig
    from looptrace.tasks import IGNORE, TaskBatch

    torch.manual_seed(0)
    task = tiny_task()
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


def tiny_checkpoint(train_root: Path | str, name: str = "rs-joint", task=None, model=None) -> Path:
    """``<train_root>/<name>/model.pt`` as the train stage writes it (task spec and data seeds recorded), for a
    random-init model (default: running sum mod 5, 4 loops, linear gate, seed 0).

    Returns:
        The checkpoint path.
    """
    from looptrace.models.looped import save_checkpoint

    task = task or tiny_task()
    model = model or tiny_model(vocab=task.vocab_size, seq=task.seq_len, loops=4, gate="linear")
    ckpt = Path(train_root) / name / "model.pt"
    save_checkpoint(ckpt, model, name=name, task={"name": task.name, **task.spec()}, data_seeds=dict(DATA_SEEDS))
    return ckpt


# ---------------------------------------------------------------------------------------------- stores

def random_store_arrays(n: int = 37, T: int = 3, D: int = 4, V: int = 5, seed: int = 0, gate: bool = False,
                        topk: int | None = None) -> dict[str, np.ndarray]:
    """Every array of a store (SPEC §1) with random values of the right dtypes: full logits, or top-k with
    ``topk``; the statistics are random (not derived from the logits), ``kl_prev`` NaN at t = 1."""
    from looptrace.io.store.schema import STAT_NAMES, TOKEN_FIELDS

    rng = np.random.default_rng(seed)
    a = {"hidden": rng.normal(size=(n, T, D)).astype(np.float32),
         "hidden_init": rng.normal(size=(n, D)).astype(np.float32)}
    if topk:
        a["topk_ids"] = rng.integers(0, V, (n, T, topk)).astype(np.int32)
        a["topk_logits"] = rng.normal(size=(n, T, topk)).astype(np.float32)
    else:
        a["logits"] = rng.normal(size=(n, T, V)).astype(np.float32)
    for s in STAT_NAMES:
        a[s] = rng.integers(0, V, (n, T)).astype(np.int32) if s == "argmax" else \
            rng.normal(size=(n, T)).astype(np.float32)
    a["kl_prev"][:, 0] = np.nan
    for f in TOKEN_FIELDS:
        a[f] = rng.integers(0, V, n).astype(np.int64)
    a["loop_group"] = np.array([0, 0, 1][:T], dtype=np.int32)
    if gate:
        a["gate_logit"] = rng.normal(size=(n, T)).astype(np.float32)
    return a


#: The logit statistics :func:`random_signal_arrays` fills (``argmax`` separately).
SIGNAL_STATS = LOGIT_STATS


def random_signal_arrays(rng: np.random.Generator, N: int = 40, T: int = 5, D: int = 6, V: int = 4,
                         loop_group: Sequence[int] = (0, 0, 0, 1, 1), gate: bool = True,
                         hidden: np.ndarray | None = None, h0: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Store arrays with random states (or the given ``hidden`` [N, T, D] / ``h0`` [N, D]) and statistics in
    [0, 1) (NaN at t = 1 where t − 1 is needed); argmax equals the target with probability 0.6; difficulty
    1..4, two token types; no logits (geometry and gates read neither)."""
    a = {"hidden": rng.normal(size=(N, T, D)).astype(np.float32) if hidden is None else hidden,
         "hidden_init": rng.normal(size=(N, D)).astype(np.float32) if h0 is None else h0}
    for s in SIGNAL_STATS:
        x = rng.random((N, T)).astype(np.float32)
        x[:, :SIGNALS[s].first_loop - 1] = np.nan
        a[s] = x
    a["target"] = rng.integers(0, V, N)
    a["argmax"] = np.where(rng.random((N, T)) < 0.6, a["target"][:, None], rng.integers(0, V, (N, T)))
    a["token_id"] = rng.integers(0, V, N)
    a["sequence"], a["position"] = np.arange(N) // 4, np.arange(N) % 4
    a["difficulty"], a["token_type"] = np.arange(N) % 4 + 1, rng.integers(0, 2, N)
    a["loop_group"] = np.asarray(loop_group)
    if gate:
        a["gate_logit"] = rng.normal(size=(N, T)).astype(np.float32)
    return a


def write_arrays(path, arrays: Mapping[str, np.ndarray], chunk_tokens: int = 16, attrs: Mapping | None = None,
                 hidden_dtype: str = "float32"):
    """:func:`looptrace.io.store.writer.write_store` of ``arrays`` (float32 states by default: exact round trip).

    ``attrs`` default: two token types (``keep``, ``change``) and vocab 4, as :func:`random_signal_arrays` makes.
    """
    from looptrace.io.store.writer import write_store

    attrs = {"token_types": ["keep", "change"], "vocab_size": 4} if attrs is None else attrs
    return write_store(path, dict(arrays), dict(attrs), chunk_tokens=chunk_tokens, hidden_dtype=hidden_dtype)


def two_group_arrays(n: int, T: int = 4, D: int = 8, seed: int = 0, shift: float = 0.0) -> dict:
    """Arrays of a store whose optimal exit is obvious: easy tokens exit at loop 1, hard ones at T.

    The state carries the group (h_t = ±2·u + 0.1·t + noise, separable); easy tokens have the same
    logit margin for the target at every loop (constant loss: no later loop improves it), hard tokens
    favour the wrong class until loop T, less and less. Easy tokens are all alike (no noise, one margin), so their
    P(stop) at a loop is one value and the val quantile grid holds it: the obvious operating point is
    then on the grid exactly. ``shift`` moves the state distribution (to tell which split a PCA was
    fit on). The statistics are computed from the logits by :func:`looptrace.signals.logits.logit_stats`.
    """
    from looptrace.signals.logits import logit_stats

    rng = np.random.default_rng(seed)
    easy = rng.random(n) < 0.5
    target = rng.integers(0, 2, n)
    loops = np.arange(1, T + 1)
    mag = np.where(easy, 3.0, rng.uniform(2.0, 4.0, n))
    # hard: the target logit climbs from −mag to +mag, convexly (still < 0 before T), so every loop
    # lowers the loss (by > 0.2 nats: the utility and oracle labels say "continue" at every t < T)
    climb = -1.0 + 2.0 * ((loops - 1) / (T - 1)) ** 3  # [T]
    sign = np.where(easy[:, None], 1.0, climb[None, :])  # [n, T]
    logits = np.zeros((n, T, 2), np.float32)
    logits[np.arange(n), :, target] = (sign * mag[:, None]).astype(np.float32)
    u = np.zeros(D)
    u[0] = 1.0
    hidden = ((2 * easy - 1)[:, None, None] * 2.0 * u + shift
              + 0.3 * rng.normal(size=(n, T, D)) * ~easy[:, None, None] + 0.1 * loops[None, :, None]
              ).astype(np.float32)
    h0 = (0.3 * rng.normal(size=(n, D)) * ~easy[:, None]).astype(np.float32)
    arrays = {"hidden": hidden, "hidden_init": h0,
              **logit_stats(logits, target), "target": target, "token_id": rng.integers(0, 2, n),
              "sequence": np.arange(n) // 4, "position": np.arange(n) % 4, "difficulty": (~easy).astype(np.int64),
              "token_type": np.zeros(n, np.int64)}
    return arrays


def two_group_stores(root, name: str = "rp-uniform", n=(240, 160, 160), T: int = 4, D: int = 8, seed: int = 0,
                     shift=(0.0, 0.0, 0.0)) -> dict:
    """``<root>/<name>/{fit,val,test}.zarr`` of :func:`two_group_arrays` (split i: seed ``seed·10 + i``)."""
    from looptrace.io.store.writer import write_store
    from looptrace.tasks import SPLITS

    out = {}
    for i, split in enumerate(SPLITS):
        out[split] = write_store(Path(root) / name / f"{split}.zarr",
                                 two_group_arrays(n[i], T, D, seed=seed * 10 + i, shift=shift[i]),
                                 {"split": split, "vocab_size": 2}, chunk_tokens=64, hidden_dtype="float32")
    return out


# ---------------------------------------------------------------------------------------------- tables

def token_loop_splits(n: int = 400, T: int = 4, seed: int = 0, gate: bool = False) -> dict[str, dict]:
    """Per-split [token, loop] columns of a toy model whose confidence grows with depth.

    Correctness at loop t is 1[t ≥ need] for a per-token "need" depth (some never correct); entropy
    falls when the token becomes correct, so confidence readouts can exit early.
    """
    rng = np.random.default_rng(seed)
    out = {}
    for si, split in enumerate(("fit", "val", "test")):
        difficulty = rng.integers(0, 3, n)
        need = np.clip(difficulty + 1 + rng.integers(0, 2, n), 1, T + 1)  # T + 1 = never correct
        loops = np.arange(1, T + 1)
        correct = loops[None, :] >= need[:, None]
        noise = rng.random((n, T))
        entropy = np.where(correct, 0.1 + 0.2 * noise, 1.0 + noise)
        max_prob = 1.0 - entropy / 3.0
        hidden = rng.normal(size=(n, T)).cumsum(1)
        cols = {
            "difficulty": np.repeat(difficulty[:, None], T, 1), "token_type": np.zeros((n, T), np.int64),
            "target": np.ones((n, T), np.int64), "sequence": np.repeat(np.arange(n)[:, None] // 4, T, 1),
            "position": np.repeat(np.arange(n)[:, None] % 4, T, 1), "loop": np.repeat(loops[None], n, 0),
            "loop_group": np.zeros((n, T), np.int64), "argmax": np.where(correct, 1, 0),
            "correct": correct, "entropy": entropy, "max_prob": max_prob, "margin": 5.0 * max_prob,
            "target_logprob": np.log(np.where(correct, max_prob, (1 - max_prob) / 2)),
            "kl_prev": np.abs(np.diff(entropy, prepend=np.nan, axis=1)),
            "kl_prev_rev": np.abs(np.diff(entropy, prepend=np.nan, axis=1)) * 1.1,
            "kl_final": np.abs(entropy - entropy[:, -1:]),
            "logit_change": np.abs(np.diff(max_prob, prepend=np.nan, axis=1)),
            "step_norm": np.abs(np.diff(hidden, prepend=0.0, axis=1)), "rel_step": noise,
            "step_cos": np.where(loops[None] == 1, np.nan, noise), "state_cos_dist": noise / 10,
            "accel": np.where(loops[None] == 1, np.nan, noise * entropy),
            "accel_norm": np.where(loops[None] == 1, np.nan, noise),
            "step_d2": np.where(loops[None] <= 2, np.nan, noise),
        }
        add_aliases(cols)
        cols["gate_logit"] = (rng.normal(size=(n, T)) + 3 * correct - 1.5) if gate else None
        cols["token"] = np.repeat((np.arange(n) + 1000 * si)[:, None], T, 1)
        out[split] = cols
    return out


def write_token_loop(path: Path, splits: Mapping[str, Mapping[str, Any]], shuffle_seed: int | None = 1) -> Path:
    """Write ``token_loop.parquet`` with exactly the geometry stage's columns (row order shuffled)."""
    from looptrace.geometry.stage import TOKEN_LOOP_COLUMNS

    frames = []
    for split, cols in splits.items():
        n, T = cols["correct"].shape
        data = {}
        for c in TOKEN_LOOP_COLUMNS:
            if c == "split":
                data[c] = [split] * (n * T)
            elif cols.get(c) is None:
                data[c] = pl.Series(c, [None] * (n * T), dtype=pl.Float32)
            else:
                data[c] = np.asarray(cols[c]).reshape(-1)
        frames.append(pl.DataFrame(data))
    df = pl.concat(frames, how="vertical_relaxed")
    if shuffle_seed is not None:
        df = df.sample(fraction=1.0, shuffle=True, seed=shuffle_seed)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    df.write_parquet(path)
    return path


# ---------------------------------------------------------------------------------------------- a pipeline's outputs

def tiny_artifacts(root: Path | str, name: str = "rs-tiny", rules: Sequence[str] = ("fixed", "top1", "oracle")) -> Path:
    """``<root>/{dump,geometry,readouts}/<name>/``: one random-init model (running sum mod 5 over 6 digits,
    4 loops) dumped on val and test (20 sequences each), its geometry and its readouts (``rules``).

    Returns:
        ``root``.
    """
    import torch

    from looptrace.capture.dump import DumpConfig, dump_model
    from looptrace.geometry.stage import GeometryConfig, geometry_model
    from looptrace.models.interface import LoopedTransformerAdapter
    from looptrace.rules.readouts import ReadoutsConfig, readouts_model
    from looptrace.rules.scoring import CalibrationConfig

    torch.set_num_threads(1)
    root = Path(root)
    task = tiny_task(length=6)
    model = tiny_model(vocab=5, seq=6, loops=4)
    adapter = LoopedTransformerAdapter(model, name, extra={"task": {"name": "rs", **task.spec()}})
    stores = dump_model(adapter, task, {"val": 43, "test": 44}, root / "dump" / name,
                        DumpConfig(sequences={"val": 20, "test": 20}, batch_size=10, chunk_tokens=64), progress=False)
    geometry_model(stores, GeometryConfig(splits=("val", "test"), eps={"kl_prev": (1e-3,)}), root / "geometry" / name,
                   progress=False)
    readouts_model(root / "geometry" / name, ReadoutsConfig(rules=tuple(rules)), CalibrationConfig(),
                   root / "readouts" / name, progress=False)
    return root


def run_map(step, h0, T: int):
    """States of a loop map ``h <- step(h, t)`` for t = 0..T-1 from ``h0`` [batch, token, d_model]:
    [batch, token, loop, d_model] (the store's loop axis)."""
    import torch

    hs, h = [], h0
    for t in range(T):
        h = step(h, t)
        hs.append(h)
    return torch.stack(hs, dim=2)
