"""Stored precision of the states (``hidden``/``hidden_init``): never a silent overflow.

Zarr v3 has no bfloat16, and LM checkpoints run in bf16 / fp16 / fp32. The stored representations:

- ``float16`` — 2 bytes, 10-bit mantissa, but a largest finite value of 65504: bf16/fp32 models can exceed
  it (massive activations of large LMs reach 1e3–1e5). Every cast to float16 first checks the largest
  finite magnitude and raises :class:`PrecisionError` (naming the array and the fix) instead of storing inf.
- ``bfloat16`` — stored as its uint16 bit pattern (Zarr dtype ``uint16``; ``dtypes`` attribute
  ``bfloat16``; decoded to float32 on read by a 16-bit shift, exact). The natural choice for bf16 models:
  lossless, same range as float32, 2 bytes.
- ``float32`` — exact for every model, 4 bytes.
- ``auto`` (a dump parameter, resolved per model) — bfloat16 for bf16 models, float16 for fp16 models
  (lossless in both cases), float16 (range-checked) for everything else.

Values that are non-finite *in the model* (NaN/Inf) are not overflow: they are stored as such and
counted (``nan_count``), as before.
"""

from __future__ import annotations

from typing import Any

import numpy as np

#: Stored dtypes of the states, and the Zarr dtype that holds each.
STATE_DTYPES = {"float16": "float16", "float32": "float32", "bfloat16": "uint16"}
FLOAT16_MAX = float(np.finfo(np.float16).max)  # 65504


class PrecisionError(ValueError):
    """A state does not fit the stored dtype (one line: the array, the magnitude and the fix)."""


def resolve_state_dtype(requested: str, model_dtype: str | None) -> str:
    """The stored dtype for ``requested`` (``auto`` resolves from the model's compute dtype name)."""
    if requested != "auto":
        return requested
    return {"bfloat16": "bfloat16", "float16": "float16"}.get(str(model_dtype or "").replace("torch.", ""), "float16")


def _max_finite_abs(x: Any) -> float:
    if isinstance(x, np.ndarray):
        a = np.abs(x.astype(np.float32, copy=False)) if x.dtype != np.float64 else np.abs(x)
        a = a[np.isfinite(a)]
        return float(a.max()) if a.size else 0.0
    import torch

    a = x.detach().abs()
    if a.dtype not in (torch.float32, torch.float64):
        a = a.float()
    a = torch.where(torch.isfinite(a), a, torch.zeros((), dtype=a.dtype, device=a.device))
    return float(a.max()) if a.numel() else 0.0


def check_fits(x: Any, dtype: str, what: str) -> None:
    """Raise :class:`PrecisionError` when a finite value of ``x`` exceeds the range of ``dtype``.

    Args:
        x: the values (any float dtype; numpy array or torch tensor).
        dtype: the stored dtype (only ``float16`` has a narrower range than the models' dtypes).
        what: names the array (and chunk / batch) in the message.
    """
    if dtype != "float16":
        return
    m = _max_finite_abs(x)
    if m > FLOAT16_MAX:
        raise PrecisionError(f"{what}: |value| reaches {m:.4g}, beyond float16's largest finite value "
                             f"{FLOAT16_MAX:.0f} (it would be stored as inf); set dump.hidden_dtype: float32 or "
                             "bfloat16 (auto picks bfloat16 for bf16 models)")


def _f32_to_bf16_bits(a: np.ndarray) -> np.ndarray:
    # round to nearest even, as torch's float32 -> bfloat16 cast; NaN stays a (quiet) NaN
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    rounded = ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(a)
    if nan.any():
        rounded[nan] = ((u[nan] >> np.uint32(16)) | np.uint32(0x0040)).astype(np.uint16)
    return rounded


def encode_states(x: Any, dtype: str, what: str) -> np.ndarray:
    """States → the numpy array stored for ``dtype`` (range-checked; bfloat16 as uint16 bits).

    Args:
        x: [..., d_model] states, any float dtype (torch tensor or numpy); uint16 numpy input is taken as
            bfloat16 bits already.
        dtype: ``float16`` | ``bfloat16`` | ``float32``.
        what: names the array in an error message.
    """
    if dtype not in STATE_DTYPES:
        raise PrecisionError(f"{what}: unknown state dtype {dtype!r} (one of {', '.join(STATE_DTYPES)})")
    if isinstance(x, np.ndarray):
        if x.dtype == np.uint16:
            if dtype != "bfloat16":
                raise PrecisionError(f"{what}: uint16 (bfloat16 bits) given for a {dtype} array")
            return x
        if dtype != "bfloat16" and x.dtype == np.dtype(dtype):
            return x  # already in the stored representation (cast, and range-checked, by the producer)
        check_fits(x, dtype, what)
        if dtype == "bfloat16":
            return _f32_to_bf16_bits(x)
        with np.errstate(over="ignore", invalid="ignore"):
            return x.astype(dtype, copy=False)
    return encode_states_counted(x, dtype, what)[0]


def encode_states_counted(x: Any, dtype: str, what: str) -> tuple[np.ndarray, np.ndarray | None]:
    """:func:`encode_states` of a torch tensor, plus the non-finite count of each row.

    The common case costs the cast and one reduction over its result: a finite ``torch.aminmax`` of the
    stored values proves there is nothing to count and nothing to refuse (a finite value beyond float16's
    range becomes inf in the cast), so the per-element checks (largest finite magnitude of the input,
    finiteness mask, count per row) only run for a batch that holds a NaN/Inf after the cast.

    Args:
        x: [row, ...] states (torch tensor, any float dtype; numpy goes through :func:`encode_states`).
        dtype: ``float16`` | ``bfloat16`` | ``float32``.
        what: names the array in an error message.

    Returns:
        (stored array [row, ...], [row] int64 non-finite count per row, or None when there is none).
    """
    if isinstance(x, np.ndarray):
        enc = encode_states(x, dtype, what)
        bad = count_nonfinite_rows(enc, dtype)
        return enc, (bad if bad.any() else None)
    if dtype not in STATE_DTYPES:
        raise PrecisionError(f"{what}: unknown state dtype {dtype!r} (one of {', '.join(STATE_DTYPES)})")
    import torch

    t = x.detach()
    target = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    e = t.to(target)
    counts = None
    if e.numel():
        lo, hi = (float(v) for v in torch.aminmax(e))
        if not (np.isfinite(lo) and np.isfinite(hi)):
            # rare path: a NaN/Inf after the cast, from the model or from overflow (refused for float16)
            check_fits(t, dtype, what)
            counts = (~torch.isfinite(e)).reshape(e.shape[0], -1).sum(-1).cpu().numpy().astype(np.int64)
    if dtype == "bfloat16":
        return e.contiguous().view(torch.int16).cpu().numpy().view(np.uint16), counts
    return e.cpu().numpy(), counts


def decode_states(a: np.ndarray, dtype: str | None) -> np.ndarray:
    """Stored states → float32 (bfloat16 bits are widened exactly: the 16 bits become the high half)."""
    if dtype == "bfloat16" or a.dtype == np.uint16:
        return (a.astype(np.uint32) << np.uint32(16)).view(np.float32)
    return a if a.dtype == np.float32 else a.astype(np.float32)


def count_nonfinite(stored: np.ndarray, dtype: str) -> int:
    """Number of NaN/Inf values in a stored state array."""
    return int(count_nonfinite_rows(stored, dtype).sum()) if stored.size else 0


def count_nonfinite_rows(stored: np.ndarray, dtype: str) -> np.ndarray:
    """[row] int64: NaN/Inf values in each row (first axis) of a stored state array."""
    if dtype == "bfloat16":
        bad = (stored & np.uint16(0x7F80)) == np.uint16(0x7F80)  # exponent all ones ⇔ inf or NaN
    else:
        bad = ~np.isfinite(stored)
    return bad.reshape(len(stored), -1).sum(-1, dtype=np.int64)


__all__ = ["FLOAT16_MAX", "STATE_DTYPES", "PrecisionError", "check_fits", "count_nonfinite", "decode_states",
           "count_nonfinite_rows", "encode_states", "encode_states_counted", "resolve_state_dtype"]
