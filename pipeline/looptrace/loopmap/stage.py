"""The ``loopmap`` stage's library: the loop map of a trained model measured on a small fixed sample, at a bounded
cost, on every default model (SPEC §2b).

``dump.contraction`` stores ρ_t and the FTLE for every dumped token but costs 26–98× a plain dump (docs/dump.md), so
it is off by default and nothing about the loop map would appear in a default run. This stage instead loads the
trained checkpoint and measures, on ``loopmap.sequences`` sequences of ``loopmap.split`` (the first ones of the split,
drawn with the checkpoint's own data seed, so the sample is fixed):

1. ρ_t, its upper bound ρ̄_t and the FTLE per token and loop (:func:`looptrace.loopmap.contraction.contraction_stats`:
   the exact top singular value of each token's Jacobian block from S·d VJPs up to ``loopmap.exact_width``, a
   power-method estimate beyond it; Benettin [BE] through the model's loop step), and from them, with the
   torch-free functions of :mod:`looptrace.loopmap.diagnoses`: the regime in words with bootstrap intervals, the
   share of (token, loop) with ρ_t < 1, the certified fixed-point exit's operating points ([BA], from ρ̄_t; beyond
   ``exact_width`` the *estimated* fixed-point exit, from ρ_t) beside fixed depth and two post-hoc threshold
   rules on the same sample (``rel_step``, ``entropy``; thresholds not calibrated on val — the comparison shows
   where the certificate sits, not a deployable operating point) with the Pareto front over all of them, and the
   failure-prediction AUC table (FTLE, ρ, rel_step, entropy for trajectory vs readout failures, SPEC §7);
2. intervention windows (:mod:`looptrace.loopmap.interventions`): noise of each relative scale and activation
   patching at each loop k, loops k+1..T re-run; per loop j after it the median and central interval over tokens of
   the state effect e_j, its linearised prediction ê_j (the JVP chain J^j δ), the readout KL, and the share of
   tokens whose argmax flipped (bootstrap interval over sequences); the window length of each (SPEC §2b).

3. cross-loop causal tracing (:mod:`looptrace.loopmap.tracing`, ``loopmap.trace``): per sequence one
   answer-changing token substitution, the clean run's state patched into the corrupted run at every (loop,
   position) and the answer's logit difference restored (``trace``), exit-gate patching on a model with a native
   gate (``gate_patch``), and the answer-flip depth of every scored token beside the rules' exit depths
   (``flip_depth``) — :mod:`looptrace.loopmap.trace_tables`, their sentences in ``tracing.md``.

The measurement is :mod:`looptrace.loopmap.measure`, the tables :mod:`looptrace.loopmap.tabulate` (written here by
:func:`write_loopmap`), the figures :mod:`looptrace.loopmap.plots`; the section is
:class:`~looptrace.loopmap.config.LoopmapConfig`.
The cost is bounded by the sample: ``sequences`` × T × S·d VJPs for the exact ρ_t (beyond ``exact_width``:
(2·``power_iters`` + 1) S-position JVP/VJP calls), and a few forwards per intervention (docs/loopmap.md states the
measured cost).
"""

from __future__ import annotations

from pathlib import Path

import polars as pl

from looptrace.loopmap.config import LoopmapConfig
from looptrace.loopmap.measure import checkpoint_task, load_sample, measure, no_loop_step
from looptrace.loopmap.tabulate import (
    empty_frames,
    loopmap_tables,
)
from looptrace.loopmap.trace_tables import (
    empty_trace_frames,
    flip_depth_table,
    gate_patch_table,
    trace_table,
    trace_words,
    traced_mask,
)
from looptrace.loopmap.tracing import trace_sample


def loopmap_model(train_dir: Path | str, cfg: LoopmapConfig, seed: int, device: str = "cpu", name: str | None = None,
                  progress: bool = True) -> tuple[dict[str, pl.DataFrame], list[str], dict, list[str]]:
    """The whole stage for one model: load, measure, tabulate.

    Args:
        train_dir: ``artifacts/train/<model>``.
        cfg: the ``loopmap`` section.
        seed: ``base.seed``.
        device: torch device.
        name: the model's name (default: the directory's).
        progress: show a progress bar.

    Returns:
        (name -> frame, summary sentences, metrics: T, sample size, intervention loops skipped, and why nothing was
        measured when the model has no differentiable loop map; the causal-tracing and answer-flip sentences).
    """
    name = name or Path(train_dir).name
    adapter, tokens, targets = load_sample(train_dir, cfg, device, name)
    T = adapter.info.n_loops
    meta = {"n_loops": T, "sequences": int(tokens.shape[0]),
            "skipped_loops": [k for k in cfg.loops if k >= T], "not_measured": no_loop_step(adapter)}
    if meta["not_measured"]:
        return ({**empty_frames(), **empty_trace_frames()}, [f"Loop map not measured: {meta['not_measured']}."],
                meta, [])
    raw = measure(adapter, tokens, targets, cfg, seed, progress)
    frames, words = loopmap_tables(name, raw, cfg, seed, T)
    meta["regime"] = frames["regime"].row(0, named=True)
    regime = adapter.info.extra.get("regime")
    extra = empty_trace_frames()
    extra["flip_depth"] = flip_depth_table(name, raw, cfg, seed, regime)
    tmeta: dict = {"not_traced": None if cfg.trace else "loopmap.trace is false"}
    if cfg.trace:
        tr = trace_sample(adapter, checkpoint_task(adapter), tokens, targets, cfg, seed, progress)
        tmeta.update(traced=int(len(tr["sequence"])), traced_kept=int(traced_mask(tr).sum()),
                     untraced=tr["untraced"])
        if not len(tr["sequence"]):
            tmeta["not_traced"] = "no sequence of the sample has an answer-changing substitution of its task"
        else:
            extra["trace"] = trace_table(name, tr, cfg, seed)
            extra["gate_patch"] = gate_patch_table(name, tr, regime, cfg, seed)
    return {**frames, **extra}, words, meta, trace_words(extra, tmeta)


def write_loopmap(out_dir: Path | str, frames: dict[str, pl.DataFrame], words: list[str], metrics: dict,
                  model: str, dpi: int, tracing: list[str] | None = None) -> None:
    """Write ``<name>.parquet`` per frame, ``summary.md``, ``rho_ftle.png``, ``windows.png``, ``metrics.json`` and
    (with the causal-tracing / answer-flip tables) ``tracing.md`` and ``trace.png`` atomically into ``out_dir``
    (:func:`looptrace.io.artifacts.atomic_dir`; figures only when measured)."""
    import json

    from looptrace.io.artifacts import atomic_dir, jsonable
    from looptrace.io.parquet import write_parquet
    from looptrace.loopmap.plots import plot_rho_ftle, plot_trace, plot_windows

    with atomic_dir(out_dir) as tmp:
        for key, df in frames.items():
            write_parquet(df, tmp / f"{key}.parquet")
        (tmp / "summary.md").write_text(f"# Loop map: {model}\n\n" + "\n\n".join(words) + "\n")
        if frames["per_loop"].height:
            plot_rho_ftle(frames["per_loop"], model, tmp / "rho_ftle.png", dpi)
        if frames["windows"].height:
            plot_windows(frames["windows"], frames["window_length"], model, tmp / "windows.png", dpi)
        if tracing:
            (tmp / "tracing.md").write_text(f"# Causal tracing and answer flips: {model}\n\n"
                                            + "\n\n".join(tracing) + "\n")
        if frames.get("flip_depth") is not None and frames["flip_depth"].height:
            plot_trace(frames["trace"], frames["flip_depth"], model, tmp / "trace.png", dpi)
        (tmp / "metrics.json").write_text(json.dumps(jsonable(metrics), indent=2, allow_nan=True) + "\n")


__all__ = ["loopmap_model", "write_loopmap"]
