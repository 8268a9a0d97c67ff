"""Training dynamics ([TS]): a fixed probe set through every kept checkpoint (the ``dynamics`` stage).

[TS] reports that, as training proceeds, loop steps shrink and become less collinear. Every
intermediate checkpoint and ``model.pt`` (fraction 1.0) runs the same probe sequences through the
dump's own capture (:func:`looptrace.capture.dump.dump_split`) into a temporary store, which is read
back with the geometry stage's block code, so the per-loop summaries are those geometry would compute.
This is a capture stage (it runs the model): the offline geometry stage never imports model code.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl
from tqdm.auto import tqdm

from looptrace.capture.dump import dump_split
from looptrace.config import ConfigError, InputError, MissingInputError
from looptrace.geometry.blocks import iter_blocks
from looptrace.io.store.reader import open_store
from looptrace.models.interface import LoopedTransformerAdapter
from looptrace.tasks import SPLITS, make_task

#: Quantities of ``training_dynamics.parquet`` (mean and median per checkpoint × loop).
DYNAMICS_METRICS = ("step_norm", "rel_step", "step_cos", "accel")
#: ``training_dynamics.parquet``: one row per checkpoint × loop.
DYNAMICS_SCHEMA = {"checkpoint": pl.String, "step": pl.Int64, "fraction": pl.Float64, "loop": pl.Int64,
                   **{f"{m}_{s}": pl.Float64 for m in DYNAMICS_METRICS for s in ("mean", "median")},
                   "accuracy": pl.Float64, "n_tokens": pl.Int64}


@dataclass(frozen=True)
class DynamicsConfig:
    """``dynamics`` section of ``params.yaml``.

    Attributes:
        enabled: capture the probe set at every kept checkpoint; false writes an empty table.
        probe_split: split the probe sequences are drawn from.
        probe_sequences: number of probe sequences (drawn with the checkpoint's data seed).
        block_tokens: tokens per block read back from each probe store (null = its chunk size).
        seeds: the training seeds whose models dvc.yaml's ``dynamics`` matrix runs (DVC reads it; the stage runs the
            ``--model`` it is given). A subset of ``train.seeds``: the probe curves of one seed show the dynamics.
    """

    enabled: bool = True
    probe_split: str = "val"
    probe_sequences: int = 256
    block_tokens: int | None = None
    seeds: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.probe_split not in SPLITS:
            raise ConfigError(f"dynamics.probe_split must be one of {', '.join(SPLITS)}, got {self.probe_split!r}")
        if self.probe_sequences < 1:
            raise ConfigError(f"dynamics.probe_sequences must be >= 1, got {self.probe_sequences}")
        if self.block_tokens is not None and self.block_tokens < 1:
            raise ConfigError(f"dynamics.block_tokens must be >= 1 or null, got {self.block_tokens}")



def checkpoint_paths(train_dir: Path | str) -> list[Path]:
    """Intermediate checkpoints (``checkpoints/step_*.pt``, by step) followed by ``model.pt``.

    Raises:
        FileNotFoundError: when ``model.pt`` is missing (names the path and the fix).
    """
    train_dir = Path(train_dir)
    final = train_dir / "model.pt"
    if not final.is_file():
        raise MissingInputError(f"checkpoint '{final}' not found; run `dvc repro train` first")
    return sorted((train_dir / "checkpoints").glob("step_*.pt")) + [final]


def probe_summary(store, block_tokens: int | None = None) -> dict[str, np.ndarray]:
    """Per-loop mean and median of the :data:`DYNAMICS_METRICS` and accuracy of a (small) store.

    Args:
        store: an open trajectory store (the probe capture of one checkpoint).
        block_tokens: tokens per block.

    Returns:
        ``<metric>_mean`` / ``<metric>_median`` [loop] (finite values only; NaN when none) and
        ``accuracy`` [loop].
    """
    cols: dict[str, list] = {m: [] for m in (*DYNAMICS_METRICS, "correct")}
    for block in iter_blocks(store, block_tokens):
        for m in cols:
            cols[m].append(block.loop[m])
    out = {}
    for m in DYNAMICS_METRICS:
        x = np.concatenate(cols[m]).astype(np.float64)  # [token, loop]; the probe set is small
        finite = np.isfinite(x)
        cnt = finite.sum(axis=0)
        with np.errstate(invalid="ignore"):
            out[f"{m}_mean"] = np.where(cnt > 0, np.where(finite, x, 0).sum(axis=0) / np.maximum(cnt, 1), np.nan)
        out[f"{m}_median"] = np.array([np.median(x[finite[:, t], t]) if cnt[t] else np.nan
                                       for t in range(x.shape[1])])
    out["accuracy"] = np.concatenate(cols["correct"]).mean(axis=0)
    return out


def training_dynamics(train_dir: Path | str, cfg: DynamicsConfig, dump_cfg, device: str = "cpu",
                      progress: bool = True) -> pl.DataFrame:
    """Loop geometry across training ([TS]: steps shrink and become less collinear as training proceeds).

    Every intermediate checkpoint and ``model.pt`` (fraction 1.0) runs the same fixed probe set —
    ``cfg.probe_sequences`` sequences of ``cfg.probe_split`` drawn with the checkpoint's recorded data
    seed — through ``looptrace.capture.dump.dump_split`` into a temporary store, which is then read back with the
    same block code as the main stage.

    Args:
        train_dir: ``artifacts/train/<model>``.
        cfg: the ``dynamics`` section.
        dump_cfg: a :class:`looptrace.capture.dump.DumpConfig` (the ``dump`` section: dtype, chunking...).
        device: torch device of the captures.
        progress: show a progress bar.

    Returns:
        One row per (checkpoint, loop): ``checkpoint``, ``step``, ``fraction``, ``loop`` (1-based),
        ``<metric>_mean``, ``<metric>_median`` for step_norm, rel_step, step_cos, accel, ``accuracy``,
        ``n_tokens``.
    """

    rows = []
    paths = checkpoint_paths(train_dir)
    with tempfile.TemporaryDirectory(prefix="looptrace-probe-") as tmpdir:
        for path in tqdm(paths, desc="training dynamics", disable=None if progress else True, leave=False):
            adapter = LoopedTransformerAdapter.from_checkpoint(path, device=device, name=Path(train_dir).name)
            extra = adapter.info.extra
            spec = dict(extra["task"])
            task = make_task(spec.pop("name"), spec)
            seeds = extra.get("data_seeds") or {}
            if cfg.probe_split not in seeds:
                raise InputError(f"checkpoint '{path}' records no data seed for split '{cfg.probe_split}'; "
                                 "retrain with the current train stage")
            data = task.dataset(cfg.probe_split, cfg.probe_sequences, int(seeds[cfg.probe_split]))
            store_path = Path(tmpdir) / f"{path.stem}.zarr"
            attrs = {"split": cfg.probe_split, "difficulty_name": task.difficulty_name,
                     "difficulty_levels": list(task.difficulty_levels), "token_types": list(task.token_types),
                     "data_seed": int(seeds[cfg.probe_split])}
            dump_split(adapter, data, store_path, dump_cfg, attrs, progress=False)
            summ = probe_summary(open_store(store_path), cfg.block_tokens)
            n_tokens = int((data.targets != -100).sum())
            for t in range(adapter.info.n_loops):
                row = {"checkpoint": path.name, "step": int(extra.get("step", 0)),
                       "fraction": float(extra.get("fraction", 1.0)), "loop": t + 1}
                row.update({k: float(v[t]) for k, v in summ.items()})
                row["n_tokens"] = n_tokens
                rows.append(row)
            shutil.rmtree(store_path, ignore_errors=True)
    return pl.DataFrame(rows, schema=DYNAMICS_SCHEMA).sort(["step", "loop"])


def dynamics_metrics(df: pl.DataFrame) -> dict:
    """Headline of ``training_dynamics.parquet`` for metrics.json: per checkpoint (by step), the
    last loop's mean step norm, median relative step, mean step cosine and accuracy."""
    last = df.filter(pl.col("loop") == pl.col("loop").max().over("step")).sort("step")
    return {"step": last["step"].to_list(), "fraction": last["fraction"].to_list(),
            "step_norm_mean_last_loop": last["step_norm_mean"].to_list(),
            "rel_step_median_last_loop": last["rel_step_median"].to_list(),
            "step_cos_mean_last_loop": last["step_cos_mean"].to_list(),
            "accuracy_last_loop": last["accuracy"].to_list()}
