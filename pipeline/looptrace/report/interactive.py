"""The report's interactive Pareto view: every test operating point of every rule and seed, with hover
(rule, seed, threshold, mean depth and accuracy with their 95 % bootstrap intervals), legend clicks that toggle a
rule in every panel and seed, and a menu that shows one seed or all. Drawn by Plotly (offline): the page embeds
the figures' JSON and loads ``plotly.min.js`` written beside ``index.html``, so it works from disk with no
server and no network. The PNG figures stay for papers.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import polars as pl

from looptrace.project import split_seed
from looptrace.report.fig_pareto import pareto_highlights
from looptrace.report.inputs import Inputs
from looptrace.report.plotting import GREY, groups_of, tasks_of

#: The Plotly bundle written beside index.html (the page's only script).
PLOTLY_JS = "plotly.min.js"


def _ci(v: float, lo: float | None, hi: float | None, nd: int = 2, scale: float = 1.0) -> str:
    if lo is None or hi is None or not (math.isfinite(lo) and math.isfinite(hi)):
        return f"{scale * v:.{nd}f}"
    return f"{scale * v:.{nd}f} [{scale * lo:.{nd}f}, {scale * hi:.{nd}f}]"


def pareto_figure(inp: Inputs, task: str):
    """The interactive Pareto figure of ``task``: a panel per regime, a trace per rule × seed (legend group = rule,
    so one click toggles the rule everywhere), the rules the report names in colour and the rest grey (hidden
    until clicked: ``legendonly``), and a seed menu.

    Returns:
        a ``plotly.graph_objects.Figure``, or None without Pareto inputs.
    """
    if inp.pareto is None:
        return None
    # lazy: plotly: a large import, needed only by this view
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    groups = groups_of(inp.meta, task)
    names = [m["model"] for _, ms in groups for m in ms]
    sub = inp.pareto.filter(pl.col("model").is_in(names))
    kinds = dict(zip(sub["rule"].to_list(), sub["kind"].to_list(), strict=True))
    ch = inp.chosen.filter(pl.col("model").is_in(names)) if inp.chosen is not None else None
    hl = pareto_highlights(ch, kinds)
    rules = [*hl, *sorted(r for r in kinds if r not in hl)]
    seeds = sorted({s for s in (split_seed(m)[1] for m in names) if s is not None})
    fig = make_subplots(rows=1, cols=len(groups), subplot_titles=[f"{r} ({len(ms)} seeds)" for r, ms in groups],
                        shared_yaxes=True, horizontal_spacing=0.04)
    trace_seed: list[int | None] = []
    for col, (_, models) in enumerate(groups, start=1):
        for m in models:
            seed = split_seed(m["model"])[1]
            p = sub.filter(pl.col("model") == m["model"])
            for rule in rules:
                d = p.filter(pl.col("rule") == rule).sort("mean_depth")
                if not d.height:
                    continue
                role, colour = hl.get(rule, ("other rule", GREY))
                hover = [f"<b>{rule}</b> ({role})<br>{m['model']}<br>threshold {t:.4g}<br>depth "
                         f"{_ci(x, xl, xh)} loops<br>accuracy {_ci(y, yl, yh, 2, 100.0)} %"
                         for t, x, xl, xh, y, yl, yh in zip(
                             d["threshold"].to_list(), d["mean_depth"].to_list(), _col(d, "mean_depth_lo"),
                             _col(d, "mean_depth_hi"), d["accuracy"].to_list(), _col(d, "accuracy_lo"),
                             _col(d, "accuracy_hi"), strict=True)]
                fig.add_trace(go.Scatter(
                    x=d["mean_depth"].to_list(), y=[100 * a for a in d["accuracy"].to_list()],
                    mode="markers" if kinds[rule] == "oracle" else "lines+markers", name=rule, legendgroup=rule,
                    showlegend=col == 1 and m is models[0], line={"color": colour, "width": 2 if rule in hl else 1},
                    marker={"size": 12 if kinds[rule] == "oracle" else 5, "color": colour,
                            "symbol": "star" if kinds[rule] == "oracle" else "circle"},
                    hovertext=hover, hoverinfo="text", visible=True if rule in hl else "legendonly"),
                    row=1, col=col)
                trace_seed.append(seed)
        fig.update_xaxes(title_text="mean exit depth (loops)", row=1, col=col)
    fig.update_yaxes(title_text="test accuracy (%)", row=1, col=1)
    buttons = [{"label": "all seeds", "method": "restyle", "args": [{"opacity": [1.0] * len(trace_seed)}]}]
    for s in seeds:
        buttons.append({"label": f"seed {s}", "method": "restyle",
                        "args": [{"opacity": [1.0 if ts == s else 0.0 for ts in trace_seed]}]})
    fig.update_layout(
        title={"text": f"{task}: every operating point on test (hover for intervals; click a rule to toggle it)",
               "font": {"size": 15}},
        height=470, autosize=True, margin={"l": 60, "r": 20, "t": 80, "b": 40}, hovermode="closest",
        legend={"title": {"text": "rule (click to toggle)"}, "font": {"size": 12}}, font={"size": 13},
        updatemenus=[{"buttons": buttons, "direction": "down", "x": 1.0, "xanchor": "right", "y": 1.16,
                      "yanchor": "top"}] if len(seeds) > 1 else [])
    return fig


def _col(d: pl.DataFrame, c: str) -> list:
    return d[c].to_list() if c in d.columns else [None] * d.height


def interactive_html(inp: Inputs, out_dir: Path) -> str:
    """The HTML of the interactive section (one div per task) and ``plotly.min.js`` written into ``out_dir``;
    empty when there is nothing to show."""
    figs = [(t, pareto_figure(inp, t)) for t in tasks_of(inp.meta)]
    figs = [(t, f) for t, f in figs if f is not None]
    if not figs:
        return ""
    from plotly.offline import get_plotlyjs

    (out_dir / PLOTLY_JS).write_text(get_plotlyjs())
    config = json.dumps({"displaylogo": False, "responsive": True})
    divs = []
    for i, (_, f) in enumerate(figs):  # fixed ids (to_html draws a random one): same params, same bytes
        div = f"pareto-interactive-{i}"
        spec = f.to_json().replace("</", "<\\/")  # JSON inside <script>: no closing tag can end it early
        divs.append(f"<div id='{div}' class='plotly-graph-div' style='height:{f.layout.height}px;width:100%'></div>"
                    f"<script>(function(){{var f={spec};Plotly.newPlot('{div}',f.data,f.layout,{config});}})();"
                    "</script>")
    return "\n".join(divs)
