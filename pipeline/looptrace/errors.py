"""Shared plumbing of the stage entries: user errors become one line and exit 2, bugs keep their traceback.

A :class:`~looptrace.config.UserError` (ConfigError, InputError, CheckpointLoadError, StoreError, ClaimError ...) is
raised where the cause is known and names the key or file and the fix: it prints as ``error: <one line>`` and the
stage exits with status 2. An operating-system refusal that names its file (a missing file, permission denied,
disk full) is the user's to fix as well and prints the same way. Anything else is a bug in looptrace: it prints a
short message naming a log file that holds the traceback (``$LOOPTRACE_LOG_DIR``, default the system temporary
directory) and exits with status 1.

A stage run as a program (:func:`run` for ``stages/<name>.py``, the ``looptrace`` CLI) goes through :func:`launch`:
a Ctrl-C or SIGTERM before the stage committed its output exits 130 or 143 with one line, one after it exits with
the stage's own status and one line saying it finished first (:mod:`looptrace.io.interrupts`).
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import typer

from looptrace.config import (  # noqa: F401  (the error family, re-exported for the stages)
    CheckpointLoadError,
    ConfigError,
    InputError,
    MissingInputError,
    UserError,
)
from looptrace.io import interrupts

#: Exit status of a user error (bad params, a missing or damaged input) and of a bug.
USER_EXIT, BUG_EXIT = 2, 1
#: OS errors the user fixes (the message names the file): missing file, permission, disk full, read-only fs.
_ENV_ERRNOS = {errno.ENOENT, errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EROFS, errno.EDQUOT, errno.EISDIR,
               errno.ENOTDIR, errno.ELOOP, errno.ENAMETOOLONG}
#: What to check, for the OS errors whose message does not say it.
_ENV_HINTS = {errno.ELOOP: "the path goes through a symlink loop: fix or remove the link, or pick another path",
              errno.ENAMETOOLONG: "a path component is longer than the filesystem allows (255 bytes on most): use a "
                                  "shorter name"}


def one_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type name when empty)."""
    msg = str(exc).strip()
    return msg.splitlines()[0] if msg else type(exc).__name__


def bug_log_dir() -> Path:
    """Where bug tracebacks are written: ``$LOOPTRACE_LOG_DIR`` or the system temporary directory."""
    return Path(os.environ.get("LOOPTRACE_LOG_DIR") or tempfile.gettempdir())


def _write_bug_log(exc: BaseException) -> Path | None:
    try:
        d = bug_log_dir()
        d.mkdir(parents=True, exist_ok=True)
        path = d / f"looptrace-bug-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
        path.write_text(f"looptrace {' '.join(sys.argv)}\n\n" + "".join(traceback.format_exception(exc)))
        return path
    except OSError:
        return None


class _PipeSafeRaw(io.RawIOBase):
    """fd 1 that swallows EPIPE: once the reader has gone (``| head -1``), further output is dropped."""

    def __init__(self, fd: int):
        super().__init__()
        self.fd, self.broken = fd, False

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self.fd

    def write(self, b) -> int:
        if not self.broken:
            try:
                return os.write(self.fd, b)
            except BrokenPipeError:
                self.broken = True
        return len(b)


def pipe_safe_stdout() -> None:
    """A closed stdout never changes a stage's exit status or outputs: the process's real stdout is
    replaced by one that drops what the reader no longer wants, as ``cat``-style tools do when their reader closes
    early, instead of the exit status 1 click gives a BrokenPipeError. Idempotent; a captured stdout (tests) is
    left alone."""
    out = sys.stdout
    if out is None or out is not sys.__stdout__:
        return
    assert out is not None  # narrowing by `is sys.__stdout__` (Optional) brings None back
    try:
        fd = out.fileno()
        out.flush()
    except (OSError, ValueError):
        return
    _REPLACED.append(out)  # kept alive: closing it would close fd 1
    sys.stdout = io.TextIOWrapper(io.BufferedWriter(_PipeSafeRaw(fd)), encoding=out.encoding, errors=out.errors,
                                  line_buffering=True, write_through=True)


_REPLACED: list = []


@contextlib.contextmanager
def user_errors():
    """Report errors of a stage body: a user error as one line and exit 2, a bug with its traceback and exit 1.

    After a Ctrl-C or SIGTERM that arrived before the stage committed (:mod:`looptrace.io.interrupts`), whatever
    fails is the interrupt's consequence (a worker process stopped by the same Ctrl-C, a pipe closed): it is
    reported as the interrupt (exit 130 or 143), not as a bug."""
    pipe_safe_stdout()
    try:
        yield
    except (typer.Exit, typer.Abort, KeyboardInterrupt, SystemExit):
        raise
    except Exception as exc:
        if interrupts.interrupted():
            raise KeyboardInterrupt(interrupts.signal_name(interrupts.state().signum or signal.SIGINT)) from exc
        if isinstance(exc, UserError):
            typer.echo(f"error: {one_line(exc)}", err=True)
            raise typer.Exit(code=USER_EXIT) from None
        if isinstance(exc, OSError):
            if exc.errno not in _ENV_ERRNOS:
                _bug(exc)
            where = f" ({exc.filename})" if exc.filename and str(exc.filename) not in str(exc) else ""
            hint = f"; {_ENV_HINTS[exc.errno]}" if exc.errno in _ENV_HINTS else ""
            typer.echo(f"error: {one_line(exc)}{where}{hint}", err=True)
            raise typer.Exit(code=USER_EXIT) from None
        env = environment_fault(exc)  # else a bug: keep the traceback
        if env is None:
            _bug(exc)
        typer.echo(f"error: {env}", err=True)
        raise typer.Exit(code=USER_EXIT) from None


def _chain(exc: BaseException | None):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _urls(exc: BaseException, scheme: str) -> list[str]:
    """The ``scheme://`` URL looptrace was working on when ``exc`` was raised: the string or path arguments of the
    innermost looptrace frame that held one (a ``Path`` keeps ``s3:/bucket``: written back as ``s3://bucket``)."""
    found: list[str] = []
    tb = exc.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_globals.get("__name__", "").startswith("looptrace"):
            here = []
            for v in frame.f_locals.values():
                if isinstance(v, str | os.PathLike) and str(v).startswith(f"{scheme}:/"):
                    s = str(v)
                    here.append(s if s.startswith(f"{scheme}://") else f"{scheme}://" + s[len(scheme) + 2:])
            found = here or found
        tb = tb.tb_next
    return found[:1]


#: botocore's errors that mean "no usable credentials" (matched by name: botocore is optional).
_NO_CREDENTIALS = {"NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError",
                   "NoAuthTokenError", "UnauthorizedSSOTokenError"}
_BAD_CREDENTIALS = {"InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken"}


def environment_fault(exc: BaseException) -> str | None:
    """The one-line message of an exception that is the environment's fault and the user's to fix,
    or None: S3 without (valid) credentials."""
    for e in _chain(exc):
        name, mod = type(e).__name__, type(e).__module__
        code = (getattr(e, "response", None) or {}).get("Error", {}).get("Code") if mod.startswith("botocore") else None
        if (mod.startswith("botocore") and name in _NO_CREDENTIALS) or code in _BAD_CREDENTIALS:
            urls = next((u for x in _chain(exc) if (u := _urls(x, "s3"))), [])
            what = f"s3 store {', '.join(urls)}" if urls else "an s3:// store"
            problem = "no AWS credentials found" if code is None else f"the AWS credentials were refused ({code})"
            return (f"{what}: {problem} ({one_line(e)}); set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or "
                    "AWS_PROFILE / ~/.aws/credentials, for that bucket (or use a local path)")
    return None


def _bug(exc: BaseException) -> None:
    log = _write_bug_log(exc)
    if log is None:  # nowhere to keep it: the traceback goes to stderr instead
        typer.echo("".join(traceback.format_exception(exc)).rstrip(), err=True)
    where = f"; traceback in {log}" if log else "; traceback above"
    typer.echo(f"internal error (a bug in looptrace, not in your input): {type(exc).__name__}: {one_line(exc)}"
               f"{where} — please report it", err=True)
    raise typer.Exit(code=BUG_EXIT) from None


def _status(code: object) -> int:
    """The process exit status ``sys.exit(code)`` gives (None: 0; an int: itself; anything else: printed, 1)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    typer.echo(str(code), err=True)
    return 1


def launch(command: Callable[[], object], name: str) -> NoReturn:
    """Run a stage's Typer ``command`` (it ends with ``SystemExit``) and exit with a status that says what happened.

    SIGINT and SIGTERM go through :func:`looptrace.io.interrupts.on_signal`: before the stage commits its output
    they stop it (exit ``128 + signum``: 130 for Ctrl-C, 143 for SIGTERM, one line saying so); after the commit
    the stage finishes and exits with its own status (0) and one line saying it finished before the interrupt
    (docs/bad-inputs.md, "Interrupts").

    Args:
        command: runs the Typer app in standalone mode (``typer.run(main)``, ``app()``).
        name: the stage (or command) named in the lines.
    """
    interrupts.reset(name)
    interrupts.install()
    try:
        command()
        code = 0
    except SystemExit as exc:  # Typer's standalone mode always ends so (its KeyboardInterrupt: status 130)
        code = _status(exc.code)
    except KeyboardInterrupt:  # a signal raises only in the stage's body, which Typer wraps: not expected here
        code = 128 + signal.SIGINT
    code, line = interrupts.settle(code)
    if line is not None:
        typer.echo(line, err=True)
    sys.exit(code)


def run(main) -> None:
    """``python stages/<name>.py ...``: run a stage's ``main`` under Typer, through :func:`launch`."""
    sys.argv[0] = main.__module__
    launch(lambda: typer.run(main), main.__module__.rsplit(".", 1)[-1])
