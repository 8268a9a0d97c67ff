"""Row reductions whose value for one row does not depend on how many rows are reduced together.

ATen reduces a single output of ≥ 32768 elements in two passes split across threads, but a batch of rows one
whole row per thread, so a lone row's sum differs in its last bits from the same row's sum inside a batch (a
166k-entry vocabulary at batch 1 against batch 8). The logit signals (:mod:`looptrace.signals.logits`) sum over
the vocabulary with these, so a token's stored value and its online value agree whatever the batch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

#: ATen's grain size: a reduction of fewer elements runs on one thread in one pass.
_GRAIN = 32768


def _as_in_a_batch(reduce: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``reduce`` over the last dim of ``x``; a lone long row (ATen's two-pass case) reduced as a batch of two
    (itself twice), so it takes the per-row path a batch takes."""
    if x.shape[:-1].numel() == 1 and x.numel() >= _GRAIN and torch.get_num_threads() > 1:
        flat = x.reshape(1, -1)
        return reduce(torch.cat([flat, flat]))[:1].reshape(x.shape[:-1])
    return reduce(x)


def row_sum(x: torch.Tensor) -> torch.Tensor:
    """``x.sum(-1)`` in the order ATen uses for a batch of rows, also for a single row.

    ATen reduces a single output in two passes split across threads when it has ≥ 32768 elements, and a batch of
    rows one whole row per thread: a lone row's sum then differs in its last bits from the same row's sum inside
    a batch.
    """
    return _as_in_a_batch(lambda y: y.sum(-1), x)


def row_norm(x: torch.Tensor) -> torch.Tensor:
    """``torch.linalg.vector_norm(x, dim=-1)`` with a lone long row reduced as :func:`row_sum` does."""
    return _as_in_a_batch(lambda y: torch.linalg.vector_norm(y, dim=-1), x)


__all__ = ["row_norm", "row_sum"]
