"""Device → host copies of the dump that overlap with the next batch's compute (docs/dump.md).

On CUDA, :class:`Transfer` copies each captured array into page-locked (pinned) host memory on a **side stream**:
the side stream first waits for the compute stream's work so far (an event: the values are final), the copy is
enqueued without blocking the host, and a CUDA event marks its end. ``_capture`` hands back :class:`Pending`
arrays, and ``_write_range`` resolves batch b's only after batch b + 1 has been captured (enqueued), so batch b's
copies run on the copy engine while batch b + 1's forward runs on the compute stream. Resolving waits for that
copy's event only. CUDA events with timing also give the copy time on the device (:attr:`Transfer.copy_ms`).

The bytes are those of ``tensor.cpu().numpy()``: a copy is exact, and any host transform after it (the bfloat16
bit view, selecting scored rows) is the same numpy call applied later (:meth:`Pending.then`). On a CPU device
nothing changes: :func:`transfer_for` gives the synchronous form, whose :meth:`Transfer.copy` is
``tensor.cpu().numpy()`` at once, and the dump keeps no batch pending. The asynchronous form runs on CPU tensors
too (host "stream" and events standing in for CUDA's): the tests dump through it and compare every file of the
store with the synchronous dump's.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

__all__ = ["Pending", "Transfer", "resolve", "take_rows", "transfer_for"]


class _HostEvent:
    """A CUDA event's interface on the host (the asynchronous form on CPU tensors): records a time at once."""

    def __init__(self) -> None:
        self.t = 0.0

    def record(self, stream: Any = None) -> None:
        self.t = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: _HostEvent) -> float:
        return 1e3 * (end.t - self.t)


class _HostStream:
    """A CUDA stream's interface on the host: work is done at once, so there is nothing to wait for."""

    def wait_stream(self, other: Any) -> None:
        pass


class Pending:
    """A host copy in flight: :meth:`numpy` waits for its copy (its event) and applies the host transforms."""

    def __init__(self, buf: torch.Tensor, done: Any, fns: tuple[Callable[[np.ndarray], np.ndarray], ...] = ()):
        self.buf, self.done, self.fns = buf, done, fns

    def then(self, fn: Callable[[np.ndarray], np.ndarray]) -> Pending:
        """The same copy with ``fn`` applied to its numpy array when resolved."""
        return Pending(self.buf, self.done, (*self.fns, fn))

    def numpy(self) -> np.ndarray:
        self.done.synchronize()
        a = self.buf.numpy()
        for fn in self.fns:
            a = fn(a)
        return a


class Transfer:
    """Copies of device tensors to host numpy arrays, synchronous or overlapping (module docstring).

    Args:
        device: the model's device.
        asynchronous: copy on a side stream into pinned memory and resolve later (CUDA); on a CPU device the same
            code path with host stand-ins for the stream and events (tests). False: ``tensor.cpu().numpy()`` at once.

    Attributes:
        copies, bytes: copies enqueued and their bytes; copy_ms: device time of the resolved copies (CUDA events;
            host time for the stand-ins); 0 in the synchronous form.
    """

    def __init__(self, device: torch.device | str, asynchronous: bool = False):
        self.device = torch.device(device)
        self.asynchronous = bool(asynchronous)
        self.cuda = self.device.type == "cuda"
        self.copies = self.bytes = 0
        self.copy_ms = 0.0
        self._timed: list[tuple[Any, Any]] = []
        self.stream: Any = None
        if self.asynchronous:
            self.stream = torch.cuda.Stream(self.device) if self.cuda else _HostStream()

    def _event(self) -> Any:
        return torch.cuda.Event(enable_timing=True) if self.cuda else _HostEvent()

    def _on_side(self):
        return torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext()

    def copy(self, t: torch.Tensor) -> np.ndarray | Pending:
        """``t`` (any device) as a host array: numpy at once (synchronous form) or a :class:`Pending` copy."""
        if not self.asynchronous:
            return t.cpu().numpy()
        t = t.detach()
        if not t.is_contiguous():
            t = t.contiguous()
        buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=self.cuda)
        start, end = self._event(), self._event()
        if self.cuda:  # the copy reads t once the compute stream has written it; t's memory stays t's until then
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            t.record_stream(self.stream)
        with self._on_side():
            start.record(self.stream)
            buf.copy_(t, non_blocking=self.cuda)
            end.record(self.stream)
        self.copies += 1
        self.bytes += buf.numel() * buf.element_size()
        self._timed.append((start, end))
        return Pending(buf, end)

    def settle(self) -> None:
        """Wait for every copy enqueued so far and add their device time to :attr:`copy_ms`."""
        for start, end in self._timed:
            end.synchronize()
            self.copy_ms += start.elapsed_time(end)
        self._timed = []


def take_rows(a: np.ndarray | Pending, rows: np.ndarray) -> np.ndarray | Pending:
    """``a[rows]`` (a boolean or index array over the first axis), now or when the copy is resolved."""
    return a.then(lambda x: x[rows]) if isinstance(a, Pending) else a[rows]


def resolve(arrays: dict[str, Any]) -> dict[str, np.ndarray]:
    """A captured batch with every :class:`Pending` copy waited for (name -> numpy array, same order)."""
    return {k: v.numpy() if isinstance(v, Pending) else v for k, v in arrays.items()}


def transfer_for(device: torch.device | str) -> Transfer:
    """The dump's transfer for a model on ``device``: overlapping on CUDA, synchronous (unchanged) elsewhere."""
    return Transfer(device, asynchronous=torch.device(device).type == "cuda")
