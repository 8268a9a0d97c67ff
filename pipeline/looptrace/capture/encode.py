"""The dump's torch encoder of states: cast on the model's device, refuse float16 overflow, count NaN/Inf.

The stored representations and their numpy encoder/decoder are :mod:`looptrace.io.precision` (torch-free, so
readers of a store never import torch). This module is the capture side of the same contract: a torch tensor
becomes exactly the bytes :func:`looptrace.io.precision.encode_states` would store for it (tests/test_precision.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from looptrace.capture.transfer import Pending
from looptrace.io.precision import (
    STATE_DTYPES,
    PrecisionError,
    check_max_abs,
    count_nonfinite_rows,
    encode_states,
)


def _max_finite_abs(t: torch.Tensor) -> float:
    """Largest finite |value| of a tensor (0 when none), computed in float32 or float64."""
    a = t.detach().abs()
    if a.dtype not in (torch.float32, torch.float64):
        a = a.float()
    a = torch.where(torch.isfinite(a), a, torch.zeros((), dtype=a.dtype, device=a.device))
    return float(a.max()) if a.numel() else 0.0


def encode_states_counted(x: Any, dtype: str, what: str,
                          host: Callable[[torch.Tensor], Any] | None = None) -> tuple[Any, np.ndarray | None]:
    """States → the stored numpy array for ``dtype``, plus the non-finite count of each row.

    The common case costs the cast and one reduction over its result: a finite ``torch.aminmax`` of the
    stored values proves there is nothing to count and nothing to refuse (a finite value beyond float16's
    range becomes inf in the cast), so the per-element checks (largest finite magnitude of the input,
    finiteness mask, count per row) only run for a batch that holds a NaN/Inf after the cast.

    Args:
        x: [row, ...] states (torch tensor, any float dtype; numpy goes through
            :func:`looptrace.io.precision.encode_states`).
        dtype: ``float16`` | ``bfloat16`` | ``float32``.
        what: names the array in an error message.
        host: how the stored tensor reaches the host (default ``tensor.cpu().numpy()``; the dump's
            :meth:`looptrace.capture.transfer.Transfer.copy`, whose :class:`~looptrace.capture.transfer.Pending`
            copies are returned as they are).

    Returns:
        (stored array [row, ...] (or its pending copy), [row] int64 non-finite count per row, or None when there is
        none).

    Raises:
        PrecisionError: an unknown dtype, or a finite value beyond float16's range for ``float16``.
    """
    if isinstance(x, np.ndarray):
        enc = encode_states(x, dtype, what)
        bad = count_nonfinite_rows(enc, dtype)
        return enc, (bad if bad.any() else None)
    if dtype not in STATE_DTYPES:
        raise PrecisionError(f"{what}: unknown state dtype {dtype!r} (one of {', '.join(STATE_DTYPES)})")
    t = x.detach()
    target = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    e = t.to(target)
    counts = None
    if e.numel():
        lo, hi = (float(v) for v in torch.aminmax(e))
        if not (np.isfinite(lo) and np.isfinite(hi)):
            # rare path: a NaN/Inf after the cast, from the model or from overflow (refused for float16)
            if dtype == "float16":
                check_max_abs(_max_finite_abs(t), dtype, what)
            counts = (~torch.isfinite(e)).reshape(e.shape[0], -1).sum(-1).cpu().numpy().astype(np.int64)
    if host is None:
        if dtype == "bfloat16":
            return e.contiguous().view(torch.int16).cpu().numpy().view(np.uint16), counts
        return e.cpu().numpy(), counts
    if dtype == "bfloat16":
        a = host(e.contiguous().view(torch.int16))
        return (a.then(_as_uint16) if isinstance(a, Pending) else a.view(np.uint16)), counts
    return host(e), counts


def _as_uint16(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint16)


__all__ = ["encode_states_counted"]
