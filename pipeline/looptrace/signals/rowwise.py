"""Row reductions whose value for one row does not depend on how many rows are reduced together.

ATen reduces a single output of ≥ 32768 elements in two passes split across threads, but a batch of rows one
whole row per thread, so a lone row's sum differs in its last bits from the same row's sum inside a batch (a
166k-entry vocabulary at batch 1 against batch 8). The logit signals (:mod:`looptrace.signals.logits`) sum over
the vocabulary with these, so a token's stored value and its online value agree whatever the batch.
"""

from __future__ import annotations

import torch

#: ATen's grain size: a reduction of fewer elements runs on one thread in one pass.
_GRAIN = 32768


def row_sum(x: torch.Tensor) -> torch.Tensor:
    """``x.sum(-1)`` in the order ATen uses for a batch of rows, also for a single row.

    ATen reduces a single output in two passes split across threads when it has ≥ 32768 elements, and a batch of
    rows one whole row per thread: a lone row's sum then differs in its last bits from the same row's sum inside
    a batch. A lone long row is summed as a batch of two (itself twice), so both take the per-row path.
    """
    if x.shape[:-1].numel() == 1 and x.numel() >= _GRAIN and torch.get_num_threads() > 1:
        flat = x.reshape(1, -1)
        return torch.cat([flat, flat]).sum(-1)[:1].reshape(x.shape[:-1])
    return x.sum(-1)


def row_norm(x: torch.Tensor) -> torch.Tensor:
    """``torch.linalg.vector_norm(x, dim=-1)`` with a lone long row reduced as :func:`row_sum` does."""
    if x.shape[:-1].numel() == 1 and x.numel() >= _GRAIN and torch.get_num_threads() > 1:
        flat = x.reshape(1, -1)
        return torch.linalg.vector_norm(torch.cat([flat, flat]), dim=-1)[:1].reshape(x.shape[:-1])
    return torch.linalg.vector_norm(x, dim=-1)


__all__ = ["row_norm", "row_sum"]
