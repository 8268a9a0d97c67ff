"""The report's inputs: its params section (``ReportConfig``) and every stage's outputs it reads (``load_inputs``
-> ``Inputs``, SPEC §10 layout; a missing input is recorded with the stage to run, never an error unless it is the
readouts' spine)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import polars as pl

from looptrace.config import ConfigError, MissingInputError
from looptrace.io.artifacts import read_json, read_parquet
from looptrace.io.parquet import read_verified
from looptrace.report.loopmap_section import load_loopmap


@dataclass(frozen=True)
class ReportConfig:
    """``report`` section of ``params.yaml``.

    Attributes:
        x: the D@X target (percent) of the headline tables.
        split: split the figures describe (the readouts/gates operating points are always test).
        convergence_signal, convergence_eps, convergence_kind: which convergence depth of
            ``convergence.parquet`` the convergence figure shows (SPEC §2: signal, ε, first|settled).
        dpi: PNG resolution (figures are 10.5 in wide: 1155 px at the default 110, the page's column width).
        title: page title.
        seed_lines: also draw every training seed as a thin line beside the mean over seeds (per-loop accuracy,
            step geometry, the Pareto figures' highlighted curves).
        speed_agreement: the "Speed: lossless vs lossy" section's agreement bar, a fraction in (0, 1]: beside loop
            self-speculative decoding it names the fastest early-exit run whose token agreement with full-depth
            greedy decoding is ≥ this (SPEC §8).
    """

    x: float = 95.0
    split: str = "test"
    convergence_signal: str = "kl_prev"
    convergence_eps: float = 0.001
    convergence_kind: str = "first"
    dpi: int = 110
    title: str = "looptrace report"
    seed_lines: bool = False
    speed_agreement: float = 0.99

    def __post_init__(self) -> None:
        if not 0.0 < self.x <= 100.0:
            raise ConfigError(f"report.x is an accuracy percentage in (0, 100], got {self.x}")
        if self.convergence_kind not in ("first", "settled"):
            raise ConfigError(f"report.convergence_kind must be first or settled, got {self.convergence_kind!r}")
        if self.dpi < 50:
            raise ConfigError(f"report.dpi must be ≥ 50, got {self.dpi}")
        if not 0.0 < self.speed_agreement <= 1.0:
            raise ConfigError(f"report.speed_agreement is a token-agreement fraction in (0, 1], got "
                              f"{self.speed_agreement}")


@dataclass
class Inputs:
    """Everything the report reads, one frame per kind (``model`` column added), None when absent.

    Attributes:
        meta: model, task, regime, regime_kind, n_loops, full_depth_accuracy (test), has_gate.
        acc_per_loop: model, loop, accuracy (test).
        loop_summary: loop_summary rows of ``split`` (group_by all and token_type).
        convergence: per model × group (difficulty | token_type) mean depth of the chosen signal.
        pareto, chosen, dx: readouts (+ gates, ``source`` column) rows.
        failures, verdicts, verdict_groups: diagnose tables; summary: diagnose summary.md text; claims: its
            [AD] claim statuses (metrics.json).
        full_depth: model, accuracy (+ accuracy_lo/hi, n_boot, n_sequences): fixed depth's test point at T
            (``operating_points.parquet``), the full-depth accuracy with its interval.
        cross_regime: gates' cross-regime table.
        latency: latency.parquet; latency_metrics: its metrics.json.
        generate: generate.parquet (generation-time early exit); generate_metrics: its metrics.json.
        speculative: generate's speculative.parquet (loop self-speculative decoding, SPEC §8; opt-in
            ``generate.speculative``, so no "missing" note when absent).
        halting_table: diagnose's halting_table.parquet (``diagnose.halting_table``), collapse_tol: the
            diagnose run's ``collapse_tol``; faithfulness: diagnose's faithfulness.parquet (SPEC §7a).
        loopmap: the loopmap stage's tables (:data:`looptrace.loopmap.tabulate.TABLES`), table -> rows.
        layers, heads: the geometry stage's opt-in ``layers.parquet`` / ``heads.parquet`` rows of ``split`` (models
            dumped with ``dump.layers`` / ``dump.heads`` only; SPEC §2c).
        missing: input -> what to run.
    """

    meta: pl.DataFrame
    acc_per_loop: pl.DataFrame | None = None
    loop_summary: pl.DataFrame | None = None
    convergence: pl.DataFrame | None = None
    pareto: pl.DataFrame | None = None
    chosen: pl.DataFrame | None = None
    dx: pl.DataFrame | None = None
    failures: pl.DataFrame | None = None
    verdicts: pl.DataFrame | None = None
    summary: str | None = None
    cross_regime: pl.DataFrame | None = None
    latency: pl.DataFrame | None = None
    latency_metrics: dict | None = None
    full_depth: pl.DataFrame | None = None
    verdict_groups: pl.DataFrame | None = None
    claims: dict | None = None
    generate: pl.DataFrame | None = None
    generate_metrics: dict | None = None
    speculative: pl.DataFrame | None = None
    halting_table: pl.DataFrame | None = None
    collapse_tol: float | None = None
    faithfulness: pl.DataFrame | None = None
    loopmap: dict[str, pl.DataFrame] | None = None
    layers: pl.DataFrame | None = None
    heads: pl.DataFrame | None = None
    missing: dict[str, str] = field(default_factory=dict)


def _concat(frames: list[pl.DataFrame]) -> pl.DataFrame | None:
    frames = [f for f in frames if f is not None and f.height]
    return pl.concat(frames, how="diagonal_relaxed") if frames else None


def _token_type_names(loop_summary: pl.DataFrame | None, ids: np.ndarray) -> dict[int, str]:
    """token_type id -> name: loop_summary lists the token-type groups by increasing id (geometry
    ``summarise_loop``), and convergence rows carry the ids of the same tokens."""
    uniq = sorted(int(i) for i in np.unique(ids))
    if loop_summary is None:
        return {i: str(i) for i in uniq}
    names = (loop_summary.filter((pl.col("group_by") == "token_type") & (pl.col("loop") == 1)
                                 & (pl.col("metric") == loop_summary["metric"][0]))["group_value"].to_list())
    return dict(zip(uniq, names, strict=True)) if len(names) == len(uniq) else {i: str(i) for i in uniq}


def load_inputs(models: Sequence[str], root: Path | str, cfg: ReportConfig) -> Inputs:
    """Read every stage's outputs for ``models`` under the artifacts ``root`` (SPEC §10 layout).

    Raises:
        FileNotFoundError: a model has no ``readouts/<model>/metrics.json`` (the report's spine).
    """
    root = Path(root)
    pareto: list[pl.DataFrame]
    chosen: list[pl.DataFrame]
    dx: list[pl.DataFrame]
    meta_rows, acc_rows, ls, conv, pareto, chosen, dx, full = [], [], [], [], [], [], [], []
    inside: dict[str, list[pl.DataFrame]] = {"layers": [], "heads": []}
    missing: dict[str, str] = {}
    for model in models:
        rdir = root / "readouts" / model
        mpath = rdir / "metrics.json"
        if not mpath.is_file():
            raise MissingInputError(f"{mpath} not found; run the readouts stage for {model} first")
        rm = read_json(mpath)
        T = int(rm.get("n_loops") or len(rm.get("test_accuracy_per_loop") or []))
        meta_rows.append({"model": model, "task": rm.get("task") or model, "regime": rm.get("regime") or model,
                          "regime_kind": rm.get("regime_kind") or rm.get("regime") or "?", "n_loops": T,
                          "full_depth_accuracy": (rm.get("full_depth_accuracy") or {}).get("test"),
                          "has_gate": bool(rm.get("has_gate"))})
        for t, a in enumerate(rm.get("test_accuracy_per_loop") or [], start=1):
            acc_rows.append({"model": model, "loop": t, "accuracy": float(a)})
        for src, d in (("readouts", rdir), ("gates", root / "gates" / model)):
            for name, acc in (("pareto", pareto), ("chosen", chosen), ("dx", dx)):
                p = d / f"{name}.parquet"
                if p.is_file():
                    f = read_parquet(p)
                    if "kind" not in f.columns:
                        f = f.with_columns(kind=pl.lit("gate" if src == "gates" else "posthoc"))
                    acc.append(f.with_columns(model=pl.lit(model), source=pl.lit(src)))
                elif src == "readouts":
                    raise MissingInputError(f"{p} not found; run the readouts stage for {model} first")
                else:
                    missing[f"gates/{model}"] = "run the gates stage"
        ops = rdir / "operating_points.parquet"
        if ops.is_file():
            f = (read_verified(ops).lazy().filter((pl.col("rule") == "fixed") & (pl.col("split") == "test")
                                             & (pl.col("threshold") == float(T))).collect())
            if f.height:
                full.append(f.head(1).with_columns(model=pl.lit(model)))
        gdir = root / "geometry" / model
        lp, cp = gdir / "loop_summary.parquet", gdir / "convergence.parquet"
        summ = None
        if lp.is_file():
            summ = read_parquet(lp).filter(pl.col("split") == cfg.split)
            ls.append(summ.filter(pl.col("group_by").is_in(["all", "token_type"])).with_columns(model=pl.lit(model)))
        else:
            missing[f"geometry/{model}/loop_summary.parquet"] = "run the geometry stage"
        if cp.is_file():
            c = (read_verified(cp).lazy().filter((pl.col("split") == cfg.split)
                                             & (pl.col("signal") == cfg.convergence_signal)
                                             & ((pl.col("eps") - cfg.convergence_eps).abs() <= 1e-12 * max(1.0, cfg.convergence_eps))
                                             & (pl.col("kind") == cfg.convergence_kind))
                 .select("difficulty", "token_type", "depth", "censored").collect())
            if c.height:
                names = _token_type_names(summ, c["token_type"].to_numpy())
                for key in ("difficulty", "token_type"):
                    g = (c.group_by(key).agg(mean_depth=pl.col("depth").mean(), censored=pl.col("censored").mean(),
                                             n=pl.len()).sort(key))
                    labels = [names.get(int(v), str(v)) if key == "token_type" else str(v) for v in g[key].to_list()]
                    conv.append(pl.DataFrame({"model": model, "group_by": key, "group_value": labels,
                                              "order": g[key].cast(pl.Int64), "mean_depth": g["mean_depth"],
                                              "censored": g["censored"], "n": g["n"].cast(pl.Int64)}))
            else:
                missing[f"geometry/{model}/convergence.parquet"] = (
                    f"no rows for {cfg.convergence_signal}@{cfg.convergence_eps:g} ({cfg.convergence_kind}); "
                    "check report.convergence_* against geometry.eps")
        else:
            missing[f"geometry/{model}/convergence.parquet"] = "run the geometry stage"
        for name, frames in inside.items():  # opt-in (dump.layers / dump.heads): no "missing" note
            p = gdir / f"{name}.parquet"
            if p.is_file():
                frames.append(read_parquet(p).filter(pl.col("split") == cfg.split).with_columns(model=pl.lit(model)))
    meta = pl.DataFrame(meta_rows, schema={"model": pl.String, "task": pl.String, "regime": pl.String,
                                           "regime_kind": pl.String, "n_loops": pl.Int64,
                                           "full_depth_accuracy": pl.Float64, "has_gate": pl.Boolean})
    inp = Inputs(meta=meta, acc_per_loop=pl.DataFrame(acc_rows) if acc_rows else None, loop_summary=_concat(ls),
                 convergence=_concat(conv), pareto=_concat(pareto), chosen=_concat(chosen), dx=_concat(dx),
                 full_depth=_concat(full), layers=_concat(inside["layers"]), heads=_concat(inside["heads"]),
                 missing=missing)
    ddir = root / "diagnose"
    for name in ("failure_classes", "verdicts", "verdict_groups"):
        p = ddir / f"{name}.parquet"
        if p.is_file():
            f = read_parquet(p)
            setattr(inp, "failures" if name == "failure_classes" else name,
                    f.filter(pl.col("model").is_in(list(models))) if "model" in f.columns else f)
        elif name != "verdict_groups":  # diagnose outputs of older versions have no group table
            missing[f"diagnose/{name}.parquet"] = "run the diagnose stage"
    if (ddir / "metrics.json").is_file():
        dm = read_json(ddir / "metrics.json")
        inp.claims = dm.get("claims")
        inp.collapse_tol = ((dm.get("params") or {}).get("collapse_tol"))
    # the halting methods' table (opt-in in diagnose, so no "missing" note) and the faithfulness tests
    for name in ("halting_table", "faithfulness"):
        p = ddir / f"{name}.parquet"
        if p.is_file():
            f = read_parquet(p)
            setattr(inp, name, f.filter(pl.col("model").is_in(list(models))) if "model" in f.columns else f)
    if (ddir / "summary.md").is_file():
        inp.summary = (ddir / "summary.md").read_text()
    cr = root / "gates" / "cross_regime.parquet"
    if cr.is_file():
        inp.cross_regime = read_parquet(cr)
    else:
        missing["gates/cross_regime.parquet"] = "run the gates stage"
    lat = root / "latency" / "latency.parquet"
    if lat.is_file():
        inp.latency = read_parquet(lat).filter(pl.col("model").is_in(list(models)))
        lm = root / "latency" / "metrics.json"
        inp.latency_metrics = read_json(lm) if lm.is_file() else None
    else:
        missing["latency/latency.parquet"] = "run the latency stage"
    gen = root / "generate" / "generate.parquet"
    if gen.is_file():
        inp.generate = read_parquet(gen).filter(pl.col("model").is_in(list(models)))
        gm = root / "generate" / "metrics.json"
        inp.generate_metrics = read_json(gm) if gm.is_file() else None
    else:
        missing["generate/generate.parquet"] = "run the generate stage"
    spec = root / "generate" / "speculative.parquet"
    if spec.is_file():  # opt-in (generate.speculative; the LM profile leaves it off): no "missing" note
        inp.speculative = read_parquet(spec).filter(pl.col("model").is_in(list(models)))
    inp.loopmap = load_loopmap(root, list(models))
    if inp.loopmap is None:
        missing["loopmap/"] = "run the loopmap stage"
    return inp


# ----------------------------------------------------------------------------------------------
