"""What the adapters' loop-by-loop decoders share (each kind's decoder is in its own module: ``dory``, ``retrofit``,
``ouro``, ``huginn``, ``nanbeige``), and :func:`hf_decoder`, which picks an adapter's.

Each runs the model's **own** modules — its embedding, decoder layers / ``iterate_one_step``, norms, coda and head
— in the order its forward does, one position at a time (:class:`looptrace.models.decode.LoopDecoder`), with a
cache object passed where the model's attention expects its cache: the layers call ``update(key, value, index,
...)`` on it exactly as they call their own cache, so the attention maths is the model's. The cache is

- looptrace's :class:`~looptrace.models.kv.LoopKVCache` (policies ``share`` and ``recompute``; one slot per
  (loop, layer), batch compaction), addressed through the model's own index layout — Huginn: ``block_idx``
  (prelude 0..P−1, core P + Lc·step + layer, coda −1, −2); Ouro: ``current_ut·L + layer_idx``; Nanbeige:
  ``layer_idx + loop_idx·L``; Dory and retrofit: the layer index, with the loop set by the decoder; or
- the model's own cache for ``native``: Huginn's ``HuginnDynamicCache(lookup_strategy=...)`` (rows in lockstep:
  it keeps the batch inside each entry), Ouro's ``UniversalTransformerCache`` (all T steps run, as its
  ``generate``), Nanbeige's ``DynamicCache`` (one slot per loop × layer, all T loops run), Dory's
  ``last_loop`` mode (one slot per recurrent layer: the last loop a position ran).

Exactness: with every token at full depth, each decoder's greedy tokens equal greedy decoding with the model's
own uncached forward (tests/test_generate.py, on the stand-ins that follow the real interfaces). Attention
masks are not needed: one query position attends to every cached key (the cache returns only the last W keys of
a sliding-window layer). The prompt is prefilled one position at a time.

``inkling2loop`` (block attention residuals and relative-position convolutions over the whole pass) has no
decoder.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

import torch

from looptrace.models.adapters.base import HFAdapter
from looptrace.models.decode import DecodeUnsupported, LoopDecoder
from looptrace.models.kv import CODA, LOOP, PRELUDE, LoopKVCache


class SlotCache:
    """A :class:`LoopKVCache` behind a model's own cache call ``update(key, value, index, ...)``; ``where(index)``
    maps the model's index to ``(kind, *layer)``."""

    def __init__(self, kv: LoopKVCache, where):
        self.kv, self.where = kv, where

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        kind, *index = self.where(int(layer_idx))
        return self.kv.update(kind, tuple(index), key_states, value_states)

    def get_seq_length(self, *args, **kwargs) -> int:
        return self.kv.pos


def module_attr(obj, name: str):
    """A class of the module that defined ``obj``'s class (the remote code's own cache classes)."""
    cls = getattr(sys.modules.get(type(obj).__module__), name, None)
    if cls is None:
        raise DecodeUnsupported(f"KV policy native: the model's code ({type(obj).__module__}) has no {name}")
    return cls


class HFDecoder(LoopDecoder):
    """Shared plumbing: shapes from the adapter's info, the position tensors, the cache."""

    model: Any  # the checkpoint's model: its submodules, config and methods are its own code's (duck-typed)

    def __init__(self, adapter: HFAdapter, policy: str, **options):
        super().__init__(policy)
        if policy == "native" and self.native is None:
            raise DecodeUnsupported(f"KV policy native: {self.native_name}")
        self.adapter, self.model = adapter, adapter.model
        self.n_loops, self.d_model, self.vocab_size = adapter.info.n_loops, adapter.info.d_model, adapter.info.vocab_size
        self.device = adapter.device
        self.options = options
        self.kv: LoopKVCache | None = None
        self.cache = None

    def _positions(self, x: torch.Tensor) -> None:
        self.pid = torch.tensor([[self.pos]], device=self.device)
        self.cp = torch.tensor([self.pos], device=self.device)

    def _point(self, rows: torch.Tensor | None, loop: int | None = None) -> None:
        if self.kv is not None:
            self.kv.pos, self.kv.rows = self.pos, rows
            if loop is not None:
                self.kv.loop = loop
        elif rows is not None:
            raise RuntimeError("the model's own cache decodes every row together")

    def share(self, rows, t):
        if self.kv is not None:
            self.kv.pos = self.pos
            self.kv.share(rows, t)

    def _chunk(self, h: torch.Tensor, q: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Position ids [1, q] and the additive causal mask [1, 1, q, pos+q] of a chunk of q positions after the
        ``pos`` cached ones (speculative verification: query i sees keys ≤ pos + i; the model's attention slices it
        to the keys it holds)."""
        p = self.pos
        pid = torch.arange(p, p + q, device=self.device)[None]
        allowed = torch.ones(q, p + q, dtype=torch.bool, device=self.device).tril(diagonal=p)
        mask = torch.zeros(1, 1, q, p + q, dtype=h.dtype, device=self.device)
        return pid, mask.masked_fill(~allowed, torch.finfo(h.dtype).min)


class LayerListDecoder(HFDecoder):
    """Decoders that call a transformers decoder-layer list (Dory, retrofit): prelude / loop / coda ranges."""

    P = R = C = 0  # prelude layers, loop-block layers, coda layers
    shared_loops = False

    def _base(self):
        return self.model.model

    def _windows(self) -> dict:
        base = self._base()
        W = getattr(base.config, "sliding_window", None)
        out = {}
        for i, layer in enumerate(base.layers):
            if getattr(layer, "attention_type", "full_attention") == "sliding_attention" and W:
                kind, j = self._where_static(i)
                out[(kind, j)] = int(W)
        return out

    def _where_static(self, i: int) -> tuple[str, int]:
        if i < self.P:
            return PRELUDE, i
        if i < self.P + self.R:
            return LOOP, i - self.P
        return CODA, i - self.P - self.R

    def _where(self, i: int):
        kind, j = self._where_static(i)
        assert self.kv is not None  # the SlotCache that calls this is built by reset(), after the kv
        return (LOOP, self.kv.loop, j) if kind == LOOP else (kind, j)

    def reset(self, prompts, max_len):
        B = prompts.shape[0]
        self.kv = LoopKVCache(B, max_len, self.n_loops, self.R, self.P, self.C,
                              shared_loops=self.shared_loops and self.policy == "native", windows=self._windows(),
                              device=self.device)
        self.cache = SlotCache(self.kv, self._where)
        layer = self._base().layers[0]
        params = inspect.signature(layer.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self.pos = 0

    def _layer_kwargs(self, layer) -> dict:
        """The keyword arguments of ``layer``'s call besides the cache (each decoder's own)."""
        raise NotImplementedError

    def _layer(self, i: int, h: torch.Tensor) -> torch.Tensor:
        layer = self._base().layers[i]
        out = layer(h, **self._layer_kwargs(layer), **{self._cache_kw: self.cache})
        return out[0] if isinstance(out, tuple) else out



def hf_decoder(adapter, policy: str, **options) -> LoopDecoder:
    """The decoder of an adapter of :func:`looptrace.models.adapters.loading.load_adapter` for ``policy``: its
    class's ``decoder``.

    Raises:
        DecodeUnsupported: the kind has no decoder (``inkling2loop``), or no ``native`` policy, or Huginn's noise.
    """
    cls = type(adapter)
    decoder = getattr(cls, "decoder", None)
    if decoder is None:
        kind = getattr(getattr(adapter, "cfg", None), "kind", cls.__name__)
        why = getattr(cls, "no_decoder", None)
        raise DecodeUnsupported(f"adapter kind '{kind}' has no loop-by-loop decoder{f' ({why})' if why else ''}")
    with adapter._remote_code_errors():
        return decoder(adapter, policy, **options)


__all__ = ["HFDecoder", "LayerListDecoder", "SlotCache", "hf_decoder", "module_attr"]
