"""looptrace: trajectory diagnostics for adaptive depth in looped transformers.

The library is packaged by concern: ``model`` (the looped transformer), ``tasks`` (synthetic data),
``regimes`` (depth supervision), ``train``, ``store`` (the only module that touches Zarr),
``dump``, ``geometry``, ``readouts``, ``gates``, ``diagnose``, ``latency``, ``report`` and
``adapters`` (real checkpoints). Stage entry points live in ``stages/``; ``pipeline.cli`` gathers
them into the ``looptrace`` Typer app.
"""

__version__ = "0.1.0"
