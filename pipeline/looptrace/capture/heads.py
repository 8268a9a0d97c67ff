"""Attention entropy and loop-to-loop Jensen–Shannon divergence of every head (opt-in ``dump.heads``; SPEC §2c).

A looped block's attention heads run once per loop. ``dump.heads: [0]`` records, for layer 0 of every looped block,
each head's attention distribution over the keys of every query position at every loop — never storing it — and
keeps two numbers per (token, loop, layer, head):

- ``head_entropy`` H = −Σ_j a_j log a_j (nats) of the head's attention row a = softmax(q kᵀ / √d_head + mask) of the
  token's query position;
- ``head_js`` JS(a_t ‖ a_{t−1}) = ½ KL(a_t ‖ m) + ½ KL(a_{t−1} ‖ m), m = ½ (a_t + a_{t−1}) (nats, in [0, log 2]),
  between the same head's rows at loop t and at the previous iteration of the same layer (same query position);
  NaN at the first loop of each looped group (no earlier iteration of that layer).

How: forward hooks on the chosen layers' :class:`~looptrace.models.looped.SelfAttention` modules during the dump's
own forward pass. A hook reads the module's input x ([batch, seq, d_model], the normed stream the attention sees),
computes q and k with the module's own projection and the weights explicitly in float64 (the model's inference
attention, :mod:`looptrace.models.invariant`, never materialises them), reduces them to the two numbers and keeps
only the last loop's weights per layer for the next divergence. A hook returns nothing, so the model's outputs —
the stored states — are the same bits with the option on or off (tests/test_heads.py). Only looptrace's own models
expose the module (an adapter's attention is the published code's; :func:`check_heads` refuses them).

Cost: the attention weights once more in float64 per chosen layer and loop, [batch, head, seq, seq] (measured in
docs/dump.md), and 2 × 4 bytes per (token, loop, layer, head) stored.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from looptrace.config import ConfigError
from looptrace.models.interface import LoopedModelAdapter
from looptrace.models.looped import SelfAttention

#: The store arrays this module writes (both [token, loop, layer, head] float32).
HEAD_ARRAYS = ("head_entropy", "head_js")


def attention_of(layer: torch.nn.Module) -> SelfAttention | None:
    """The self-attention over positions of a looped layer (``Layer`` or ``SandwichLayer``), or None."""
    attn = getattr(layer, "attn", None)
    return attn if isinstance(attn, SelfAttention) else None


def check_heads(adapter: LoopedModelAdapter, layers: Sequence[int]) -> int:
    """Refuse, before anything is written, what ``dump.heads`` cannot measure; return the heads per layer.

    Raises:
        ConfigError: one line naming the index or the model and the fix.
    """
    if len(set(layers)) != len(layers):
        raise ConfigError(f"dump.heads lists a layer twice: {list(layers)}")
    groups = sorted(set(adapter.info.loop_group))
    try:
        blocks = [adapter.loop_layers(g) for g in groups]
    except NotImplementedError:
        blocks = []
    attns = [attention_of(layer) for block in blocks for layer in block]
    if not blocks or any(a is None for a in attns):
        raise ConfigError(f"dump.heads: model '{adapter.info.name}' exposes no looptrace self-attention in its looped "
                          "block (the head statistics are measured for looptrace's own models); set dump.heads: []")
    sizes = [len(b) for b in blocks]
    for j in layers:
        if not 0 <= int(j) < min(sizes):
            raise ConfigError(f"dump.heads: layer {j} is not in every looped block (blocks of {sizes} layers); "
                              f"give indices 0..{min(sizes) - 1}")
    return int(next(a for a in attns if a is not None).n_head)


def size_line(label: str, n_tokens: int, n_loops: int, layers: Sequence[int], n_head: int) -> str:
    """What ``dump.heads`` adds to the store, said before it is created (uncompressed)."""
    b = 2 * n_tokens * n_loops * len(layers) * n_head * 4
    return (f"{label}: dump.heads {list(layers)} adds head_entropy and head_js [{n_tokens}, {n_loops}, {len(layers)}, "
            f"{n_head}] float32 = {b / 2**20:.1f} MiB uncompressed")


# ---------------------------------------------------------------------------------------------
# The measures (torch; the closed forms are checked in tests/test_heads.py)
# ---------------------------------------------------------------------------------------------

def attention_weights(attn: SelfAttention, x: torch.Tensor) -> torch.Tensor:
    """The module's attention weights softmax(q kᵀ / √d_head + mask) over positions, in float64.

    Args:
        attn: the module.
        x: [batch, seq, d_model] its input (the full sequence, no decoding cache).

    Returns:
        [batch, head, seq (query), seq (key)] float64, rows summing to 1 (exact zeros above the diagonal when
        causal).
    """
    B, S, D = x.shape
    H = attn.n_head
    # the module's own q and k projections (its first 2·D output rows), in float64 by torch.matmul: outside the
    # batch-invariant mode's row-by-row F.linear (the model's own pass uses that; these numbers feed no state)
    w = attn.qkv.weight[:2 * D].double()  # [2D, D]
    b = attn.qkv.bias[:2 * D].double()
    q, k = (x.double() @ w.t() + b).split(D, dim=2)  # [B, S, D] each
    q = q.view(B, S, H, D // H).transpose(1, 2)  # [B, H, S, D/H]
    k = k.view(B, S, H, D // H).transpose(1, 2)
    scores = q @ k.transpose(-2, -1) / math.sqrt(D // H)  # [B, H, S, S]
    if attn.causal:
        allowed = torch.ones(S, S, dtype=torch.bool, device=x.device).tril()
        scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, dim=-1)


def entropy(p: torch.Tensor) -> torch.Tensor:
    """H(p) = −Σ p log p over the last axis (nats; 0 log 0 = 0): [..., n] -> [...]."""
    return -torch.special.xlogy(p, p).sum(-1)


def js_divergence(p: torch.Tensor, q: torch.Tensor, h_p: torch.Tensor | None = None,
                  h_q: torch.Tensor | None = None) -> torch.Tensor:
    """JS(p ‖ q) = ½ KL(p ‖ m) + ½ KL(q ‖ m), m = ½ (p + q), over the last axis (nats, in [0, log 2]).

    Computed as H(m) − ½ H(p) − ½ H(q) (the same quantity; the entropies of the rows are known already when the
    recorder calls it: ``h_p``, ``h_q`` [...]). Give float64 rows: the difference then loses ~1e-15 nats, far
    below the float32 the store keeps; equal rows give exactly 0, and rounding never makes it negative (clamped).
    """
    h_p = entropy(p) if h_p is None else h_p
    h_q = entropy(q) if h_q is None else h_q
    return (entropy(0.5 * (p + q)) - 0.5 * (h_p + h_q)).clamp_min(0.0)


# ---------------------------------------------------------------------------------------------
# Recording during a forward pass
# ---------------------------------------------------------------------------------------------

class HeadRecorder:
    """Per-head entropy and JS of one forward pass, collected by :func:`recording`.

    ``result()`` returns ``(entropy, js)``, each [batch, seq, loop, len(layers), head] float32 (JS NaN at the first
    loop of each group).
    """

    def __init__(self, loop_group: Sequence[int], layers: Sequence[int]):
        self.loop_group = list(loop_group)
        self.layers = [int(j) for j in layers]
        self.entropy: dict[tuple[int, int], list[torch.Tensor]] = {}
        self.js: dict[tuple[int, int], list[torch.Tensor]] = {}
        # the previous iteration's weights and their entropies, per (group, layer)
        self._last: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def hook(self, key: tuple[int, int]) -> Callable:
        def record(module: SelfAttention, inputs: tuple, _output) -> None:
            x, kv = inputs[0], (inputs[1] if len(inputs) > 1 else None)
            if kv is not None:
                raise ValueError("dump.heads records full-sequence forwards only (no decoding cache)")
            a = attention_weights(module, x)  # [B, H, S, S]
            h = entropy(a)  # [B, H, S]
            self.entropy.setdefault(key, []).append(h.transpose(1, 2).float())  # [B, S, H]
            prev = self._last.get(key)
            js = (torch.full_like(h, float("nan")) if prev is None else js_divergence(a, prev[0], h, prev[1]))
            self.js.setdefault(key, []).append(js.transpose(1, 2).float())
            self._last[key] = (a, h)
        return record

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        k_of = [self.loop_group[:t].count(g) for t, g in enumerate(self.loop_group)]  # the loop's index in its group
        out = []
        for rec in (self.entropy, self.js):
            per_loop = [torch.stack([rec[(g, j)][k] for j in self.layers], dim=2)  # [B, S, L, H]
                        for g, k in zip(self.loop_group, k_of, strict=True)]
            out.append(torch.stack(per_loop, dim=2))  # [B, S, T, L, H]
        return out[0], out[1]


@contextmanager
def recording(adapter: LoopedModelAdapter, layers: Sequence[int]) -> Iterator[HeadRecorder]:
    """Hooks on the chosen layers' attention of every looped group while the block runs; the forward pass made
    inside the ``with`` is recorded once (its outputs untouched)."""
    rec = HeadRecorder(adapter.info.loop_group, layers)
    handles = []
    try:
        for g in sorted(set(rec.loop_group)):
            block = adapter.loop_layers(g)
            for j in rec.layers:
                attn = attention_of(block[j])
                assert attn is not None  # check_heads ran before the store was created
                handles.append(attn.register_forward_hook(rec.hook((g, j))))
        yield rec
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def head_stats(adapter: LoopedModelAdapter, input_ids: torch.Tensor, layers: Sequence[int]
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Entropy and JS of the chosen layers' heads at every loop for one batch, from a forward pass of its own.

    Returns:
        (entropy, js), each [batch, seq, loop, len(layers), head] float32.
    """
    with recording(adapter, layers) as rec:
        adapter.states(input_ids)
    return rec.result()


def capture_head_arrays(rec: HeadRecorder, select: Callable[[torch.Tensor], torch.Tensor],
                        host: Callable[[torch.Tensor], Any]) -> dict[str, Any]:
    """The dump's hook: ``head_entropy`` and ``head_js`` of one batch's scored rows ([n_scored, loop, layer, head]),
    through ``host`` (the dump's :meth:`~looptrace.capture.transfer.Transfer.copy`: numpy, or a pending copy)."""
    ent, js = rec.result()
    return {HEAD_ARRAYS[0]: host(select(ent)), HEAD_ARRAYS[1]: host(select(js))}


__all__ = ["HEAD_ARRAYS", "HeadRecorder", "attention_of", "attention_weights", "capture_head_arrays", "check_heads",
           "entropy", "head_stats", "js_divergence", "recording", "size_line"]
