"""Batch-invariant inference kernels: one token's numbers do not depend on what else is in the batch.

A CPU (or GPU) BLAS picks its kernel by the matrix shapes, so the float32 result of one row of ``x @ W.T`` depends
on how many rows ``x`` has and where the row sits (MKL: one row runs a GEMV, 2–3 rows a small-M kernel, the rest a
blocked GEMM whose edge tiles accumulate in another order), and the CPU attention kernel sums a query's keys in
SIMD lanes whose grouping depends on the key count (a causal query's result changes when later positions are cut
off). looptrace compares the same token's decisions across batch shapes: early exit with compaction (exited rows
leave the batch, :mod:`looptrace.online.engine`, :mod:`looptrace.online.generate`) against masking, the
lookahead path and the dump's full-batch forward. Those are equal bit for bit only when every row is computed by
one operation order, whatever its batch — which is what this mode gives:

- ``F.linear`` (every ``nn.Linear``): each row as its own [1, K] × [K, N] problem of one batched product
  (``torch.bmm`` over rows: the same problem shape for every row, so the same kernel and summation order);
- ``F.scaled_dot_product_attention``: every (batch, head) as products of one shape, the keys padded with masked
  entries to a multiple of :data:`KEY_TILE` and each query at its absolute row (:func:`attention`), so a query's
  numbers do not depend on how many later positions exist or whether it is decoded alone;
- (row reductions over a long vocabulary, which ATen orders differently for a lone row: the logit signals use
  :func:`looptrace.signals.rowwise.row_sum` in every mode.)

looptrace's own model (:class:`~looptrace.models.looped.LoopedTransformer`) runs these kernels whenever it runs
without autograd (the dump, the online engine, generation, evaluation) and the fast ones in training (nothing there
is compared across batch shapes): its layers are :class:`Linear` and its attention calls :func:`sdpa`, which switch
on :func:`active`, set by :func:`inference_kernels` on the model's methods — the same functions the mode
(:class:`BatchInvariant`) substitutes, without a Python hook on every other torch call. The mode stays for modules
that are not the model's (a refit gate's network). Their cost is measured in docs/generate.md. Models of the
adapters run their published code unchanged (their kernels, their bits).

The property is checked in tests/test_invariant.py for every row count 1..16 and row position, under each CPU
code path CI runs (``ATEN_CPU_CAPABILITY`` default / ``avx2``, ``MKL_ENABLE_INSTRUCTIONS=AVX2``).
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

#: Keys are padded to a multiple of this many entries (module docstring).
KEY_TILE = 64


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` row by row: [..., K] × [N, K]ᵀ (+ [N]) -> [..., N], each row one [1, K] × [K, N] product."""
    K, N = x.shape[-1], weight.shape[0]
    rows = x.reshape(-1, 1, K).contiguous()  # [M, 1, K]
    M = rows.shape[0]
    # the weight's transpose as one stride-0 batch: every row's problem reads the same [K, N] operand
    out = torch.bmm(rows, weight.t().unsqueeze(0).expand(M, K, N))  # [M, 1, N]
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], N)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
              dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
              enable_gqa: bool = False, key_length: int | None = None) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` (same arguments and semantics for inference) in one fixed-shape form.

    Every (batch, head) runs the same two products whatever the sequence: the keys/values are padded with masked
    entries to L, a multiple of :data:`KEY_TILE`, and the queries are placed at their absolute rows of an
    [L, E] matrix (query i of S_q new ones at row S_k − S_q + i: a decoded query sits where it sits in the
    full causal pass), so a query's scores, softmax and weighted sum of values are computed at the same row of
    products of the same shapes — the same operation order — in the full pass, a truncated one and a decoded one.

    Args:
        q: [..., H, S_q, E]; k: [..., H_k, S_k, E]; v: [..., H_k, S_k, E_v]; S_q ≤ S_k (new queries are the
            last S_q positions, the KV-cache convention).
        attn_mask: bool (True = attend) or additive float, broadcastable to [..., H, S_q, S_k].
        is_causal: query i attends to keys j ≤ i (needs S_q = S_k, as the full pass has).
        key_length: L itself (the model's context length, which every pass of the model fits): then every pass
            runs products of exactly one shape. None: S_k rounded up to a multiple of :data:`KEY_TILE`.

    Returns:
        [..., H, S_q, E_v].
    """
    if dropout_p:
        raise ValueError("batch-invariant attention is for inference: dropout_p must be 0")
    H, S_q, E = q.shape[-3], q.shape[-2], q.shape[-1]
    if enable_gqa and k.shape[-3] != H:
        rep = H // k.shape[-3]
        k, v = k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3)
    S_k = k.shape[-2]
    if S_q > S_k or (is_causal and S_q != S_k):
        raise ValueError(f"batch-invariant attention: {S_q} queries over {S_k} keys (queries are the last keys' "
                         "positions; is_causal needs as many queries as keys)")
    L = key_length if key_length is not None and key_length >= S_k else \
        max(KEY_TILE, math.ceil(S_k / KEY_TILE) * KEY_TILE)
    off = S_k - S_q  # the queries' absolute rows: off .. S_k − 1
    qp = F.pad(q, (0, 0, off, L - S_k)).contiguous()  # [..., H, L, E]
    kt = F.pad(k, (0, 0, 0, L - S_k)).transpose(-2, -1).contiguous()  # [..., H, E, L]
    vp = F.pad(v, (0, 0, 0, L - S_k)).contiguous()  # [..., H, L, E_v]
    s = scale if scale is not None else 1.0 / math.sqrt(E)
    scores = torch.matmul(qp, kt) * s  # [..., H, L, L]
    col = torch.arange(L, device=q.device)
    allowed = (col < S_k).expand(L, L)  # the padding is never attended
    if is_causal:
        allowed = allowed & (col[None, :] <= col[:, None])
    neg = torch.tensor(float("-inf"), dtype=scores.dtype, device=scores.device)
    scores = torch.where(allowed, scores, neg)
    if attn_mask is not None:  # the given rows at the queries' rows; the other rows attend everything real
        if attn_mask.dtype == torch.bool:
            m = F.pad(attn_mask, (0, L - S_k, off, L - S_k), value=True) & (col < S_k)
            scores = torch.where(m, scores, neg)
        else:
            scores = scores + F.pad(attn_mask, (0, L - S_k, off, L - S_k))
    p = torch.softmax(scores, dim=-1)  # [..., H, L, L]; masked and padded entries exactly 0
    return torch.matmul(p, vp)[..., off:S_k, :]  # [..., H, S_q, E_v]


_STATE = threading.local()


def _keys() -> list:
    """This thread's stack of active modes' key lengths (the innermost last)."""
    stack = getattr(_STATE, "keys", None)
    if stack is None:
        stack = _STATE.keys = []
    return stack


class BatchInvariant(TorchFunctionMode):
    """The mode: ``F.linear`` and ``F.scaled_dot_product_attention`` replaced by their row-wise forms, for any
    module run inside it (looptrace's own model needs no mode: :func:`inference_kernels`).

    Args:
        key_length: the model's context length: attention pads every key sequence to it (one shape for every pass
            of the model, :func:`attention`); None: to a multiple of :data:`KEY_TILE`.
    """

    def __init__(self, key_length: int | None = None):
        super().__init__()
        self.key_length = key_length

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            return linear(*args, **kwargs)
        if func is F.scaled_dot_product_attention:
            return attention(*args, key_length=self.key_length, **kwargs)
        return func(*args, **kwargs)

    def __enter__(self):
        _keys().append(self.key_length)
        return super().__enter__()

    def __exit__(self, *exc):
        _keys().pop()
        return super().__exit__(*exc)


def active() -> bool:
    """Whether this thread runs batch-invariant kernels (inside a :class:`BatchInvariant` mode or a method of
    :func:`inference_kernels`)."""
    return bool(getattr(_STATE, "keys", None))


class Linear(nn.Linear):
    """``nn.Linear`` that runs :func:`linear` while :func:`active` (the same parameters, init and state-dict keys):
    the layers of looptrace's own model, so that its inference needs no :class:`BatchInvariant` mode, whose Python
    hook on every torch call cost ~1 ms of a 4.4 ms batch-1 forward."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if active():
            return linear(input, self.weight, self.bias)
        return F.linear(input, self.weight, self.bias)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """``F.scaled_dot_product_attention``, or :func:`attention` at the innermost active key length while
    :func:`active`."""
    if active():
        return attention(q, k, v, key_length=_keys()[-1], **kwargs)
    return F.scaled_dot_product_attention(q, k, v, **kwargs)


def inference_kernels(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate a model method: without autograd its :class:`Linear` layers and :func:`sdpa` calls run the
    batch-invariant kernels (module docstring) with the model's context length ``self.cfg.block_size`` as the
    attention's key length; with autograd (training) the default kernels."""

    @functools.wraps(fn)
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled() or active():
            return fn(self, *args, **kwargs)
        keys = _keys()
        keys.append(self.cfg.block_size)
        try:
            return fn(self, *args, **kwargs)
        finally:
            keys.pop()

    return wrapped


__all__ = ["KEY_TILE", "BatchInvariant", "Linear", "active", "attention", "inference_kernels", "linear", "sdpa"]
