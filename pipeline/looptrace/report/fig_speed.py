"""The report's speed figure (SPEC §8): loop self-speculative decoding (lossless) beside generation-time early exit
(lossy) on one axis, realised speedup over full-depth decoding against token agreement with full-depth greedy
decoding, a panel per model (the generate stage's ``generate.parquet`` and ``speculative.parquet``)."""

from __future__ import annotations

import math
from pathlib import Path

import polars as pl

from looptrace.report import plotting
from looptrace.report.inputs import Inputs
from looptrace.report.plotting import FIG_W, legend_below, pyplot, rule_colour

#: Markers of the speculative (k, d) settings (the early-exit rules are circles).
_SPEC_MARKERS = "D^sPv*X<>ph"
#: Colour of the speculative settings (the rules take the rule colours).
_SPEC_COLOUR = "#222222"
#: Vertical nudge (points) that keeps a setting's realised and predicted bars apart: both are at agreement 100 %.
_NUDGE_PT = 4.0


def _batch(sizes: list[int]) -> int | None:
    return 1 if 1 in sizes else (min(sizes) if sizes else None)


def speed_panels(inp: Inputs) -> list[dict]:
    """What each panel draws: per model of the report (page order) that has either table, the early-exit runs at
    batch size 1 (else the smallest) under one KV policy (``share`` when present, else the first in the table)
    and the speculative (k, d) settings at batch size 1 (else the smallest).

    Returns:
        [{"model", "exit_batch", "policy", "exits" (generate rows), "spec_batch", "spec" (speculative rows)}].
    """
    gen, spec = inp.generate, inp.speculative
    out = []
    for model in inp.meta["model"].to_list():
        g = gen.filter(pl.col("model") == model) if gen is not None else None
        s = spec.filter(pl.col("model") == model) if spec is not None else None
        if (g is None or not g.height) and (s is None or not s.height):
            continue
        panel: dict = {"model": model, "exit_batch": None, "policy": None, "exits": None, "spec_batch": None,
                       "spec": None}
        if g is not None and g.height:
            bs = _batch(g["batch_size"].to_list())
            policies = list(dict.fromkeys(g["policy"].to_list()))
            policy = "share" if "share" in policies else policies[0]
            panel.update(exit_batch=bs, policy=policy,
                         exits=g.filter((pl.col("batch_size") == bs) & (pl.col("policy") == policy)))
        if s is not None and s.height:
            bs = _batch(s["batch_size"].to_list())
            panel.update(spec_batch=bs, spec=s.filter(pl.col("batch_size") == bs).sort("k", "d"))
        out.append(panel)
    return out


def _finite(*v) -> bool:
    return all(x is not None and math.isfinite(float(x)) for x in v)


def fig_speed(inp: Inputs, out: Path, dpi: int) -> Path | None:
    """Realised speedup over full-depth decoding (log x, a line at 1×) against token agreement with full-depth
    greedy decoding (%), a panel per model: each early-exit rule a coloured circle (lossy), each speculative
    (k, d) a black marker at 100 % with its min–max over repeats as a horizontal bar and its predicted speedup as
    a hollow marker with its 95 % interval (dashed), nudged apart vertically. None when neither table has rows."""
    panels = speed_panels(inp)
    if not panels:
        return None
    plt = pyplot()
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator
    from matplotlib.transforms import offset_copy

    rules = list(dict.fromkeys(r for p in panels if p["exits"] is not None for r in p["exits"]["rule"].to_list()))
    settings = list(dict.fromkeys((int(r["k"]), int(r["d"])) for p in panels if p["spec"] is not None
                                  for r in p["spec"].iter_rows(named=True)))
    xs, ys = [1.0], [100.0]
    for p in panels:
        if p["exits"] is not None:
            e = p["exits"].filter(pl.col("realised_speedup").is_finite() & pl.col("token_agreement").is_finite())
            xs += e["realised_speedup"].to_list()
            ys += [100 * a for a in e["token_agreement"].to_list()]
        if p["spec"] is not None:
            for r in p["spec"].iter_rows(named=True):
                xs += [float(v) for v in (r.get(c) for c in ("realised_speedup", "realised_speedup_lo",
                                                             "realised_speedup_hi", "predicted_speedup",
                                                             "predicted_speedup_lo", "predicted_speedup_hi"))
                       if _finite(v) and float(v) > 0]
    xs = [x for x in xs if x > 0]
    lo, hi = min(xs) / 1.25, max(xs) * 1.25
    ylo = max(0.0, min(ys) - 0.08 * (100 - min(ys)) - 2.0)
    n = len(panels)
    ncol = min(2, n)
    nrow = math.ceil(n / ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(FIG_W, 3.6 * nrow + 1.4), squeeze=False, layout="constrained",
                             sharex=True, sharey=True)
    handles: dict[str, object] = {}
    ticks = [t for t in (0.125, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 16.0, 32.0) if lo <= t <= hi]
    for i, p in enumerate(panels):
        ax = axes[i // ncol, i % ncol]
        ax.set_xscale("log")
        ax.axvline(1.0, color="k", lw=0.9, ls="--", zorder=1)
        handles.setdefault("1× = full-depth decoding", Line2D([], [], color="k", lw=0.9, ls="--"))
        ax.axhline(100.0, color="grey", lw=0.6, ls=":", zorder=1)
        if p["exits"] is not None:
            for r in p["exits"].iter_rows(named=True):
                if not _finite(r["realised_speedup"], r["token_agreement"]):
                    continue
                c = rule_colour(rules.index(r["rule"]))
                ax.scatter(r["realised_speedup"], 100 * r["token_agreement"], color=c, marker="o", s=46,
                           edgecolors="k", linewidths=0.5, zorder=3)
                handles.setdefault(f"early exit: {r['rule']}", Line2D([], [], color=c, marker="o", mec="k", mew=0.5,
                                                                      ls="none", ms=7))
        if p["spec"] is not None:
            up = offset_copy(ax.transData, fig=fig, y=_NUDGE_PT, units="points")
            down = offset_copy(ax.transData, fig=fig, y=-_NUDGE_PT, units="points")
            for r in p["spec"].iter_rows(named=True):
                m = _SPEC_MARKERS[settings.index((int(r["k"]), int(r["d"]))) % len(_SPEC_MARKERS)]
                for col, trans, filled in (("realised_speedup", up, True), ("predicted_speedup", down, False)):
                    v, a, b = r.get(col), r.get(f"{col}_lo"), r.get(f"{col}_hi")
                    if not _finite(v):
                        continue
                    xerr = [[v - a], [b - v]] if _finite(a, b) else None
                    eb = ax.errorbar([v], [100.0], xerr=xerr, fmt=m, ms=8, color=_SPEC_COLOUR,
                                     mfc=_SPEC_COLOUR if filled else "white", mec=_SPEC_COLOUR, mew=1.4, capsize=3,
                                     elinewidth=1.3, transform=trans, zorder=4 if filled else 5)
                    if not filled:
                        for line in eb[2]:
                            line.set_linestyle("--")
                # one entry per setting (its marker) and two for the styles: a legend that stays as wide as the
                # figure however many (k, d) settings there are
                handles.setdefault(f"speculative k={r['k']}, d={r['d']}",
                                   Line2D([], [], color=_SPEC_COLOUR, marker=m, ms=8, ls="none"))
                handles.setdefault("filled, solid: realised (min–max over repeats)",
                                   Line2D([], [], color=_SPEC_COLOUR, marker="o", ms=6, ls="-", lw=1.3))
                handles.setdefault("hollow, dashed: predicted (95 % interval)",
                                   Line2D([], [], color=_SPEC_COLOUR, marker="o", ms=6, mfc="white", ls="--", lw=1.3))
        parts = []
        if p["exits"] is not None:
            parts.append(f"exit: {p['policy']}, batch {p['exit_batch']}")
        if p["spec"] is not None:
            parts.append(f"speculative: batch {p['spec_batch']}")
        ax.set_title(f"{p['model']}\n({'; '.join(parts)})")
        ax.set(xlim=(lo, hi), ylim=(ylo, 103.0))
        ax.xaxis.set_major_locator(FixedLocator(ticks))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}×"))
        if i % ncol == 0:
            ax.set_ylabel("token agreement with\nfull-depth greedy (%)")
        if i // ncol == nrow - 1 or i + ncol >= n:
            ax.set_xlabel("realised speedup over full-depth decoding (log scale)")
            ax.xaxis.set_tick_params(labelbottom=True)
    for k in range(n, nrow * ncol):
        axes[k // ncol, k % ncol].set_visible(False)
    legend_below(fig, handles, ncol=3)
    fig.suptitle("Speed: loop self-speculative decoding (lossless, at 100 %) vs early exit (lossy)" if settings else
                 "Speed: early exit (lossy; no loop self-speculative decoding measured: generate.speculative)")
    return plotting.save(fig, out / "speed.png", dpi)
