"""Stored precision of the states (looptrace.io.precision, and the dump's torch encoder looptrace.capture.encode):
the cast, the overflow refusal and the NaN/Inf count."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from looptrace.capture.encode import encode_states_counted
from looptrace.io.precision import (
    PrecisionError,
    count_nonfinite,
    count_nonfinite_rows,
    decode_states,
    encode_states,
)


def test_finite_states_cast_with_no_count():
    x = torch.randn(6, 3, 8) * 100
    enc, counts = encode_states_counted(x, "float16", "hidden")
    assert counts is None
    np.testing.assert_array_equal(enc, x.numpy().astype(np.float16))
    enc32, counts32 = encode_states_counted(x, "float32", "hidden")
    assert counts32 is None and enc32.dtype == np.float32
    np.testing.assert_array_equal(enc32, x.numpy())


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_nonfinite_counted_per_row(dtype):
    x = torch.randn(5, 2, 4)
    x[1, 0, 0] = float("nan")
    x[1, 1, 3] = float("inf")
    x[3, 0, 2] = float("-inf")
    enc, counts = encode_states_counted(x, dtype, "hidden")
    np.testing.assert_array_equal(counts, [0, 2, 0, 1, 0])  # by hand
    # independently: NaN/Inf of the stored values, decoded to float32 by numpy
    dec = decode_states(enc, dtype)
    np.testing.assert_array_equal(counts, (~np.isfinite(dec)).reshape(5, -1).sum(-1))
    assert count_nonfinite(enc, dtype) == 3
    np.testing.assert_array_equal(count_nonfinite_rows(enc, dtype), counts)


def test_float16_overflow_refused_bfloat16_overflow_counted():
    x = torch.ones(3, 4)
    x[2, 1] = 1e6  # finite, beyond float16's 65504
    with pytest.raises(PrecisionError, match=r"hidden: \|value\| reaches 1e\+06.*dump.hidden_dtype"):
        encode_states_counted(x, "float16", "hidden")
    # bfloat16 has float32's exponent: 1e6 fits; a float32 value above bfloat16's largest finite value
    # (3.3895e38) rounds to inf in the cast and is counted as stored, never hidden
    enc, counts = encode_states_counted(x, "bfloat16", "hidden")
    assert counts is None and decode_states(enc, "bfloat16")[2, 1] == pytest.approx(1e6, rel=1e-2)
    x[0, 0] = 3.4e38
    enc, counts = encode_states_counted(x, "bfloat16", "hidden")
    np.testing.assert_array_equal(counts, [1, 0, 0])
    assert np.isinf(decode_states(enc, "bfloat16")[0, 0])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_numpy_and_torch_encoders_store_the_same_bytes(dtype):
    """The torch-free numpy encoder (StoreWriter) and the dump's torch encoder store the same bits for every
    non-NaN value (Inf included) and NaN at the same places (the NaN payload differs for bfloat16: torch writes
    0xFFFF, numpy a quiet 0x7FC0; both decode to NaN and are counted alike)."""
    x = torch.randn(7, 3, 8) * 300
    x[2, 1, 4] = float("nan")
    x[5, 0, 0] = float("-inf")
    via_torch, counts = encode_states_counted(x, dtype, "hidden")
    via_numpy = encode_states(x.numpy(), dtype, "hidden")
    assert via_torch.dtype == via_numpy.dtype
    nan = np.isnan(decode_states(via_numpy, dtype))
    np.testing.assert_array_equal(np.isnan(decode_states(via_torch, dtype)), nan)
    bits = {2: np.uint16, 4: np.uint32}[via_numpy.dtype.itemsize]
    np.testing.assert_array_equal(via_torch.view(bits)[~nan], via_numpy.view(bits)[~nan])
    np.testing.assert_array_equal(counts, count_nonfinite_rows(via_numpy, dtype))


def test_numpy_encoder_refuses_float16_overflow_and_torch_input():
    x = np.ones((2, 3), np.float32)
    x[1, 2] = 1e6
    with pytest.raises(PrecisionError, match=r"hidden: \|value\| reaches 1e\+06.*dump.hidden_dtype"):
        encode_states(x, "float16", "hidden")
    with pytest.raises(TypeError, match="capture.encode"):
        encode_states(torch.ones(2, 3), "float16", "hidden")
