"""The ``looptrace`` Typer app: one command per DVC stage.

Each command is the ``main`` function of ``stages/<name>.py`` (the same entry DVC runs), so the
CLI and ``dvc repro`` execute exactly the same code. Errors a user can fix (bad params, missing or
invalid inputs) print one line and exit with status 2.
"""

from __future__ import annotations

import importlib

import typer

# Stage names, in pipeline order; each is dvc.yaml stage, stages/<name>.py, params section and
# artifacts/<name>/.
STAGES = ["train", "dump", "geometry", "readouts", "gates", "diagnose", "latency", "report"]

app = typer.Typer(name="looptrace", help=__doc__.splitlines()[0], no_args_is_help=True,
                  pretty_exceptions_enable=False, add_completion=False)



@app.callback()
def _root() -> None:
    """looptrace: trajectory diagnostics for adaptive depth in looped transformers."""


for _name in STAGES:
    _mod = importlib.import_module(f"stages.{_name}")
    app.command(_name, help=(_mod.main.__doc__ or "").strip().splitlines()[0])(_mod.main)
