"""The report's page, ``index.html``: headline tables, findings (diagnose's summary.md rendered by Python-Markdown)
and every figure, with relative image paths and no scripts or external resources (it opens offline)."""

from __future__ import annotations

import html
import os
from collections.abc import Sequence
from pathlib import Path

import markdown
import polars as pl
from markdown.treeprocessors import Treeprocessor

from looptrace.report.findings import _nonfinite_text, generate_findings, latency_findings, speed_findings
from looptrace.report.halting_section import (
    FAITH_COLUMNS,
    FAITH_INTRO,
    HALTING_COLUMNS,
    collapse_tol_of,
    faithfulness_groups,
    halting_intro,
    halting_rows,
)
from looptrace.report.headline import (
    HEADLINE_FIGURES,
    _fmt,
    _num,
    generate_table,
    latency_table,
    nonfinite_table,
)
from looptrace.report.inputs import Inputs, ReportConfig
from looptrace.report.interactive import PLOTLY_JS, interactive_html
from looptrace.report.loopmap_section import COLUMNS as LOOPMAP_COLUMNS
from looptrace.report.loopmap_section import INTRO as LOOPMAP_INTRO
from looptrace.report.loopmap_section import TRACE_COLUMNS, TRACE_INTRO, loopmap_rows, trace_rows
from looptrace.report.speed_section import speed_columns, speed_intro, speed_rows


class _ShiftHeadings(Treeprocessor):
    """Headings down ``shift`` levels (at most h6): the page has its own h1 and h2 sections."""

    def __init__(self, md: markdown.Markdown, shift: int):
        super().__init__(md)
        self.shift = shift

    def run(self, root):
        for el in root.iter():
            if el.tag in ("h1", "h2", "h3", "h4", "h5", "h6"):
                el.tag = f"h{min(6, int(el.tag[1]) + self.shift)}"


def markdown_to_html(md: str, shift: int = 1) -> str:
    """Markdown (diagnose's summary.md, the findings' bullets) as HTML, by Python-Markdown with pipe tables.
    Nested bullets are indented by two spaces (``tab_length=2``); raw HTML in the text is escaped, never passed
    through (the text is text); headings are shifted down ``shift`` levels."""
    conv = markdown.Markdown(extensions=["tables"], tab_length=2)
    conv.preprocessors.deregister("html_block")
    conv.inlinePatterns.deregister("html")
    conv.treeprocessors.register(_ShiftHeadings(conv, shift), "looptrace_shift_headings", 1)
    return conv.convert(md)


def _bullets(title: str, sentences: Sequence[str]) -> str:
    """An h3 ``title`` over one bullet per sentence."""
    return markdown_to_html("\n".join([f"# {title}", "", *(f"- {s}" for s in sentences)]), shift=2)


def _table(df: pl.DataFrame, cols: Sequence[tuple[str, str, str | None]]) -> str:
    """HTML table: cols = (column, header, format) with format ``"pct"``, ``"2"`` (decimals) or None."""
    head = "".join(f"<th>{html.escape(h)}</th>" for _, h, _ in cols)
    body = []
    for r in df.iter_rows(named=True):
        cells = []
        for c, _, f in cols:
            v = r.get(c)
            if f == "pct":
                txt = _fmt(100 * _num(v), 2) if v is not None else "—"
            elif f and f.isdigit():
                txt = _fmt(v, int(f))
            elif f == "x":
                txt = _fmt(v, 2, "×")
            elif isinstance(v, bool):
                txt = "yes" if v else "NO"
            else:
                txt = "—" if v is None else str(v)
            cells.append(f"<td>{html.escape(txt)}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    # wrapped: a table wider than the column scrolls inside it, the page never does
    return f"<div class='tw'><table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table></div>"


_CSS = """
body{font-family:-apple-system,Segoe UI,Helvetica,Arial,sans-serif;max-width:1180px;margin:2em auto;padding:0 1em;
color:#222;line-height:1.45}
h1{border-bottom:2px solid #444;padding-bottom:.2em}h2{margin-top:2em;border-bottom:1px solid #bbb}
table{border-collapse:collapse;margin:1em 0;font-size:.9em}th,td{border:1px solid #ccc;padding:.25em .6em;
text-align:left}th{background:#f0f0f0}tr:nth-child(even) td{background:#fafafa}
figure{margin:1.5em 0}figure img{max-width:100%;height:auto;border:1px solid #ddd}figcaption{font-size:.9em;color:#555}
code{background:#f3f3f3;padding:0 .2em}.missing{color:#8a5a00}td:first-child{white-space:nowrap}
table{width:100%;font-size:.85em}td,th{overflow-wrap:break-word}.tw{max-width:100%;overflow-x:auto}
.live{max-width:100%;overflow:hidden}
"""

_CAPTIONS = {
    "accuracy_per_loop": "Test accuracy of the shared readout at every loop t, per task and depth-supervision regime "
                         "(SPEC §5).",
    "step_geometry": "Median step norm ‖Δ_t‖₂ (log scale) and consecutive-step cosine cos(Δ_t, Δ_{t−1}) per loop "
                     "with interquartile bands ([TS], SPEC §2).",
    "convergence": "Mean per-token convergence depth (SPEC §2) by difficulty and by token type; tokens that never "
                   "converge count as T + 1 (censored, dotted line).",
    "failure_classes": "Wrong test tokens per failure class (SPEC §7) at every rule's chosen operating point "
                       "(number = total error %; the rest is correct): trajectory = no loop is right, readout early = "
                       "exited before the first right loop, overthinking = exited after a right loop at a wrong one.",
    "cross_regime": "Offline gates fit on one model's frozen trajectories and applied to another's (SPEC §6).",
    "loopmap": "The loop map by loop (loopmap stage, SPEC §2b): median local contraction ρ_t (top), median "
               "finite-time Lyapunov exponent λ_t (middle), and the median relative effect of a noise intervention "
               "j loops after it with its linearised prediction dashed (bottom); mean over seeds with the 95 % band.",
    "layers": "Per-layer convergence inside the loop (SPEC §2c, models dumped with dump.layers): median relative "
              "step of each stored layer of the looped block by loop (markers) beside the block output h_t (dashed); "
              "mean over seeds with the 95 % band. The settled depths per layer, with bootstrap intervals, are in "
              "artifacts/geometry/<model>/layers.parquet.",
    "heads": "Attention heads across loops (SPEC §2c, models dumped with dump.heads): each head's median Jensen–Shannon "
             "divergence between its attention at loop t and t − 1 (top; nats, log scale) and its median attention "
             "entropy (bottom), one line per head (a line style per layer); mean over seeds with the 95 % band.",
    "loopmap_trace": "Causal tracing across loops (loopmap stage, SPEC §2b [ROME]): the share of the answer's logit "
                     "difference restored when the clean run's state at patched loop k and a position role (the "
                     "substituted token, the tokens between it and the answer, the answer's own position) is copied "
                     "into the corrupted run, mean over seeds; bottom: the share of tokens whose argmax still "
                     "changes after loop d, dotted the mean flip depth, across-seed 95 % band.",
    "latency": "Real early exit (SPEC §8): realised wall-clock speedup against the ideal T / mean exit depth; the "
               "dashed line is 0.8 × ideal.",
    "speed": "Speed, lossless vs lossy (SPEC §8), a panel per model: realised speedup over full-depth decoding (log "
             "scale; dashed line at 1×) against token agreement with full-depth greedy decoding. Circles: early-exit "
             "rules under one KV policy (share when run) at batch size 1 (lossy). Black markers at 100 %: loop "
             "self-speculative decoding per (k, d) at batch size 1, filled = realised with its min–max over repeats, "
             "hollow = predicted from the store with its 95 % interval (dashed); the two are drawn a few points "
             "apart vertically, both are at 100 %.",
}


def halting_html(inp: Inputs) -> list[str]:
    """The page's sections on the halting methods (:mod:`looptrace.report.halting_section`): the matched-compute
    table when diagnose wrote one, the faithfulness tests when diagnose ran them."""
    parts = []
    if inp.halting_table is not None and inp.halting_table.height:
        tol = collapse_tol_of(inp.collapse_tol)
        parts += ["<h2>Halting methods at matched compute</h2>", f"<p>{html.escape(halting_intro(tol))}</p>",
                  _table(halting_rows(inp.halting_table, tol), [(c, h, None) for c, h in HALTING_COLUMNS])]
    if inp.faithfulness is not None and inp.faithfulness.height:
        parts += ["<h2>Counterfactual faithfulness of halting signals</h2>", f"<p>{html.escape(FAITH_INTRO)}</p>",
                  _table(faithfulness_groups(inp.faithfulness), [(c, h, None) for c, h in FAITH_COLUMNS])]
    return parts


def speed_html(inp: Inputs, cfg: ReportConfig) -> list[str]:
    """The page's "Speed: lossless vs lossy" section (:mod:`looptrace.report.speed_section`) when the generate
    stage wrote speculative rows."""
    rows = speed_rows(inp.generate, inp.speculative, inp.meta["model"].to_list(), cfg.speed_agreement)
    if rows is None:
        return []
    return ["<h2>Speed: lossless vs lossy</h2>", f"<p>{html.escape(speed_intro(cfg.speed_agreement))}</p>",
            _table(rows, [(c, h, None) for c, h in speed_columns(cfg.speed_agreement)])]


def render_html(inp: Inputs, cfg: ReportConfig, figures: dict[str, Path], head: pl.DataFrame, out_dir: Path,
                groups: pl.DataFrame | None = None) -> str:
    """The page: headline tables (per task × regime across seeds, and per model; every figure with its 95 %
    interval), findings (diagnose's summary.md + latency sentences) and every figure, with image paths relative
    to ``out_dir``."""
    x = f"{cfg.x:g}"
    figs = [(f"{n}_text", h.format(x=x), None) for n, h, _ in HEADLINE_FIGURES]
    live = interactive_html(inp, out_dir)  # writes plotly.min.js beside the page when there is a view
    script = f"<script src='{PLOTLY_JS}'></script>" if live else ""
    parts = [f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>{html.escape(cfg.title)}</title>"
             f"<meta name='viewport' content='width=device-width'><style>{_CSS}</style>{script}</head><body>", f"<h1>{html.escape(cfg.title)}</h1>",
             f"<p>{inp.meta.height} models; every number below is read from the pipeline's artifacts, as "
             f"<code>estimate [lo, hi]</code> (95 % interval; figures whose intervals overlap are within noise). "
             f"D@{x} = the smallest mean exit depth (loops) whose test accuracy ≥ {x} %, threshold picked on test "
             "labels (oracle-threshold); \"not reached\" = no operating point reaches it, \"not run\" = no such "
             "rule. Best rules are chosen on validation. The same tables, with the machine and versions, are in "
             "<code>summary.md</code> beside this page.</p>"]
    if groups is not None and groups.height:
        parts += ["<h2>Headline per task × regime (across seeds)</h2>",
                  "<p>Mean over training seeds with the Student-t 95 % interval on the logit scale of the "
                  "figure's range (accuracy within [0, 100] %, depths within [1, T]); one seed: its bootstrap "
                  "interval. A verdict is decided only when the paired per-seed comparisons decide it, else "
                  "<em>undecided</em>, with the per-seed verdicts and the seeds that would decide.</p>",
                  _table(groups, [("group", "task × regime", None), ("regime_kind", "regime", None),
                                  ("n_seeds", "seeds", None), ("best_posthoc_rules", "best post-hoc rule(s)", None),
                                  *figs, ("verdict_text", "verdict", None)])]
    if live:
        parts += ["<h2>Pareto fronts, interactive</h2>",
                  "<p>Every test operating point of every rule and seed: hover a point for its rule, threshold, mean "
                  "depth and accuracy with their 95 % bootstrap intervals; click a rule in the legend to show or hide "
                  "it (grey rules start hidden); the menu shows one seed or all. Drawn offline by Plotly; the PNG "
                  "figures below are the same data for papers.</p>", f"<div class='live'>{live}</div>"]
    parts += ["<h2>Headline per model</h2>",
              "<p>95 % bootstrap intervals over test sequences.</p>",
              _table(head, [("model", "model", None), ("regime_kind", "regime", None),
                            ("best_posthoc_rule", "best post-hoc rule", None), *figs,
                            ("best_gate_rule", "best refit gate", None), ("verdict", "verdict", None),
                            ("reason", "reason", None)])]
    if inp.latency is not None and inp.latency.height:
        lt, lcols = latency_table(inp.latency, inp.meta)
        parts += ["<h2>Real early exit</h2>",
                  "<p>Wall time of real early exit (loops stop; finished sequences leave the batch) against full "
                  "depth, at each rule's chosen point. Ideal = T / mean exit depth (SPEC §8); exact-causal ideal = "
                  "the best any exit that reproduces the offline evaluation can do under causal attention "
                  "(docs/latency.md).</p>", _table(lt, lcols)]
    if inp.generate is not None and inp.generate.height:
        gt, gcols = generate_table(inp.generate, inp.meta)
        parts += ["<h2>Generation with early exit</h2>",
                  "<p>Greedy decoding token by token: each new token loops until its rule fires; the KV policy says "
                  "what later tokens see at the loops it skipped (share = copy of the exit loop's keys/values, "
                  "Huginn's; recompute = computed, no saving, exact cache; native = the model's own). Realised = "
                  "wall time of full-depth decoding / early exit in the same run; ideal = T / mean exit depth; "
                  "agreement and loss gap against full-depth greedy decoding (docs/generate.md).</p>",
                  _table(gt, gcols)]
    parts += speed_html(inp, cfg)
    parts += halting_html(inp)  # the halting methods' table and the faithfulness tests
    if inp.loopmap is not None:  # the loopmap stage's regime, certified exit and windows per model
        parts += ["<h2>Loop map</h2>", f"<p>{html.escape(LOOPMAP_INTRO)}</p>",
                  _table(loopmap_rows(inp.loopmap), [(c, h, None) for c, h in LOOPMAP_COLUMNS])]
        tr = trace_rows(inp.loopmap)
        if tr is not None:
            parts += ["<h3>Causal tracing across loops and answer flips</h3>", f"<p>{html.escape(TRACE_INTRO)}</p>",
                      _table(tr, [(c, h, None) for c, h in TRACE_COLUMNS])]
    if inp.loop_summary is not None:
        inf = nonfinite_table(inp.loop_summary)
        parts += ["<h2>Non-finite values</h2>", f"<p>{html.escape(_nonfinite_text(inf))}</p>"]
        if inf is not None and inf.height:
            parts.append(_table(inf, [("model", "model", None), ("metric", "metric", None),
                                      ("n_inf", "±∞ left out", None), ("loops", "at loops", None),
                                      ("n_nan", "NaN left out", None)]))
    parts.append("<h2>Findings</h2>")
    lf = latency_findings(inp.latency, inp.latency_metrics)
    if lf:
        parts.append(_bullets("Latency", lf))
    gf = generate_findings(inp.generate, inp.generate_metrics)
    if gf:
        parts.append(_bullets("Generation", gf))
    sf = speed_findings(inp.generate, inp.speculative, inp.meta["model"].to_list(), cfg.speed_agreement)
    if sf:
        parts.append(_bullets("Speed: lossless vs lossy", sf))
    if inp.summary:
        parts.append(markdown_to_html(inp.summary, shift=2))
    else:
        parts.append("<p class='missing'>No diagnosis yet (artifacts/diagnose/summary.md): run the diagnose stage.</p>")
    parts.append("<h2>Figures</h2>")
    for name, path in figures.items():
        rel = os.path.relpath(path, out_dir).replace(os.sep, "/")
        cap = _CAPTIONS.get(name) or (f"Pareto fronts of task {name[len('pareto_'):]}, a panel per regime, seeds "
                                      "averaged: test accuracy vs mean exit depth. In colour the rules the text names "
                                      "(fixed depth, oracle star, native gate, each seed's val-chosen best post-hoc "
                                      "rule and best refit gate, user rules), every other rule grey; hollow circles "
                                      "are the coloured rules' chosen points with 95 % intervals as error bars.")
        parts.append(f"<figure><img src='{html.escape(rel, quote=True)}' alt='{html.escape(name, quote=True)}'>"
                     f"<figcaption>{html.escape(cap)}</figcaption></figure>")
    if inp.missing:
        parts.append("<h2>Not shown</h2><ul class='missing'>" + "".join(
            f"<li><code>{html.escape(k)}</code>: {html.escape(v)}</li>" for k, v in sorted(inp.missing.items())) + "</ul>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"
