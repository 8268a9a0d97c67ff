"""States of chosen layers inside the loop block, every loop (opt-in ``dump.layers``; SPEC §1 ``layer_hidden``).

A looped block of L layers computes L intermediate states per loop; the store's ``hidden`` keeps only the last
(the loop output). ``dump.layers: [0, 2]`` also keeps the outputs of layers 0 and 2 of the block at every loop, as
``layer_hidden`` [token, loop, layer, d_model] in the states' dtype (``layer`` indexes the listed layers, in the
order given; the store's ``layers`` attribute names them). Huginn's users ask for exactly this (its 4 core layers ×
32 recurrences; github.com/seal-rg/recurrent-pretraining/issues/24).

How: a second forward pass of the batch with a forward hook on each chosen layer of each looped group (the adapter's
:meth:`~looptrace.models.interface.LoopedModelAdapter.loop_layers`); the k-th call of layer j of group g is that
layer's output at the group's k-th loop. The model's own forward runs unchanged, so the states are exactly those it
computes. The cost: one more forward per batch, and the bytes that :func:`size_line` prints before the store is
created (a subset of layers keeps them bounded).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from looptrace.capture.encode import encode_states_counted
from looptrace.config import ConfigError
from looptrace.models.interface import LoopedModelAdapter

#: The store array this module writes.
LAYER_ARRAY = "layer_hidden"


def check_layers(adapter: LoopedModelAdapter, layers: Sequence[int]) -> None:
    """Refuse, before anything is written, a layer index outside some looped group's block.

    Raises:
        ConfigError: one line naming the index, the block sizes and the fix.
    """
    if len(set(layers)) != len(layers):
        raise ConfigError(f"dump.layers lists a layer twice: {list(layers)}")
    groups = sorted(set(adapter.info.loop_group))
    try:
        sizes = [len(adapter.loop_layers(g)) for g in groups]
    except NotImplementedError as exc:
        raise ConfigError(str(exc)) from None
    for j in layers:
        if not 0 <= int(j) < min(sizes):
            raise ConfigError(f"dump.layers: layer {j} is not in every looped block (blocks of {sizes} layers); "
                              f"give indices 0..{min(sizes) - 1}")


def layer_bytes(n_tokens: int, n_loops: int, n_layers: int, d_model: int, itemsize: int) -> int:
    """Uncompressed bytes of ``layer_hidden``."""
    return int(n_tokens) * int(n_loops) * int(n_layers) * int(d_model) * int(itemsize)


def size_line(label: str, n_tokens: int, n_loops: int, layers: Sequence[int], d_model: int, dtype: str) -> str:
    """What ``dump.layers`` costs, said before the store is created (uncompressed; zstd keeps ~0.85 of states)."""
    item = 2 if dtype in ("float16", "bfloat16") else 4
    b = layer_bytes(n_tokens, n_loops, len(layers), d_model, item)
    return (f"{label}: dump.layers {list(layers)} adds layer_hidden [{n_tokens}, {n_loops}, {len(layers)}, {d_model}] "
            f"{dtype} = {b / 2**20:.1f} MiB uncompressed ({len(layers)}x the states 'hidden')")


@torch.no_grad()
def layer_states(adapter: LoopedModelAdapter, input_ids: torch.Tensor, layers: Sequence[int]) -> torch.Tensor:
    """Outputs of the chosen loop-block layers at every loop: [batch, seq, loop, len(layers), d_model].

    Args:
        adapter: a model with :meth:`~looptrace.models.interface.LoopedModelAdapter.loop_layers`.
        input_ids: [batch, seq] token ids.
        layers: indices into each looped group's block.
    """
    loop_group = list(adapter.info.loop_group)
    seen: dict[tuple[int, int], list[torch.Tensor]] = {}
    handles = []

    def hook(key: tuple[int, int]) -> Callable:
        def record(_module, _inputs, output) -> None:
            out = output[0] if isinstance(output, tuple) else output
            seen.setdefault(key, []).append(out.detach())
        return record

    try:
        for g in sorted(set(loop_group)):
            block = adapter.loop_layers(g)
            for j in layers:
                handles.append(block[int(j)].register_forward_hook(hook((g, int(j)))))
        adapter.states(input_ids)
    finally:
        for h in handles:
            h.remove()
    k_of = [loop_group[:t].count(g) for t, g in enumerate(loop_group)]  # the loop's index within its group
    per_loop = [torch.stack([seen[(g, int(j))][k] for j in layers], dim=2) for g, k in zip(loop_group, k_of, strict=True)]
    return torch.stack(per_loop, dim=2)


def capture_layer_states(adapter: LoopedModelAdapter, input_ids: torch.Tensor, layers: Sequence[int],
                         select: Callable[[torch.Tensor], torch.Tensor], hidden_dtype: str, where: str
                         ) -> tuple[np.ndarray, np.ndarray | None]:
    """The dump's hook: ``layer_hidden`` of one batch's scored rows, cast to the stored dtype.

    Returns:
        (encoded [n_scored, loop, layer, d_model], per-row NaN/Inf count or None when there is none).
    """
    x = select(layer_states(adapter, input_ids, layers))
    return encode_states_counted(x, hidden_dtype, f"{where}: '{LAYER_ARRAY}'")


__all__ = ["LAYER_ARRAY", "capture_layer_states", "check_layers", "layer_bytes", "layer_states", "size_line"]
