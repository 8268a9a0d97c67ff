"""The ``report`` stage: figures, headline tables and findings of a looptrace run, as PNGs and one
offline HTML page (SPEC §10: ``artifacts/report/index.html``, ``figures/*.png``).

Everything shown is read from the other stages' artifacts (never recomputed from trajectories):

| figure | input |
|---|---|
| per-loop accuracy by regime | ``readouts/<model>/metrics.json`` (``test_accuracy_per_loop``) |
| step norm and step cosine by loop | ``geometry/<model>/loop_summary.parquet`` |
| convergence depth by difficulty and token type | ``geometry/<model>/convergence.parquet`` (+ loop_summary for names) |
| Pareto fronts per task | ``readouts/<model>/pareto.parquet``, ``chosen.parquet``, ``gates/<model>/pareto.parquet`` |
| failure classes | ``diagnose/failure_classes.parquet`` |
| cross-regime gate matrix | ``gates/cross_regime.parquet`` |
| realised vs ideal speedup | ``latency/latency.parquet`` |
| generation with early exit (table, findings) | ``generate/generate.parquet``, ``generate/metrics.json`` |
| speed, lossless vs lossy: speculative decoding beside early exit (figure, table, findings) | ``generate/speculative.parquet`` (opt-in ``generate.speculative``), ``generate/generate.parquet`` |

A figure whose inputs are missing is left out and the page says which stage to run, so the report
works on partial pipelines (the tests build tiny constructed outputs). The page uses relative image
paths and no scripts or external resources, so it opens offline from the file system.

The package, one concern per module: ``inputs`` (``ReportConfig``, what is read), ``figures`` (the PNGs: one
module per figure family, ``fig_*``, on ``plotting``), ``headline`` (the tables' numbers and metrics.json),
``findings`` (sentences and summary.md), ``halting_section``, ``loopmap_section`` and ``speed_section`` (those
sections' tables), ``interactive`` (the Plotly view), ``dvcplots`` (DVC plots), ``page`` (index.html);
:func:`build_report` here runs them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from looptrace.io.artifacts import atomic_dir
from looptrace.io.artifacts import jsonable as _jsonable
from looptrace.project import machine, versions
from looptrace.report.dvcplots import write_dvc_plots
from looptrace.report.figures import make_figures
from looptrace.report.findings import run_summary_markdown
from looptrace.report.headline import group_headline, headline, report_metrics
from looptrace.report.inputs import ReportConfig, load_inputs
from looptrace.report.page import render_html

__all__ = ["ReportConfig", "build_report"]


def build_report(models: Sequence[str], root: Path | str, out_dir: Path | str, cfg: ReportConfig,
                 meta: dict | None = None) -> dict:
    """The ``report`` stage: read the artifacts, draw the figures, write index.html, summary.md and metrics.json.

    ``summary.md`` and metrics.json record the machine and the date of the run (:func:`looptrace.project.machine`;
    ``SOURCE_DATE_EPOCH`` fixes the date), so those two bytes differ between runs; index.html and the figures
    depend on the artifacts only.

    Everything is written into a temporary sibling directory that replaces ``out_dir`` at the end.

    Args:
        models: model names.
        root: the artifacts root (``artifacts``).
        out_dir: ``artifacts/report``.
        cfg: the ``report`` section.
        meta: extra metrics.json entries (versions, params).

    Returns:
        The metrics dict as written (NaN = unreachable/absent written as None).
    """
    out_dir = Path(out_dir)
    inp = load_inputs(models, root, cfg)
    head = headline(inp, cfg)
    groups = group_headline(head, inp)
    mach = machine()
    with atomic_dir(out_dir) as tmp:
        figs = make_figures(inp, cfg, tmp / "figures")
        (tmp / "index.html").write_text(render_html(inp, cfg, figs, head, tmp, groups))
        (tmp / "summary.md").write_text(run_summary_markdown(head, groups, inp, cfg, mach,
                                                             (meta or {}).get("versions") or versions(), inp.claims))
        metrics = _jsonable({**report_metrics(head, inp, cfg, figs, groups), "machine": mach,
                             **(meta or {})})  # NaN -> null
        (tmp / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
        write_dvc_plots(inp, groups, tmp)  # plots/*.json and headline.json for dvc plots diff / dvc exp show
    return metrics
