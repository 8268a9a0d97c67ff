"""Where the offline stages' per-chunk work runs: in this process (the default), or as Dask tasks.

``base.dask.scheduler`` (:class:`looptrace.config.DaskConfig`) picks it: ``null`` runs every chunk in this
process, exactly the loop the stages always had (``dask`` is never imported); ``local`` starts a
``distributed.LocalCluster`` of ``base.dask.workers`` single-threaded worker processes on 127.0.0.1 for the
duration of the stage; any other value is the address of a running scheduler (``tcp://host:8786``: a
``dask-jobqueue`` or Kubernetes cluster), which the stage connects to and leaves running. The environment
variable ``LOOPTRACE_DASK_SCHEDULER`` overrides the params value (a cluster's address changes from job to
job; the outputs do not depend on where they were computed, so it need not be part of DVC's params).

Model of execution (docs/DESIGN.md, "Execution"): one task per store chunk (:func:`map_chunks`) or per
independent item (a rule, a model: :func:`map_tasks`), submitted with ``client.submit`` ahead of the
consumer by at most ``max_in_flight`` tasks, and consumed **in submission order** by the same code that
consumes the in-process loop (Parquet writers, summary scratch columns, accumulators). A task runs the same
function on the same inputs as the in-process loop, so every output is byte-identical; nothing is reduced
on the workers. A worker opens a store itself from its path or URL (``TrajectoryStore.target``), once per
worker process; a store must therefore be on a path or URL the workers can read (not a ``MemoryStore``).
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from looptrace import project
from looptrace.config import UserError

#: Environment variable that overrides ``base.dask.scheduler`` (``null`` forces in-process).
SCHEDULER_ENV = "LOOPTRACE_DASK_SCHEDULER"


def scheduler_of(cfg: Any) -> str | None:
    """The scheduler to use: ``$LOOPTRACE_DASK_SCHEDULER`` when set, else ``cfg.scheduler`` (None = in-process).

    Args:
        cfg: a :class:`looptrace.config.DaskConfig` (or None).
    """
    env = os.environ.get(SCHEDULER_ENV, "").strip()
    if env:
        return None if env.lower() in ("null", "none") else env
    return getattr(cfg, "scheduler", None)


class DaskRunner:
    """A ``distributed.Client`` plus the bounded window of tasks submitted ahead of the consumer.

    Args:
        client: a connected ``distributed.Client``.
        max_in_flight: tasks submitted but not yet consumed (None = 2 × the cluster's worker threads, so
            every worker has its next task queued while the client consumes the oldest result).
    """

    def __init__(self, client: Any, max_in_flight: int | None = None):
        self.client = client
        self._max_in_flight = max_in_flight

    @property
    def max_in_flight(self) -> int:
        if self._max_in_flight:
            return int(self._max_in_flight)
        return max(2, 2 * sum(self.client.nthreads().values()))

    def __repr__(self) -> str:
        return f"DaskRunner({self.client.scheduler.address}, max_in_flight={self.max_in_flight})"

    def ordered(self, fn: Callable, args_list: Iterable[tuple]) -> Iterator[Any]:
        """``fn(*args)`` for each args tuple as tasks, results yielded in submission order.

        At most ``max_in_flight`` tasks are outstanding: a result is consumed before the next task is
        submitted once the window is full, so the client never holds more than the window's results. A
        task's exception is re-raised here (its own type and message). Closing the iterator early cancels the
        tasks still outstanding.
        """
        yield from _in_order(lambda *args: self.client.submit(fn, *args, pure=False), args_list,
                             self.max_in_flight)

    def share(self, value: Any) -> Any:
        """Send ``value`` to the cluster once; the returned future can be passed to many tasks."""
        [fut] = self.client.scatter([value], hash=False)
        return fut


@contextmanager
def dask_runner(cfg: Any) -> Iterator[DaskRunner | None]:
    """The runner of ``cfg`` (``base.dask``) for the duration of a stage; None when it runs in-process.

    ``local``: ``LocalCluster(n_workers=cfg.workers or os.cpu_count(), threads_per_worker=1, processes=True,
    host="127.0.0.1", dashboard_address=":0")`` (loopback only, a free dashboard port, so concurrent stages or
    tests never collide), closed at the end. An address: ``Client(address)``; the cluster is left running.
    """
    scheduler = scheduler_of(cfg)
    if scheduler is None:
        yield None
        return
    from distributed import Client, LocalCluster

    cluster = None
    if scheduler == "local":
        cluster = LocalCluster(n_workers=int(getattr(cfg, "workers", None) or os.cpu_count() or 1),
                               threads_per_worker=1, processes=True, host="127.0.0.1", dashboard_address=":0")
        client = Client(cluster)
    else:
        client = connect_client(scheduler, float(getattr(cfg, "connect_timeout_s", 10.0)))
    try:
        client.run(tune_allocator)
        yield DaskRunner(client, getattr(cfg, "max_in_flight", None))
    finally:
        client.close()
        if cluster is not None:
            cluster.close()


def connect_client(address: str, timeout_s: float):
    """``Client(address)``, with an address that does not parse or that nothing answers on within ``timeout_s``
    as a one-line :class:`~looptrace.config.UserError` (the environment's fault, not looptrace's).

    A TCP address is first tried with a plain socket, so a refused or unreachable scheduler creates no half-made
    client (whose clean-up would print a traceback).
    """
    import socket

    from distributed import Client
    from distributed.comm.addressing import parse_address, parse_host_port

    where = f"Dask scheduler address '{address}' (base.dask.scheduler or ${SCHEDULER_ENV})"
    try:
        proto, loc = parse_address(address)
        host, port = parse_host_port(loc) if proto in ("tcp", "tls") else (None, None)
    except (ValueError, TypeError) as exc:
        raise UserError(f"{where} does not parse ({exc}); write it as tcp://host:8786, or set base.dask.scheduler: "
                        "null or local") from None
    if host is not None:
        assert port is not None  # parse_host_port gives both or raises
        try:
            socket.create_connection((host, int(port)), timeout=timeout_s).close()
        except OSError as exc:
            why = exc.strerror or type(exc).__name__
            raise UserError(f"{where}: nothing answers within {timeout_s:g} s ({why}); check that the scheduler runs "
                            "and that host and port are right (base.dask.connect_timeout_s waits longer), or set "
                            "base.dask.scheduler: null") from None
    try:
        return Client(address, timeout=timeout_s)
    except (OSError, TimeoutError) as exc:
        raise UserError(f"{where}: no Dask scheduler answered within {timeout_s:g} s ({str(exc)[:80]}); check the "
                        "address (base.dask.connect_timeout_s waits longer), or set base.dask.scheduler: null") from None


# ---------------------------------------------------------------------------------------------- mapping

def map_tasks(fn: Callable, items: Iterable[Any], shared: Sequence[Any] = (),
              runner: DaskRunner | None = None) -> Iterator[Any]:
    """``fn(item, *shared)`` for every item, in item order: in-process, or one task per item on ``runner``.

    ``shared`` (e.g. a split's arrays and the configs) is sent to the cluster once, not once per task. ``fn``
    must be a module-level function of an importable module (workers import it).
    """
    if runner is None:
        for item in items:
            yield fn(item, *shared)
        return
    shared_f = runner.share(tuple(shared))
    yield from runner.ordered(_item_task, ((fn, item, shared_f) for item in items))


def map_chunks(fn: Callable, store: Any, slices: Iterable[slice], args: Sequence[Any] = (),
               runner: DaskRunner | None = None, ahead: int = 0) -> Iterator[Any]:
    """``fn(store, tokens, *args)`` for every token slice of a trajectory store, in slice order.

    In-process (``runner`` None) it calls ``fn`` on ``store`` itself, slice after slice (one slice's data in
    memory at a time). With ``ahead`` > 0 it runs up to ``ahead`` + 1 slices at once on threads of this process
    (:func:`ordered_threads`): the next slices' reads and decompression overlap this one's computation and the
    consumer's writes, with at most ``ahead`` + 2 slices' data in memory. ``fn`` must then be thread-safe and
    compute each slice alone (no threaded BLAS whose result depends on the thread count), so the results, in
    slice order, are the same bytes either way. On a runner it submits one task per slice: the worker opens the
    store from ``store.target`` (its path or URL; once per worker process, kept while the store's attributes
    are unchanged), and the results come back in slice order, at most ``runner.max_in_flight`` at a time.

    Raises:
        ValueError: a runner is given but the store is in memory (worker processes cannot open it).
    """
    if runner is None:
        if ahead > 0:
            yield from ordered_threads(fn, ((store, tokens, *args) for tokens in slices), ahead + 1)
            return
        for tokens in slices:
            yield fn(store, tokens, *args)
        return
    target = store.target
    if not isinstance(target, str | os.PathLike):
        raise ValueError(f"store {store.label} is in memory: Dask workers cannot open it; write it to a path or "
                         "URL, or set base.dask.scheduler: null")
    target = os.fspath(target)
    key = (target, _attrs_digest(store.attrs))
    args_f = runner.share(tuple(args))
    yield from runner.ordered(_chunk_task, ((fn, target, key, tokens, args_f) for tokens in slices))


def ordered_threads(fn: Callable, args_list: Iterable[tuple], threads: int) -> Iterator[Any]:
    """``fn(*args)`` for each args tuple on ``threads`` threads of this process, results in submission order.

    At most ``threads`` calls are outstanding (one result is consumed before the next call is submitted once the
    window is full). A call's exception is re-raised here; closing the iterator early (an exception in the
    consumer, Ctrl-C) cancels the calls not yet started and waits for the running ones, so no thread outlives it.
    numpy, zarr's codecs and the file reads release the GIL, which is what lets two calls share two cores.
    """
    from concurrent.futures import ThreadPoolExecutor

    threads = max(1, int(threads))
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="looptrace-chunk") as pool:  # exit joins
        yield from _in_order(lambda *args: pool.submit(fn, *args), args_list, threads)


def _in_order(submit: Callable[..., Any], args_list: Iterable[tuple], window: int) -> Iterator[Any]:
    """``submit(*args)`` (a future) for each args tuple, at most ``window`` outstanding, results in submission
    order; closing early cancels the futures not yet consumed (a running one finishes)."""
    q: collections.deque = collections.deque()
    try:
        for args in args_list:
            q.append(submit(*args))
            if len(q) >= window:
                yield q.popleft().result()
        while q:
            yield q.popleft().result()
    finally:
        for f in q:
            f.cancel()


def _attrs_digest(attrs: dict) -> str:
    return hashlib.sha1(json.dumps(attrs, sort_keys=True, default=str).encode()).hexdigest()


# ---------------------------------------------------------------------------------------------- worker side

_STORES: collections.OrderedDict = collections.OrderedDict()
_MAX_OPEN = 8


def worker_store(target: str, key: tuple) -> Any:
    """The store at ``target``, opened once per worker process (up to 8 kept, least recently used dropped).

    The client validated the store when it opened it (complete, finite or allowed, shapes); the worker reopens
    it accepting what the client accepted.
    """
    st = _STORES.get(key)
    if st is None:
        # lazy: zarr — only a worker that decodes a store needs the reader; readouts, diagnose and report use
        # io.parallel without it (their dvc.yaml deps stay free of the store modules)
        from looptrace.io.store.reader import open_store

        st = open_store(target, allow_nan=True, allow_incomplete=True)
        _STORES[key] = st
        while len(_STORES) > _MAX_OPEN:
            _STORES.popitem(last=False)
    else:
        _STORES.move_to_end(key)
    return st


def _chunk_task(fn: Callable, target: str, key: tuple, tokens: slice, args: tuple) -> Any:
    tune_allocator()
    return fn(worker_store(target, key), tokens, *args)


def _item_task(fn: Callable, item: Any, shared: tuple) -> Any:
    tune_allocator()
    return fn(item, *shared)


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_TUNED = False


def tune_allocator(mmap_threshold: int = 256 << 20) -> bool:
    """glibc keeps freed chunk-sized buffers for reuse in this process (once per process; False off glibc).

    Why, on a Dask worker: the nanny starts workers with ``MALLOC_TRIM_THRESHOLD_=65536``, which also turns
    off glibc's dynamic mmap threshold, so every multi-MB chunk buffer is a fresh ``mmap`` that page-faults in
    again. Measured (scale prototype, q4c): 600–675k minor faults and 3.4–5.0 s of system time per 24 chunks of
    [4096, 6, 512] on a default worker, 86–217k and 0.7–1.3 s with this setting; ~345 -> ~245 ms of CPU per
    chunk. The same setting as ``looptrace.capture.chunks.reuse_freed_memory`` (kept here so that the offline
    stages never import the capture code, which imports torch).
    """
    global _TUNED
    if _TUNED:
        return True
    try:
        import ctypes
        import ctypes.util

        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    _TUNED = bool(mallopt(_M_MMAP_THRESHOLD, int(mmap_threshold))) and bool(
        mallopt(_M_TRIM_THRESHOLD, 2 * int(mmap_threshold)))
    return _TUNED


# ---------------------------------------------------------------------------------------------- per-model pool


def watch_parent(parent: int | None = None) -> None:
    """End this process as soon as its parent (pid ``parent``, default the current parent) is gone: a pool worker
    of a killed stage leaves no orphan writing on (what it had written stays in its staging directory, for the
    re-run to take over). On Linux the kernel kills it with its parent (``PR_SET_PDEATHSIG``); everywhere a thread
    checks every 0.5 s and exits with status 1."""
    import threading
    import time

    parent = os.getppid() if parent is None else parent
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG = 1
    if os.getppid() != parent:  # the parent died before the kernel was told
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="looptrace-parent-watch").start()


#: Environment variable that sets the processes of a per-model stage (``1``: one model after another in the stage's
#: own process); like the Dask scheduler it decides where the work runs, never what it computes, so it is not a
#: DVC param.
WORKERS_ENV = "LOOPTRACE_MODEL_WORKERS"


def model_workers(models: int, threads: int = 1, device: str = "cpu", scheduler: str | None = None,
                  setting: int | None = None) -> int:
    """Processes a per-model stage runs its models in: on the CPU ``setting`` when the stage's params give one (the
    timed stages' ``workers``), else ``$LOOPTRACE_MODEL_WORKERS`` when set, else the cores this process may use //
    ``threads`` (each model's torch / BLAS threads), at most one per model; one on an accelerator (the device is the
    shared resource) or where the stage's per-chunk work goes to a Dask cluster (the cluster is the parallelism).

    Raises:
        UserError: ``$LOOPTRACE_MODEL_WORKERS`` is not an integer >= 1.
    """
    if str(device) != "cpu" or scheduler is not None:
        return 1
    if setting is not None:
        return max(1, min(models, int(setting)))
    env = os.environ.get(WORKERS_ENV, "").strip()
    if env:
        if not env.isdigit() or int(env) < 1:
            raise UserError(f"{WORKERS_ENV}={env!r}: set it to an integer >= 1 (processes of a per-model stage) or "
                            "unset it (one per core)")
        return min(models, int(env))
    return max(1, min(models, project.host_cores() // max(1, int(threads))))


def per_model(fn: Callable[[str], str], models: Sequence[str], workers: int, label: str,
              echo: Callable[[str], None] | None = None) -> None:
    """``fn(model)`` for every model, ``workers`` at a time; ``echo`` gets each one's line as it finishes.

    A model's outputs depend on nothing but the model, the params and the code (each call seeds and sets what
    it depends on, writes its own ``<out>/<model>`` through :func:`looptrace.io.claims.stage_output`), so the
    bytes are the same in any order and pool size (:func:`map_models`).

    Args:
        fn: a module-level function (pickled by reference into the workers) of the model name, returning the line
            that reports it.
        models: model names.
        workers: processes (:func:`model_workers`).
        label: the progress line's description (the stage's name).
        echo: where each model's line goes (stdout through ``typer.echo``); None = nowhere.
    """
    map_models(fn, models, workers, label, echo)


def map_models(fn: Callable[[str], Any], models: Sequence[str], workers: int, label: str,
               done: Callable[[Any], None] | None = None) -> list[Any]:
    """``fn(model)`` for every model, ``workers`` at a time: the results in the order of ``models``.

    With ``workers`` 1 the models run one after another in this process; otherwise each runs in one of
    ``workers`` spawned processes (a fresh interpreter each: forking a process whose OpenMP pool has run can
    deadlock; the workers' own progress bars are off, one line per model here instead). The first failure
    cancels the models not yet started, waits for the running ones and is re-raised here (a model already
    finished keeps whatever it wrote).

    Args:
        fn: a module-level function (pickled by reference into the workers) of the model name; its result is
            pickled back.
        models: model names.
        workers: processes (:func:`model_workers`).
        label: the progress line's description (the stage's name).
        done: called here with each result as its model finishes (in finishing order).
    """
    from tqdm.auto import tqdm

    workers = max(1, min(int(workers), len(models)))
    results: dict[int, Any] = {}
    with tqdm(total=len(models), desc=f"{label}: models", unit="model", disable=None, leave=False) as bar:
        def finish(i: int, result: Any) -> None:
            results[i] = result
            bar.update(1)
            if done is not None:
                with tqdm.external_write_mode():
                    done(result)

        if workers == 1:
            for i, m in enumerate(models):
                finish(i, fn(m))
        else:
            import multiprocessing as mp
            from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

            with _thread_limits(max(1, project.host_cores() // workers)), \
                    ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"), initializer=_pool_worker_init,
                                        initargs=(os.getpid(),)) as pool:
                futures = {pool.submit(fn, m): i for i, m in enumerate(models)}
                pending = set(futures)
                try:
                    while pending:
                        ready, pending = wait(pending, return_when=FIRST_COMPLETED)
                        for f in ready:
                            finish(futures[f], f.result())
                except BaseException:
                    for f in pending:
                        f.cancel()
                    raise
    return [results[i] for i in range(len(models))]


#: The thread pools a worker's libraries size from the environment when they load (OpenMP: torch and numpy's BLAS;
#: OpenBLAS; MKL; polars' Rayon pool).
_THREAD_ENV = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "POLARS_MAX_THREADS")


@contextmanager
def _thread_limits(threads: int) -> Iterator[None]:
    """The pool's workers start with ``threads`` threads per library pool (those the user has not set): without it
    each worker sizes its pools to every core and two workers on two cores run 4+ threads (geometry's 12 default
    models: 44 s instead of 18)."""
    saved = {k: os.environ.get(k) for k in _THREAD_ENV}
    for k in _THREAD_ENV:
        os.environ.setdefault(k, str(threads))
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class _NotATerminal:
    """A stream that says it is not a terminal (everything else is the wrapped stream's)."""

    def __init__(self, stream: Any):
        self._stream = stream

    def isatty(self) -> bool:
        return False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _pool_worker_init(parent: int) -> None:
    # The workers' progress bars stay off (tqdm's disable=None draws only on a terminal): the parent draws the
    # pool's line; warnings and errors still reach stderr.
    sys.stderr = _NotATerminal(sys.stderr)
    watch_parent(parent)
