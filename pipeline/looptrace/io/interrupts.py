"""Interrupts (Ctrl-C, SIGTERM) and a stage's commit point: the exit status says which came first.

A stage *commits* its output at one moment: the atomic swap of the directory it holds under
:func:`looptrace.io.claims.stage_output` (:func:`looptrace.io.artifacts.swap_in`; a stage with nothing to swap
commits when its body returns, :func:`guarded`), or, for the dump (Zarr stores written in place
under claims), when its share of every store is written and verified (:func:`mark_committed`). The stage launcher
(:func:`looptrace.errors.launch`) installs :func:`on_signal` for SIGINT and SIGTERM, so that:

- a signal **before** the commit raises ``KeyboardInterrupt`` where the stage is: its staging directory is removed,
  its claims are released, the previous output is left as it was; the stage exits ``128 + signum`` (130 for Ctrl-C,
  143 for SIGTERM) with one line saying it stopped before committing;
- a signal **during** the swap's renames is held until they are done, then handled as before or after the commit
  (a swap is never half-reported);
- a signal **after** the commit is only noted: the stage finishes its tidy-up (claims released, summary printed)
  and keeps its own exit status (0), with one line saying it finished before the interrupt;
- a signal after the launcher has settled the exit status changes nothing (one line says so); from the interpreter's
  exit handlers on, the two signals are ignored, so no late signal can turn a settled status into death by signal.

A signal raises only inside the stage's body (its ``main``, wrapped by :func:`guarded` when the entry registers):
one that arrives while Typer parses the command line stops the body as it starts; one that arrives after the body
returned (the launcher settling the status) is noted. A body that returns normally has committed.

Without the launcher (library use, tests calling a stage in-process) no handler is installed and the state here is
only bookkeeping.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

#: The signals a stage turns into an orderly stop (Ctrl-C; SIGTERM from ``kill``, a batch system or torchrun).
SIGNALS = (signal.SIGINT, signal.SIGTERM)


#: What an interrupt before an atomic swap leaves (the staging directory is removed, the old output stays).
UNCHANGED = "the previous output, if any, is unchanged; re-run the stage to produce it"


@dataclass
class _State:
    """This process's stage, as far as interrupts are concerned (one stage per process)."""

    name: str = "looptrace"  # the stage (or command) named in the lines
    output: str | None = None  # the output the stage commits, as the user named it
    key: str | None = None  # its absolute path (what a swap's target is compared with)
    left: str = UNCHANGED  # what an interrupt before the commit leaves there, in words
    committed: bool = False
    signum: int | None = None  # the first SIGINT/SIGTERM received
    armed: bool = False  # on_signal is installed (the launcher runs this process's stage)
    in_body: int = 0  # > 0 while the stage's body runs: only there does a signal raise
    holding: int = 0  # > 0 while a swap's renames run: a signal then waits for them
    held: bool = False  # a signal arrived while holding
    settled: int | None = None  # the exit status, once the launcher has settled it
    late_said: bool = False


_STATE = _State()
_ATEXIT = [False]


def state() -> _State:
    """The current state (read-only use: tests and the launcher)."""
    return _STATE


def reset(name: str = "looptrace") -> None:
    """Forget everything: a new stage ``name`` starts (the launcher; tests)."""
    global _STATE
    _STATE = _State(name=name)


def _abs(path: str | os.PathLike) -> str | None:
    s = os.fspath(path)
    return None if "://" in s else os.path.realpath(s)


def expect_commit(out_dir: str | os.PathLike, left: str = UNCHANGED) -> None:
    """The stage will commit ``out_dir`` (its swap is the commit point); called by ``stage_output``.

    Args:
        out_dir: the output, as the user named it (a directory, or a store URL).
        left: what an interrupt before the commit leaves at ``out_dir``, in words (the line says it).
    """
    _STATE.output, _STATE.key, _STATE.left, _STATE.committed = os.fspath(out_dir), _abs(out_dir), left, False


def mark_committed() -> None:
    """The stage's output is committed (whole and final); a later signal no longer interrupts it."""
    _STATE.committed = True


def interrupted() -> bool:
    """Whether a signal arrived before the stage committed (whatever error follows is its consequence)."""
    return _STATE.signum is not None and not _STATE.committed


@contextlib.contextmanager
def committing(out_dir: str | os.PathLike) -> Iterator[None]:
    """Around a swap's renames into ``out_dir``: a signal waits for them; the swap of the directory the stage holds
    (:func:`expect_commit`) commits the stage. A signal that waited is raised after the renames when the stage has
    not committed (a swap of a sub-directory, or of another directory)."""
    _STATE.holding += 1
    done = False
    try:
        yield
        done = True
    finally:
        if done and _STATE.key is not None and _abs(out_dir) == _STATE.key:
            _STATE.committed = True
        _STATE.holding -= 1
        if done and _STATE.held and not _STATE.holding and not _STATE.committed and _STATE.settled is None:
            _STATE.held = False
            raise KeyboardInterrupt(signal.Signals(_STATE.signum or signal.SIGINT).name)


def guarded(name: str, main: Callable[..., Any]) -> Callable[..., Any]:
    """``main`` (a stage's Typer command) as the stage's body: where a signal may stop it (module docstring). The
    wrapper keeps ``main``'s signature, docstring and module (Typer reads the options from them)."""

    @functools.wraps(main)
    def body(*args: Any, **kwargs: Any) -> Any:
        st = _STATE
        st.name = name
        if st.armed and st.signum is not None and not st.committed:  # arrived while the command line was parsed
            raise KeyboardInterrupt(signal_name(st.signum))
        st.in_body += 1
        try:
            out = main(*args, **kwargs)
        finally:
            st.in_body -= 1
        st.committed = True  # the body returned: everything it writes is written
        return out

    return body


def signal_name(signum: int) -> str:
    """``SIGINT``, ``SIGTERM``."""
    return signal.Signals(signum).name


def on_signal(signum: int, frame) -> None:
    """The SIGINT/SIGTERM handler of a stage process (module docstring: before, during, after the commit)."""
    st = _STATE
    if st.signum is None:
        st.signum = signum
    if st.settled is not None:
        if not st.late_said:  # os.write: a handler may run inside a buffered write of sys.stderr
            st.late_said = True
            with contextlib.suppress(OSError):
                os.write(2, f"{st.name}: finished before the interrupt ({signal_name(signum)}); exit status "
                            f"{st.settled} stands\n".encode())
        return
    if st.committed or not st.in_body:
        return
    if st.holding:
        st.held = True
        return
    raise KeyboardInterrupt(signal_name(signum))


def install() -> bool:
    """Install :func:`on_signal` for SIGINT and SIGTERM; False (nothing installed) outside the main thread."""
    try:
        for s in SIGNALS:
            signal.signal(s, on_signal)
    except ValueError:  # signal.signal only works in the main thread
        return False
    _STATE.armed = True
    if not _ATEXIT[0]:
        _ATEXIT[0] = True
        atexit.register(_ignore_from_now_on)
    return True


def _ignore_from_now_on() -> None:
    """At interpreter exit: the interpreter puts back the default action of a Python-level handler when it
    finalises, which would let a signal in its last moments end the process by the signal after the status was
    settled; ignoring them at the OS level keeps the settled status."""
    if _STATE.settled is None:
        return
    with contextlib.suppress(ValueError, OSError):
        for s in SIGNALS:
            signal.signal(s, signal.SIG_IGN)


def settle(code: int) -> tuple[int, str | None]:
    """The exit status the stage ends with and the one line that says what an interrupt did (None without one).

    A stage interrupted before its commit exits ``128 + signum`` whatever it was doing; one that committed first
    keeps its own status (0 when it finished normally). From here on a signal changes nothing.

    Args:
        code: the status the stage's command ended with (a ``KeyboardInterrupt`` that reached the launcher: 130).
    """
    st = _STATE
    line = None
    if st.signum is not None:
        sig = signal_name(st.signum)
        what = st.output if st.output is not None else "its output"
        if st.committed:
            line = f"{st.name}: finished before the interrupt ({sig}): {what} is committed and complete"
        else:
            code = 128 + st.signum
            line = f"interrupted ({sig}) before {st.name} committed {what}: {st.left}"
        st.late_said = True  # one line per run: a further signal is not reported again
    st.settled = code
    return code, line


__all__ = ["SIGNALS", "committing", "expect_commit", "guarded", "install", "interrupted", "mark_committed", "on_signal",
           "reset", "settle", "signal_name", "state"]
