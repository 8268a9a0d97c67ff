"""The geometry stage's block functions and its stream of blocks (SPEC §2): numpy in, numpy out, one row per token.

A token's metrics depend only on that token's row, so the stage feeds blocks aligned to the store's chunks and the
result does not depend on the block size; nothing here holds a store's whole ``hidden`` array. :func:`iter_blocks`
/ :func:`read_block` read a store block by block with the step metrics of each block (``looptrace.signals.steps``);
:func:`convergence_depth`, :func:`argmax_differs`, :func:`group_handoffs` and :func:`drift_to_loop_ratio` are the
per-token measures of SPEC §2 on such a block (conventions: :mod:`looptrace.geometry.stage`, docs/geometry.md).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from looptrace.io.tables import SplitArrays
from looptrace.signals import names as signal_names
from looptrace.signals.names import LOGIT_STATS
from looptrace.signals.steps import _ratio, step_metrics

#: Logit statistics copied from the store (SPEC §3), in column order.
STORE_STATS = LOGIT_STATS
#: Opt-in signal columns (SPEC §2b), read only when the store has them (and appended to ``token_loop.parquet``, so a
#: default store's table keeps ``TOKEN_LOOP_COLUMNS`` byte for byte).
OPT_IN_COLUMNS = tuple(signal_names.OPT_IN)


# ---------------------------------------------------------------------------------------------
# Block functions (numpy; one row per token, independent of the block size)
# ---------------------------------------------------------------------------------------------

def argmax_differs(argmax: np.ndarray) -> np.ndarray:
    """The convergence signal of the readout: 1 where argmax_t ≠ argmax_T, else 0.

    Args:
        argmax: [token, loop] int predicted ids.

    Returns:
        [token, loop] float32 in {0, 1} (always 0 at the last loop).
    """
    return (argmax != argmax[:, -1:]).astype(np.float32)


def convergence_depth(signal: np.ndarray, eps: float) -> dict[str, np.ndarray]:
    """Per-token convergence depth of a signal at threshold ε (SPEC §2, [FP]).

    ``first`` = first loop t with signal_t < ε; ``settled`` = first loop t from which the signal stays
    below ε through T. NaN is never below ε (a signal undefined at t = 1 cannot converge there).
    A token that never gets there is censored: depth T + 1 and ``censored`` True — counted, never
    dropped.

    Args:
        signal: [token, loop] float values (NaN allowed).
        eps: threshold (> 0).

    Returns:
        ``first``, ``settled`` [token] int64 (1-based loops, T + 1 when censored) and
        ``first_censored``, ``settled_censored`` [token] bool.
    """
    n_loops = signal.shape[1]
    with np.errstate(invalid="ignore"):
        below = np.asarray(signal) < eps  # NaN compares False
    any_below = below.any(axis=1)
    first = np.where(any_below, below.argmax(axis=1) + 1, n_loops + 1)
    above = ~below
    # 1-based index of the last loop that is not below ε (0 when every loop is below).
    last_above = np.where(above.any(axis=1), n_loops - above[:, ::-1].argmax(axis=1), 0)
    settled = last_above + 1
    return {"first": first.astype(np.int64), "settled": settled.astype(np.int64),
            "first_censored": first > n_loops, "settled_censored": settled > n_loops}


def group_handoffs(loop_group: np.ndarray) -> list[tuple[int, int, int]]:
    """Hand-offs between consecutive looped groups.

    Args:
        loop_group: [loop] group index of each loop (contiguous, increasing by 1: 0,0,1,1,1,2...).

    Returns:
        (g, last loop of g, first loop of g + 1) per hand-off, loops 0-based; empty for one group.

    Raises:
        ValueError: when the groups are not contiguous and increasing.
    """
    lg = np.asarray(loop_group).astype(np.int64)
    if lg.size == 0 or lg[0] != 0 or np.any(np.diff(lg) < 0) or np.any(np.diff(lg) > 1):
        raise ValueError(f"loop_group must start at 0 and increase by 0 or 1 per loop, got {lg.tolist()}")
    return [(int(lg[t - 1]), t - 1, t) for t in range(1, lg.size) if lg[t] != lg[t - 1]]


def drift_to_loop_ratio(step_norm: np.ndarray, loop_group: np.ndarray) -> dict[int, dict[str, np.ndarray]]:
    """Drift-to-loop ratio at each group hand-off, per token ([TS]; SPEC §2).

    DLR_g = ‖h(first loop of g+1) − h(last loop of g)‖ / mean_k ‖Δ_k within g‖. The numerator is the
    step norm at the first loop of g + 1; the loop steps within g are Δ_t with loops t − 1 and t both
    in g (see the module docstring). A group with a single loop has no loop step: DLR is NaN.

    Args:
        step_norm: [token, loop] s_t from :func:`step_metrics`.
        loop_group: [loop] group index per loop.

    Returns:
        g -> ``drift`` [token], ``loop_step`` [token] (mean within-g step norm), ``dlr`` [token]
        (float64), one entry per hand-off g -> g + 1.
    """
    lg = np.asarray(loop_group).astype(np.int64)
    out = {}
    for g, _last, first_next in group_handoffs(lg):
        within = [t for t in range(1, lg.size) if lg[t] == g and lg[t - 1] == g]
        drift = step_norm[:, first_next].astype(np.float64)
        if within:
            loop_step = step_norm[:, within].astype(np.float64).mean(axis=1)
        else:
            loop_step = np.full(step_norm.shape[0], np.nan)
        out[g] = {"drift": drift, "loop_step": loop_step, "dlr": _ratio(drift, loop_step)}
    return out


# ---------------------------------------------------------------------------------------------
# Streaming over a store
# ---------------------------------------------------------------------------------------------

_TOKEN_NAMES = ("target", "sequence", "position", "difficulty", "token_type")
_MALLOC_SET = False


def release_large_buffers() -> None:
    """Make glibc return freed multi-MB buffers to the OS (no-op on other C libraries).

    Why: zarr decodes chunks in worker threads. Under glibc's *dynamic* mmap threshold, freed chunk-sized
    buffers are recycled inside per-thread malloc arenas instead of being unmapped, so peak RSS creeps up
    by about a block per thread (measured with benchmarks/geometry.py, 40k tokens × d_model 512:
    406 MiB -> 246 MiB peak). A fixed 1 MiB threshold (``mallopt(M_MMAP_THRESHOLD)``) puts every large
    array in its own mapping, released on free; small allocations are unaffected.
    """
    global _MALLOC_SET
    if _MALLOC_SET:
        return
    _MALLOC_SET = True
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD = -3 in glibc's malloc.h
    except (OSError, AttributeError):
        pass  # not glibc: keep the default allocator behaviour


def iter_blocks(store, block_tokens: int | None = None) -> Iterator[SplitArrays]:
    """Stream a trajectory store block by block, computing the step metrics of each block.

    Args:
        store: a :class:`looptrace.io.store.reader.TrajectoryStore` (from ``open_store``).
        block_tokens: tokens per block; ``None`` = the store's chunk size (chunk-aligned reads).

    Yields:
        :func:`read_block` of each token slice, in store order. Only one block's ``hidden`` is in memory.
    """
    release_large_buffers()
    for tokens in store.blocks(block_tokens):
        yield read_block(store, tokens)


def read_block(store, tokens: slice) -> SplitArrays:
    """One block of a store with its step metrics.

    Returns:
        A :class:`~looptrace.io.tables.SplitArrays`: ``token`` the store rows, ``fields`` target, sequence,
        position, difficulty, token_type ([token] int64), ``loop`` the geometry metrics and store stats
        (float32), ``argmax`` (int64), ``correct`` (bool) and ``gate_logit`` (float32, only when the model has
        a gate).
    """
    names = ["hidden", "hidden_init", "argmax", *STORE_STATS, *_TOKEN_NAMES]
    if store.has_gate:
        names.append("gate_logit")
    opt_in = [c for c in OPT_IN_COLUMNS if c in store]  # opt-in arrays (dump.contraction), only when stored
    names.extend(opt_in)
    arr = store.read_block(names, tokens)
    per_loop = step_metrics(arr.pop("hidden"), arr.pop("hidden_init"))
    for s in STORE_STATS:
        per_loop[s] = np.asarray(arr.pop(s), dtype=np.float32)
    per_loop["argmax"] = np.asarray(arr.pop("argmax"), dtype=np.int64)
    if "gate_logit" in arr:
        per_loop["gate_logit"] = np.asarray(arr.pop("gate_logit"), dtype=np.float32)
    for c in opt_in:
        per_loop[c] = np.asarray(arr.pop(c), dtype=np.float32)
    fields = {k: np.asarray(arr[k], dtype=np.int64) for k in _TOKEN_NAMES}
    per_loop["correct"] = per_loop["argmax"] == fields["target"][:, None]
    start = tokens.start or 0
    token = np.arange(start, start + len(fields["target"]), dtype=np.int64)
    return SplitArrays(token=token, loop=per_loop, fields=fields)
