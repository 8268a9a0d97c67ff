"""The report's "Speed: lossless vs lossy" section (SPEC §8): loop self-speculative decoding (``speculative.parquet``,
every token full depth's) beside generation-time early exit (``generate.parquet``, lossy), per model and batch size:
the speculative settings' realised and predicted speedups with their intervals, the fastest early-exit run whose
token agreement with full-depth greedy decoding reaches ``report.speed_agreement``, and the fastest early-exit run
overall. Everything is read from the generate stage's tables, never recomputed."""

from __future__ import annotations

import math

import polars as pl


def _f(v) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


def speedup_text(v, lo=None, hi=None) -> str:
    """``1.87× [1.74, 2.20]`` (``1.87×`` without an interval; "—" when ``v`` is absent or not finite)."""
    e, a, b = _f(v), _f(lo), _f(hi)
    if not math.isfinite(e):
        return "—"
    return f"{e:.2f}× [{a:.2f}, {b:.2f}]" if math.isfinite(a) and math.isfinite(b) else f"{e:.2f}×"


def bar_text(bar: float) -> str:
    """The agreement bar in percent: 0.99 -> ``99 %``."""
    return f"{100 * bar:g} %"


def fastest_exit(gen: pl.DataFrame | None, model: str, batch_size: int, bar: float | None = None) -> dict | None:
    """The early-exit run (rule × KV policy) of ``model`` at ``batch_size`` with the largest realised speedup,
    among those whose token agreement with full-depth greedy decoding is ≥ ``bar`` (every run when None); ties
    go to the rule, then the policy, first by name. None when there is no such run.

    Args:
        gen: generate.parquet rows (model, rule, policy, batch_size, realised_speedup, token_agreement).
        model, batch_size: the run.
        bar: the agreement bar, a fraction; None = no bar.

    Returns:
        The row (a dict of generate.parquet's columns), or None.
    """
    if gen is None or not gen.height:
        return None
    d = gen.filter((pl.col("model") == model) & (pl.col("batch_size") == batch_size)
                   & pl.col("realised_speedup").is_finite())
    if bar is not None:
        d = d.filter(pl.col("token_agreement") >= bar)
    if not d.height:
        return None
    return d.sort(["realised_speedup", "rule", "policy"], descending=[True, False, False]).row(0, named=True)


def exit_label(r: dict | None) -> str | None:
    return None if r is None else f"{r['rule']} ({r['policy']})"


def _agreement_text(r: dict | None) -> str | None:
    a = _f(None if r is None else r.get("token_agreement"))
    return f"{100 * a:.1f}" if math.isfinite(a) else None


def speed_columns(bar: float) -> list[tuple[str, str]]:
    """The section's table columns (column, header); every column is text."""
    b = bar_text(bar)
    return [("model", "model"), ("batch_size", "batch"), ("k", "k"), ("d", "d"),
            ("spec_realised_text", "speculative: realised speedup [lo, hi]"),
            ("spec_predicted_text", "predicted from the store [lo, hi]"),
            ("spec_ratio_text", "realised / predicted"), ("exact_text", "tokens = full depth's"),
            ("bar_rule", f"fastest early exit at ≥ {b} agreement (KV policy)"), ("bar_speedup_text", "its speedup"),
            ("bar_agreement_text", "its agreement (%)"), ("fast_rule", "fastest early exit (KV policy)"),
            ("fast_speedup_text", "its speedup"), ("fast_agreement_text", "its agreement (%)")]


def speed_intro(bar: float) -> str:
    """The paragraph above the table."""
    return ("Loop self-speculative decoding (k loops draft d tokens, one full-depth pass verifies; SPEC §8) emits "
            "exactly full-depth greedy decoding's tokens; early exit trades token agreement for loops. Realised = "
            "wall time of full-depth decoding / of the method in the same run (speculative: median over repeats "
            "with their min–max); predicted = the store's acceptance runs and the measured costs (95 % bootstrap "
            f"interval). Beside each speculative setting: the fastest early-exit run (rule, KV policy) at the same "
            f"batch size whose token agreement with full-depth greedy decoding is ≥ {bar_text(bar)} "
            "(report.speed_agreement), and the fastest early-exit run at any agreement.")


def speed_rows(gen: pl.DataFrame | None, spec: pl.DataFrame | None, models: list[str],
               bar: float) -> pl.DataFrame | None:
    """One row per model × batch size × speculative (k, d) (a model × batch size without speculative rows: one row
    with the early-exit columns only), in ``models`` order, then batch size, k, d. None when there are no
    speculative rows (the section is not shown).

    Args:
        gen: generate.parquet rows, or None.
        spec: speculative.parquet rows, or None.
        models: the report's models, in page order.
        bar: the agreement bar (``report.speed_agreement``), a fraction.

    Returns:
        DataFrame with the numbers (``spec_realised`` and ``_lo``/``_hi``, ``spec_predicted`` and ``_lo``/``_hi``,
        ``spec_ratio``, ``exact``, ``bar_speedup``, ``bar_agreement``, ``fast_speedup``, ``fast_agreement``) and
        the text columns of :func:`speed_columns`.
    """
    if spec is None or not spec.height:
        return None
    rows = []
    for model in models:
        sizes = set(spec.filter(pl.col("model") == model)["batch_size"].to_list())
        if gen is not None:
            sizes |= set(gen.filter(pl.col("model") == model)["batch_size"].to_list())
        for bs in sorted(sizes):
            best, fast = fastest_exit(gen, model, bs, bar), fastest_exit(gen, model, bs)
            ex = {"bar_rule": exit_label(best), "bar_speedup": None if best is None else best["realised_speedup"],
                  "bar_speedup_text": None if best is None else speedup_text(best["realised_speedup"]),
                  "bar_agreement": None if best is None else best["token_agreement"],
                  "bar_agreement_text": _agreement_text(best),
                  "fast_rule": exit_label(fast), "fast_speedup": None if fast is None else fast["realised_speedup"],
                  "fast_speedup_text": None if fast is None else speedup_text(fast["realised_speedup"]),
                  "fast_agreement": None if fast is None else fast["token_agreement"],
                  "fast_agreement_text": _agreement_text(fast)}
            s = spec.filter((pl.col("model") == model) & (pl.col("batch_size") == bs)).sort("k", "d")
            for r in (s.iter_rows(named=True) if s.height else [{}]):
                ratio = _f(r.get("speedup_ratio"))
                rows.append({"model": model, "batch_size": bs, "k": r.get("k"), "d": r.get("d"),
                             "spec_realised": r.get("realised_speedup"), "spec_realised_lo": r.get("realised_speedup_lo"),
                             "spec_realised_hi": r.get("realised_speedup_hi"),
                             "spec_predicted": r.get("predicted_speedup"),
                             "spec_predicted_lo": r.get("predicted_speedup_lo"),
                             "spec_predicted_hi": r.get("predicted_speedup_hi"), "spec_ratio": r.get("speedup_ratio"),
                             "exact": r.get("exact"),
                             "spec_realised_text": speedup_text(r.get("realised_speedup"), r.get("realised_speedup_lo"),
                                                                r.get("realised_speedup_hi")) if r else None,
                             "spec_predicted_text": speedup_text(r.get("predicted_speedup"),
                                                                 r.get("predicted_speedup_lo"),
                                                                 r.get("predicted_speedup_hi")) if r else None,
                             "spec_ratio_text": f"{ratio:.2f}" if math.isfinite(ratio) else None,
                             "exact_text": None if r.get("exact") is None else ("yes" if r["exact"] else "NO"),
                             **ex})
    schema = {"model": pl.String, "batch_size": pl.Int64, "k": pl.Int64, "d": pl.Int64,
              **{f"spec_{n}{e}": pl.Float64 for n in ("realised", "predicted") for e in ("", "_lo", "_hi")},
              "spec_ratio": pl.Float64, "exact": pl.Boolean, "spec_realised_text": pl.String,
              "spec_predicted_text": pl.String, "spec_ratio_text": pl.String, "exact_text": pl.String,
              **{f"{w}_{c}": t for w in ("bar", "fast") for c, t in
                 (("rule", pl.String), ("speedup", pl.Float64), ("speedup_text", pl.String),
                  ("agreement", pl.Float64), ("agreement_text", pl.String))}}
    return pl.DataFrame(rows, schema=schema)

