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

This module is the numpy side of the representation (the policy, the numpy encoder :class:`StoreWriter` uses,
the decoder every reader uses, the counts) and never imports torch, so the offline stages that read stores stay
torch-free. The dump's torch fast path (cast on the model's device, one ``aminmax`` per batch) is
:mod:`looptrace.capture.encode`; both produce the same stored bytes (tests/test_precision.py).
"""

from __future__ import annotations

import numpy as np

from looptrace.config import UserError

#: Stored dtypes of the states, and the Zarr dtype that holds each.
STATE_DTYPES = {"float16": "float16", "float32": "float32", "bfloat16": "uint16"}
FLOAT16_MAX = float(np.finfo(np.float16).max)  # 65504


class PrecisionError(UserError, ValueError):
    """A state does not fit the stored dtype (one line: the array, the magnitude and the fix)."""


def resolve_state_dtype(requested: str, model_dtype: str | None) -> str:
    """The stored dtype for ``requested`` (``auto`` resolves from the model's compute dtype name)."""
    if requested != "auto":
        return requested
    return {"bfloat16": "bfloat16", "float16": "float16"}.get(str(model_dtype or "").replace("torch.", ""), "float16")


def _max_finite_abs(x: np.ndarray) -> float:
    a = np.abs(x.astype(np.float32, copy=False)) if x.dtype != np.float64 else np.abs(x)
    a = a[np.isfinite(a)]
    return float(a.max()) if a.size else 0.0


def check_fits(x: np.ndarray, dtype: str, what: str) -> None:
    """Raise :class:`PrecisionError` when a finite value of ``x`` exceeds the range of ``dtype``.

    Args:
        x: the values (any float dtype, numpy; a torch tensor goes through
            :func:`looptrace.capture.encode.encode_states_counted`).
        dtype: the stored dtype (only ``float16`` has a narrower range than the models' dtypes).
        what: names the array (and chunk / batch) in the message.
    """
    if dtype != "float16":
        return
    check_max_abs(_max_finite_abs(x), dtype, what)


def check_max_abs(m: float, dtype: str, what: str) -> None:
    """:func:`check_fits` given the largest finite magnitude ``m`` (computed by the caller, numpy or torch)."""
    if dtype == "float16" and m > FLOAT16_MAX:
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


def encode_states(x: np.ndarray, dtype: str, what: str) -> np.ndarray:
    """States → the numpy array stored for ``dtype`` (range-checked; bfloat16 as uint16 bits).

    Args:
        x: [..., d_model] numpy states, any float dtype; uint16 input is taken as bfloat16 bits already. Torch
            tensors (the dump's capture) are encoded by :func:`looptrace.capture.encode.encode_states_counted`,
            which gives the same stored values.
        dtype: ``float16`` | ``bfloat16`` | ``float32``.
        what: names the array in an error message.
    """
    if dtype not in STATE_DTYPES:
        raise PrecisionError(f"{what}: unknown state dtype {dtype!r} (one of {', '.join(STATE_DTYPES)})")
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{what}: encode_states takes a numpy array, got {type(x).__name__} "
                        "(torch tensors: looptrace.capture.encode.encode_states_counted)")
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


__all__ = ["FLOAT16_MAX", "STATE_DTYPES", "PrecisionError", "check_fits", "check_max_abs", "count_nonfinite",
           "decode_states", "count_nonfinite_rows", "encode_states", "resolve_state_dtype"]
