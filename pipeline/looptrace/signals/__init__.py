"""Per-loop signals, each defined once: logit signals (SPEC §3, :mod:`.logits`), step signals (SPEC §2,
:mod:`.steps`) and the halting CDF of a native gate (:mod:`.halting`; its torch forms for training and the
PonderNet gates in :mod:`.halting_torch`), with the exit rules' firing conditions (:mod:`.firing`). Their names,
sources and properties are one table, :mod:`.names` (the signal registry every list of signals derives from).

Every module has a vectorised form over a whole trajectory ([token, loop]) and a streaming form that is fed
one loop at a time and keeps only what the next loop needs. The dump, the geometry stage, the offline rules,
the online (latency) rules and the online gate all call these; the streaming forms also follow the early-exit
engine's batch compaction (:func:`keep_rows`), so a value computed online is the stored value bit for bit.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def keep_rows(x: Any, rows: Any, seq: int | None) -> Any:
    """Follow the early-exit engine's compaction on a state with leading [batch, seq] dims.

    Args:
        x: numpy array or torch tensor [batch, seq, ...].
        rows: batch rows to keep (numpy array or torch tensor of indices), or None for all.
        seq: positions to keep (the first ``seq``), or None for all.

    Returns:
        ``x[rows][:, :seq]`` of the same kind as ``x``.
    """
    if rows is not None:
        if isinstance(x, np.ndarray):
            x = x[np.asarray(rows.cpu() if hasattr(rows, "cpu") else rows)]
        else:
            # numpy row indices for a tensor: new_tensor keeps the tensor's device (no torch import here,
            # so the numpy-only users of this package never load torch)
            x = x.index_select(0, rows if not isinstance(rows, np.ndarray) else x.new_tensor(rows).long())
    return x if seq is None else x[:, :seq]

