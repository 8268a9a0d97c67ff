"""Shared plumbing of the stage entries: user-facing errors become one line and exit code 2."""

from __future__ import annotations

import contextlib
import sys

import typer
from looptrace.config import ConfigError, UserError  # noqa: F401  (UserError re-exported for the stages)


@contextlib.contextmanager
def user_errors():
    """Turn configuration and input errors into a one-line message and exit status 2."""
    try:
        yield
    except (ConfigError, UserError, FileNotFoundError, ValueError) as exc:
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        typer.echo(f"error: {msg}", err=True)
        raise typer.Exit(code=2) from None


def run(main) -> None:
    """``python stages/<name>.py ...``: run a stage's ``main`` under Typer."""
    sys.argv[0] = main.__module__
    typer.run(main)
