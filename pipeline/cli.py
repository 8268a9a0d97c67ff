"""The ``looptrace`` Typer app: one command per DVC stage.

Each command is the ``main`` function of ``stages/<name>.py`` (installed as ``looptrace.stages.<name>``), the
same entry DVC runs, so the CLI and ``dvc repro`` execute exactly the same code. Errors a user can fix
(bad params, missing or invalid inputs) print one line and exit with status 2.
"""

from __future__ import annotations

import typer
from looptrace.stages import (
    diagnose,
    dump,
    dynamics,
    gates,
    generate,
    geometry,
    latency,
    readouts,
    report,
    train,
)

app = typer.Typer(name="looptrace", help=__doc__.splitlines()[0], no_args_is_help=True,
                  pretty_exceptions_enable=False, add_completion=False)


@app.callback()
def _root() -> None:
    """looptrace: trajectory diagnostics for adaptive depth in looped transformers."""


def _help(stage) -> str:
    return (stage.main.__doc__ or "").strip().splitlines()[0]


# Pipeline order; each name is the dvc.yaml stage, stages/<name>.py, the params section and artifacts/<name>/.
app.command("train", help=_help(train))(train.main)
app.command("dump", help=_help(dump))(dump.main)
app.command("dynamics", help=_help(dynamics))(dynamics.main)
app.command("geometry", help=_help(geometry))(geometry.main)
app.command("readouts", help=_help(readouts))(readouts.main)
app.command("gates", help=_help(gates))(gates.main)
app.command("diagnose", help=_help(diagnose))(diagnose.main)
app.command("latency", help=_help(latency))(latency.main)
app.command("generate", help=_help(generate))(generate.main)
app.command("report", help=_help(report))(report.main)
