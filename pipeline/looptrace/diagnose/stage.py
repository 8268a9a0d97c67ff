"""The ``diagnose`` stage: every model's failure classes, Spearman headlines, verdicts and summary (the package
docstring, :mod:`looptrace.diagnose`, says what each is)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal, overload

import numpy as np
import polars as pl

from looptrace.config import InputError, MissingInputError
from looptrace.diagnose.ad_claims import ad_claims
from looptrace.diagnose.config import DiagnoseConfig, fixed_prior_trajectory
from looptrace.diagnose.faithfulness import (
    faithfulness_frame,
    faithfulness_metrics,
    faithfulness_test,
    null_permutations,
)
from looptrace.diagnose.router import router_comparisons, router_model_rows
from looptrace.diagnose.stats import _row_iv, failure_codes, failure_rows, spearman_headlines, spearman_rows
from looptrace.diagnose.summary import summary_markdown
from looptrace.diagnose.verdicts import group_verdicts, verdict
from looptrace.diagnose.words import _ci, _dx_ci
from looptrace.estimates import Interval
from looptrace.intervals import IntervalsConfig, boot_seed, split_resampler
from looptrace.io.artifacts import read_json, read_parquet, write_outputs
from looptrace.io.parallel import DaskRunner, map_tasks
from looptrace.io.tables import SplitArrays, load_token_loop

__all__ = ["DiagnoseConfig", "diagnose_models", "model_rows", "write_diagnosis"]


@overload
def _read_rule_outputs(model_dir: Path, source: Literal["readouts"]) -> dict[str, pl.DataFrame]: ...
@overload
def _read_rule_outputs(model_dir: Path, source: str) -> dict[str, pl.DataFrame] | None: ...
def _read_rule_outputs(model_dir: Path, source: str) -> dict[str, pl.DataFrame] | None:
    """chosen, dx, chosen_exits (+ operating_points when present) of a readouts/gates model dir."""
    need = ("chosen", "dx", "chosen_exits")
    if not all((model_dir / f"{n}.parquet").is_file() for n in need):
        if source == "gates":
            return None
        missing = next(n for n in need if not (model_dir / f"{n}.parquet").is_file())
        raise MissingInputError(f"{model_dir / (missing + '.parquet')} not found; run the readouts stage first")
    out = {n: read_parquet(model_dir / f"{n}.parquet") for n in need}
    for n in ("chosen", "dx"):
        df = out[n]
        if "kind" not in df.columns:  # gates may omit it: every gates rule is a refit gate
            df = df.with_columns(kind=pl.lit("gate" if source == "gates" else "posthoc"))
        out[n] = df.with_columns(source=pl.lit(source))
    if "within_delta" not in out["chosen"].columns:
        out["chosen"] = out["chosen"].with_columns(within_delta=pl.lit(True))
    ops = model_dir / "operating_points.parquet"
    if ops.is_file():
        out["operating_points"] = read_parquet(ops)
    return out


def diagnose_models(models: Sequence[str], readouts_root: Path | str, gates_root: Path | str,
                    geometry_root: Path | str, cfg: DiagnoseConfig, meta: dict | None = None,
                    progress: bool = True, runner: DaskRunner | None = None,
                    intervals: IntervalsConfig | None = None, seed: int = 0
                    ) -> tuple[dict[str, pl.DataFrame], str, dict]:
    """Failure classes, Spearman, verdicts and the [AD] claims over all models.

    Args:
        models: model names (``<task>-<regime>``).
        readouts_root: ``artifacts/readouts`` (each model's chosen, dx, chosen_exits, operating_points,
            metrics.json — task/regime/regime_kind come from there).
        gates_root: ``artifacts/gates`` (optional per-model outputs with the readouts schema).
        geometry_root: ``artifacts/geometry`` (test rows of token_loop.parquet: difficulty, correctness,
            signals).
        cfg: the ``diagnose`` section.
        meta: extra metrics.json entries (versions, params).
        progress: progress bar.
        runner: one Dask task per model (:func:`model_rows`; the workers read the model's files, so with a
            remote scheduler the artifacts must be on a filesystem the workers share); None = in this process.
            The claims over all models are then drawn here from the per-model rows, in model order.
        intervals: the ``intervals`` section (Spearman intervals; None = none).
        seed: ``base.seed`` (the bootstrap's seed with the model name).

    Returns:
        (frames {failure_classes, spearman, verdicts}, summary markdown, metrics dict incl. claim details).
    """
    from tqdm.auto import tqdm

    models = list(models)
    parts = map_tasks(model_rows, [[m] for m in models], (readouts_root, gates_root, geometry_root, cfg, intervals, seed),
                     runner)
    rows: dict[str, list] = {k: [] for k in _ROW_KEYS}
    gates_present = False
    for part in tqdm(parts, total=len(models), desc="diagnose", disable=None if progress else True, leave=False):
        for k in _ROW_KEYS:
            rows[k] += part[k]
        gates_present = gates_present or part["gates_present"]
    return _diagnosis(**rows, gates_present=gates_present, cfg=cfg, meta=meta)


#: The per-model rows :func:`model_rows` returns.
_ROW_KEYS = ("fail_rows", "sp_rows", "verdict_rows", "meta_rows", "dx_all", "faith_rows", "router_rows")

#: Columns of chosen.parquet / dx.parquet diagnose reads (the interval and val columns when the stage wrote them).
_CHOSEN_COLS = ("rule", "kind", "source", "val_depth", "val_accuracy", "test_depth", "test_accuracy", "within_delta",
                "test_depth_lo", "test_depth_hi", "n_boot", "n_sequences")

_DX_COLS = ("rule", "kind", "source", "x", "d_at", "d_at_lo", "d_at_hi", "val_d_at", "reach_share", "n_boot",
            "n_sequences")


def _present(df: pl.DataFrame, cols: Sequence[str]) -> list[str]:
    return [c for c in cols if c in df.columns]


def model_rows(models: Sequence[str], readouts_root: Path | str, gates_root: Path | str, geometry_root: Path | str,
               cfg: DiagnoseConfig, intervals: IntervalsConfig | None = None, seed: int = 0) -> dict:
    """The per-model work of :func:`diagnose_models` (in this process or as a Dask task): each model's failure
    rows, Spearman rows, verdict, metadata row and D@X rows (lists, one entry per row, in model order) and
    whether it has gates outputs. The Spearman intervals resample the test split exactly as the readouts and
    gates stages do (same sequences, same B, same seed from ``base.seed`` and the model name)."""
    readouts_root, gates_root, geometry_root = Path(readouts_root), Path(gates_root), Path(geometry_root)
    fail_rows, sp_rows, verdict_rows, meta_rows, dx_all, faith_rows, router_rows = [], [], [], [], [], [], []
    gates_present = False
    for model in models:
        mpath = readouts_root / model / "metrics.json"
        if not mpath.is_file():
            raise MissingInputError(f"{mpath} not found; run the readouts stage for {model} first")
        rm = read_json(mpath)
        info = {"model": model, "task": rm.get("task"), "regime": rm.get("regime"),
                "regime_kind": rm.get("regime_kind"), "n_loops": rm.get("n_loops")}
        rdef = rm.get("regime_def") if isinstance(rm.get("regime_def"), dict) else None
        # [AD]'s claims: whether the trajectory was trained by a fixed prior alone, and its architecture (a
        # regime's pinned loop memory; None = the model section's, the same for every such model of a run)
        meta_rows.append({**{k: info[k] for k in ("model", "task", "regime", "regime_kind", "n_loops")},
                          "fixed_prior": fixed_prior_trajectory(info["regime_kind"], rdef),
                          "loop_memory": None if rdef is None or rdef.get("loop_memory") is None
                          else bool(rdef["loop_memory"])})
        outs = [("readouts", _read_rule_outputs(readouts_root / model, "readouts"))]
        g = _read_rule_outputs(gates_root / model, "gates")
        if g is not None:
            gates_present = True
            outs.append(("gates", g))
        test: SplitArrays = load_token_loop(geometry_root / model / "token_loop.parquet", splits=("test",),
                                           columns=("correct", "target_logprob", *cfg.spearman_signals))["test"]
        assert test.token is not None  # load_token_loop always sets the store row ids
        correct = test.loop["correct"]
        rs = split_resampler(test.fields, test.n, intervals, boot_seed(seed, model, "test"))
        perms = None
        loss = -test.loop["target_logprob"]  # ℓ_t per token and loop, the faithfulness test's counterfactual
        chosen, dxs = [], []
        for source, o in outs:
            chosen.append(o["chosen"].select(_present(o["chosen"], _CHOSEN_COLS)))
            dxs.append(o["dx"].select(_present(o["dx"], _DX_COLS)))
            kinds = dict(zip(o["chosen"]["rule"].to_list(), o["chosen"]["kind"].to_list(), strict=True))
            ex = o["chosen_exits"]
            for rule in ex["rule"].unique(maintain_order=True).to_list():
                e = ex.filter(pl.col("rule") == rule).sort("token")
                tok = e["token"].to_numpy()
                if tok.size != test.token.size or not np.array_equal(tok, test.token):
                    raise InputError(f"{source}/{model}/chosen_exits.parquet rule '{rule}': test tokens do not match "
                                     f"the geometry test split ({tok.size} vs {test.token.size}); re-run {source}")
                depth = e["exit_depth"].to_numpy()
                codes = failure_codes(depth, correct)
                for row in failure_rows(codes, depth, test.fields["difficulty"]):
                    fail_rows.append({**{k: info[k] for k in ("model", "task", "regime", "regime_kind")},
                                      "source": source, "rule": rule, "kind": kinds.get(rule), **row})
                if cfg.faithfulness_resamples:  # SEWN's counterfactual test at this rule's chosen point (SPEC §7a)
                    if perms is None:  # the model's null draws, shared by its rules
                        perms = null_permutations(test.n, cfg.faithfulness_resamples,
                                                  boot_seed(seed, model, "faithfulness"))
                    ft = faithfulness_test(loss, depth, rs, alpha=cfg.faithfulness_alpha,
                                           seed=boot_seed(seed, model, source, rule, "faith"), perms=perms)
                    faith_rows.append({**{k: info[k] for k in ("model", "task", "regime", "regime_kind")},
                                       "source": source, "rule": rule, "kind": kinds.get(rule), **ft.to_dict()})
        signals = {s: test.loop[s] for s in cfg.spearman_signals}
        c = correct
        signals["oracle_depth"] = np.where(c.any(1), c.argmax(1) + 1, c.shape[1]).astype(np.float64)
        sp_rows += [{"model": model, **r} for r in spearman_rows(test.fields["difficulty"], signals, rs,
                                                                _interval_rows(cfg))]
        ch, dx = pl.concat(chosen, how="diagonal_relaxed"), pl.concat(dxs, how="diagonal_relaxed")
        dx_all.append(dx.with_columns(model=pl.lit(model)))
        router_rows += router_model_rows(info, ch, cfg.router_baselines)  # [FP]: convergence router vs stabilisation
        # the ceiling with its bootstrap interval as the readouts stage wrote it (same resamples as every rule
        # of the model); outputs without one fall back to the point value from the test split
        orc = (rm.get("rules") or {}).get("oracle", {}).get("ceiling") or {}
        oracle = {"depth": orc.get("test_depth") or float(signals["oracle_depth"].mean()),
                  "accuracy": orc.get("test_accuracy") or float(c.any(1).mean())}
        mf = pl.DataFrame([r for r in fail_rows if r["model"] == model])
        verdict_rows.append(verdict(info, ch, dx, oracle, mf, cfg))
    return {"fail_rows": fail_rows, "sp_rows": sp_rows, "verdict_rows": verdict_rows, "meta_rows": meta_rows,
            "dx_all": dx_all, "faith_rows": faith_rows, "router_rows": router_rows, "gates_present": gates_present}


def _interval_rows(cfg: DiagnoseConfig) -> Callable[[str, int | None, str], bool] | None:
    """Which Spearman rows get an interval (``diagnose.spearman_intervals``); None = all."""
    if cfg.spearman_intervals == "all":
        return None
    return lambda signal, loop, agg: (signal == cfg.spearman_headline and agg == cfg.spearman_aggregation
                                      and loop == cfg.spearman_loop)


def _diagnosis(fail_rows: list, sp_rows: list, verdict_rows: list, meta_rows: list, dx_all: list,
               gates_present: bool, cfg: DiagnoseConfig, meta: dict | None, faith_rows: list | None = None,
               router_rows: list | None = None) -> tuple[dict[str, pl.DataFrame], str, dict]:
    """Frames, claims, summary and metrics of :func:`diagnose_models` from the per-model rows."""
    # n_loops: the claims' across-seed depth intervals stay within [1, T]; without it they were unbounded
    meta_df = pl.DataFrame(meta_rows, schema={"model": pl.String, "task": pl.String, "regime": pl.String,
                                              "regime_kind": pl.String, "n_loops": pl.Int64,
                                              "fixed_prior": pl.Boolean, "loop_memory": pl.Boolean})
    dx_df = pl.concat(dx_all, how="diagonal_relaxed")
    claims = ad_claims(meta_df, dx_df, cfg, gates_present)
    frames = {
        "failure_classes": pl.DataFrame(fail_rows, infer_schema_length=None),
        "spearman": pl.DataFrame(sp_rows, schema_overrides={"loop": pl.Int64}, infer_schema_length=None),
        "verdicts": pl.DataFrame(verdict_rows, infer_schema_length=None),
    }
    groups = group_verdicts(frames["verdicts"], cfg)
    frames["verdict_groups"] = groups
    faith = faithfulness_frame(faith_rows or [])
    frames["faithfulness"] = faith  # empty (same columns) when diagnose.faithfulness_resamples is 0
    frames["convergence_router"] = router_comparisons(pl.DataFrame(router_rows or [], infer_schema_length=None), cfg)
    summary = summary_markdown(frames["verdicts"], claims, frames["spearman"], cfg, frames["failure_classes"],
                               groups, faithfulness=faith if cfg.faithfulness_resamples else None,
                               router=frames["convergence_router"])
    figs = ("best_depth", "fixed_depth", "native_depth", "oracle_depth", "dx_fixed", "dx_best_posthoc",
            "dx_best_gate", "dx_native")

    def entry(row: dict, n_seeds: int) -> dict:
        out = {k: row[k] for k in ("verdict", "reason")}
        out["best_rule" if "best_rule" in row else "best_rules"] = row.get("best_rule", row.get("best_rules"))
        for k in figs:
            i = _row_iv(row, k)
            out[k] = None if i is None else {**Interval(i.estimate, i.lo, i.hi, n_seeds,
                                                        "t over seeds" if n_seeds > 1 else "bootstrap").to_dict(),
                                             "text": (_dx_ci if k.startswith("dx_") else _ci)(i)}
        return out

    g_rho, m_rho = spearman_headlines(frames["spearman"], cfg)

    def rho_entry(d: dict) -> dict:
        return {**d["iv"].to_dict(), "n": d["n"], "unit": d["unit"]}

    metrics = {**(meta or {}), "gates_present": gates_present,
               "spearman": {"signal": cfg.spearman_headline, "loop": cfg.spearman_loop,
                            "aggregation": cfg.spearman_aggregation,
                            "models": {m: rho_entry(d) for m, d in m_rho.items()},
                            "groups": {g: rho_entry(d) for g, d in g_rho.items()}},
               "claims": {c["claim"]: c["status"] for c in claims},
               **({"faithfulness": faithfulness_metrics(faith, cfg)} if cfg.faithfulness_resamples else {}),
               "models": {v["model"]: entry(v, 1) for v in verdict_rows},
               "groups": {g["group"]: {"n_seeds": g["n_seeds"], "seed_verdicts": g["seed_verdicts"],
                                       **entry(g, g["n_seeds"])} for g in groups.iter_rows(named=True)}}
    return frames, summary, {**metrics, "claim_details": [{k: c[k] for k in ("claim", "status", "details")}
                                                          for c in claims]}


def write_diagnosis(out_dir: Path | str, frames: dict[str, pl.DataFrame], summary: str, metrics: dict) -> None:
    """Write the diagnose outputs atomically (parquets, summary.md, metrics.json)."""
    write_outputs(out_dir, frames, metrics, extra_text={"summary.md": summary})
