"""looptrace: trajectory diagnostics for adaptive depth in looped transformers.

The library is packaged by concern (docs/DESIGN.md draws the module graph): ``config`` and ``project``
(params, the model list, versions), ``io`` (the Zarr store, state precision, atomic artifacts, tables),
``signals`` (per-loop signals, each defined once), ``rules`` (exit rules and their scoring), ``models`` (the
looped transformer, regimes, training, the model interface and adapters for real checkpoints), ``capture``
(dump and training dynamics: the only analysis-side code that runs a model), ``geometry``, ``gates``,
``diagnose``, ``online`` (real early exit and latency) and ``report``; the tests' tiny builders live in
``tests/builders.py``, outside the package (not in the wheel). It lives in ``pipeline/looptrace/`` (import path = file path); each stage's entry is ``looptrace.stages.<name>``,
which DVC runs through the thin launcher ``stages/<name>.py`` and ``looptrace.cli`` registers as a command of the
``looptrace`` Typer app.
"""

__version__ = "0.1.0"
