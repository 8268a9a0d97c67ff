"""``retrofit``: any standard decoder (Llama / Qwen / Mistral style: ``model.model.layers``, ``model.model.norm``,
``model.lm_head``) with the contiguous block of layers ``[start, end)`` run ``n_loops`` times (RecurTrace's setup, [RT]).

h_t = the block's output after pass t, h_0 = the block's input; passes 2..k replay the block layers with the
arguments recorded in the model's own forward (:mod:`looptrace.models.adapters.base`). Exit = layers ``[end, L)`` +
final norm + head (+ ``final_logit_softcapping`` when the config has it). Loop 1 is the unmodified model, which the
exit check compares against. :class:`RetrofitDecoder` decodes loop by loop.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from looptrace.config import ConfigError, InputError
from looptrace.models.adapters.base import Call, Context, HFAdapter, hidden_of, recording, replay, stripped
from looptrace.models.adapters.decoding import LayerListDecoder
from looptrace.models.interface import States


class RetrofitAdapter(HFAdapter):
    """A standard decoder with layers ``[start, end)`` looped ``n_loops`` times ([RT]'s retrofit)."""

    needs_block = True

    def __init__(self, model, cfg, device="cpu"):
        base = getattr(model, "model", None)
        if base is None or not hasattr(base, "layers") or not hasattr(base, "norm") or \
                model.get_output_embeddings() is None:
            raise InputError(f"dump.adapter.path '{cfg.path}': kind retrofit needs a decoder with model.layers, "
                             f"model.norm and an lm_head ({type(model).__name__} has not)")
        L = len(base.layers)
        self.start, self.end = int(cfg.block[0]), int(cfg.block[1])
        if self.end > L:
            raise ConfigError(f"dump.adapter.block [{self.start}, {self.end}) exceeds the model's {L} layers")
        self.softcap = getattr(model.config, "final_logit_softcapping", None)
        super().__init__(model, cfg, device)

    def _shape(self):
        return self.cfg.n_loops, self.model.config.hidden_size, self.model.get_output_embeddings().out_features

    def _states(self, ids):
        base = self.model.model
        L = len(base.layers)
        calls: list[Call] = []
        with recording(base.layers, range(self.start, L), calls):
            base(input_ids=ids, use_cache=False)
        if len(calls) != L - self.start:
            raise InputError(f"adapter '{self.info.name}': expected {L - self.start} calls of layers "
                             f"{self.start}..{L - 1}, saw {len(calls)}")
        h0 = hidden_of(*calls[0])
        block = calls[: self.end - self.start]
        h, loops = h0, []
        for _ in range(self.cfg.n_loops):
            for i, call in zip(range(self.start, self.end), block, strict=True):
                h = replay(base.layers[i], call, h)
            loops.append(h)
        self._ctx = Context(tuple(ids.shape), calls[self.end - self.start:],
                             step={"calls": [stripped(*c) for c in block]})
        return States(hidden=torch.stack(loops, dim=2), hidden_init=h0)

    def loop_layers(self, group: int) -> list[nn.Module]:
        """The looped block ``[start, end)``."""
        base: Any = self.model.model  # a decoder's base model (model.layers)
        return list(base.layers[self.start:self.end])

    def loop_step(self, h: torch.Tensor, h0: torch.Tensor, loop: int) -> torch.Tensor:
        """One pass through the block, each layer called with the arguments of its call in the model's forward
        (exactly what :meth:`states` replays)."""
        calls = self._step_context(h, loop)["calls"]
        for layer, call in zip(self.loop_layers(0), calls, strict=True):
            h = replay(layer, call, h)
        return h

    def _readout(self, h, loop):
        base = self.model.model
        L = len(base.layers)
        for i, call in zip(range(self.end, L), self._ctx.coda, strict=True):
            h = replay(base.layers[i], call, h)
        logits = self.model.get_output_embeddings()(base.norm(h)).float()
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def _reference(self, ids):
        return 0, self.model(input_ids=ids, use_cache=False).logits  # pass 1 = the unlooped model


class RetrofitDecoder(LayerListDecoder):
    """A standard decoder with layers ``[start, end)`` looped T times (the ``retrofit`` adapter)."""

    native_name = "none (a retrofitted decoder has no KV policy of its own)"

    def __init__(self, adapter: RetrofitAdapter, policy: str, **options):
        super().__init__(adapter, policy, **options)
        L = len(self._base().layers)
        self.P, self.R, self.C = adapter.start, adapter.end - adapter.start, L - adapter.end
        self.softcap = adapter.softcap
        self.mask: torch.Tensor | None = None  # a verification chunk's causal mask (None: one position)
        # a sliding-window layer's cache read keeps only the last W keys of the chunk's last position
        self.chunk_verify = not self._windows()

    def _layer_kwargs(self, layer):
        return {"attention_mask": self.mask, "position_ids": self.pid, "use_cache": True,
                "position_embeddings": self.pe}

    def verify(self, ids, inj, h, k):
        if not self.chunk_verify or h is None:
            return super().verify(ids, inj, h, k)
        # loops k+1..T and the coda over the chunk, the model's own layers with an explicit causal mask (its
        # attention would align a multi-token query top-left without one); numbers equal decoding one position at
        # a time where the BLAS is row-invariant
        self.pid, self.mask = self._chunk(h, ids.shape[1])
        self.pe = self._base().rotary_emb(h, self.pid)
        try:
            for t in range(k, self.n_loops):
                h = self.step(t, h, inj, None)
            z = self.readout(h, self.n_loops - 1, None)
        finally:
            self.mask = None
        self.pos += ids.shape[1]
        return z

    def start(self, ids):
        base = self._base()
        self._point(None)
        h = base.embed_tokens(ids[:, None])
        self._positions(h)
        self.pe = base.rotary_emb(h, self.pid)
        for i in range(self.P):
            h = self._layer(i, h)
        return None, h

    def step(self, t, h, inj, rows):
        self._point(rows, t)
        for i in range(self.P, self.P + self.R):
            h = self._layer(i, h)
        return h

    def readout(self, h, t, rows):
        self._point(rows)
        base = self._base()
        L = len(base.layers)
        for i in range(L - self.C, L):
            h = self._layer(i, h)
        logits = self.model.get_output_embeddings()(base.norm(h)).float()
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


RetrofitAdapter.decoder = RetrofitDecoder


__all__ = ["RetrofitAdapter", "RetrofitDecoder"]
