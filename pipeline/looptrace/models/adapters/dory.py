"""``dory``: transformers' native ``DoryForCausalLM`` (prelude / recurrent / coda, ``n_recurrent_loops``).

Loop t runs ``h ← R(norm(h) + norm(prelude))`` through the recurrent layers; h_t is the output of the last recurrent
layer after pass t, h_0 the prelude output (the embeddings if there is no prelude). Exit at loop t = coda layers +
final L2 norm + ``DoryLMHead`` (with its per-token logit scale) applied to h_t, replayed with the coda's recorded
call arguments (:mod:`looptrace.models.adapters.base`). :class:`DoryDecoder` decodes loop by loop with the
recurrent layers' KV per loop (or Dory's own ``last_loop`` cache mode for the ``native`` policy).
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

from looptrace.config import InputError
from looptrace.models.adapters.base import Call, Context, HFAdapter, hooks, recording, recording_calls, replay
from looptrace.models.adapters.decoding import LayerListDecoder
from looptrace.models.interface import States


class DoryAdapter(HFAdapter):
    """``DoryForCausalLM``: prelude → recurrent section × ``n_recurrent_loops`` → coda (see module doc)."""

    def __init__(self, model, cfg, device="cpu"):
        base = model.model
        if cfg.n_loops is not None:
            base.config.n_recurrent_loops = cfg.n_loops
        c = base.config
        self.P, self.R, self.C = c.n_input_layers, c.n_recurrent_layers, c.n_output_layers
        if self.R < 1:
            raise InputError(f"dump.adapter.path '{cfg.path}': Dory checkpoint has no recurrent layers")
        super().__init__(model, cfg, device)

    def _shape(self):
        return self.model.model.config.n_recurrent_loops, self.model.config.hidden_size, self.model.lm_head.out_features

    def _states(self, ids):
        base = self.model.model
        L = len(base.layers)
        loops: list[torch.Tensor] = []
        init: list[torch.Tensor] = []
        coda: list[Call] = []
        last = base.layers[self.P + self.R - 1]
        first = base.layers[self.P - 1] if self.P > 0 else base.embed_tokens
        calls: list[Call] = []  # the recurrent layers' calls, every loop (the loop step replays them)
        with hooks(last.register_forward_hook(lambda m, a, o: loops.append(o)),
                    first.register_forward_hook(lambda m, a, o: init.append(o) if not init else None)), \
                recording_calls(self.loop_layers(0), calls), recording(base.layers, range(L - self.C, L), coda):
            base(input_ids=ids, use_cache=False)
        hidden = torch.stack(loops, dim=2)
        self._ctx = Context(tuple(ids.shape), coda, step={"calls": calls})
        return States(hidden=hidden, hidden_init=init[0])

    def loop_layers(self, group: int) -> list[nn.Module]:
        """The recurrent layers ``[P, P + R)``."""
        base: Any = self.model.model  # transformers' DoryModel (attributes mypy cannot see through nn.Module)
        return list(base.layers[self.P:self.P + self.R])

    def loop_step(self, h: torch.Tensor, h0: torch.Tensor, loop: int) -> torch.Tensor:
        """``DoryModel``'s loop: h ← R(norm(h) + norm(h_0)) (h_0 the prelude output), the recurrent layers called
        with the arguments the model's own forward gave them at this loop."""
        calls = self._step_context(h, loop)["calls"]
        base: Any = self.model.model
        x = base.norm(h) + base.norm(h0)
        for layer, call in zip(self.loop_layers(0), calls[loop * self.R:(loop + 1) * self.R], strict=True):
            x = replay(layer, call, x)
        return x

    def _readout(self, h, loop):
        base = self.model.model
        L = len(base.layers)
        for i, call in zip(range(L - self.C, L), self._ctx.coda, strict=True):
            h = replay(base.layers[i], call, h)
        return self.model.lm_head(base.norm(h))


class DoryDecoder(LayerListDecoder):
    """``DoryForCausalLM``: prelude → (norm(h) + norm(prelude)) → recurrent layers × T → coda → L2 norm → head."""

    def __init__(self, adapter: DoryAdapter, policy: str, **options):
        base = cast(torch.nn.Module, adapter.model.model)
        mode = getattr(base.config, "recurrent_kv_cache_mode", "per_loop")
        self.native = "compact" if mode == "last_loop" else None
        self.native_name = ("Dory recurrent_kv_cache_mode last_loop: one KV per recurrent layer, the last loop a "
                            "position ran" if mode == "last_loop" else
                            f"Dory recurrent_kv_cache_mode '{mode}' keeps every loop's KV and has no rule for the "
                            "loops a token skipped (its last_loop mode has)")
        self.shared_loops = mode == "last_loop"
        super().__init__(adapter, policy, **options)
        self.P, self.R, self.C = adapter.P, adapter.R, adapter.C

    def _layer_kwargs(self, layer):
        return {"attention_mask": None, "position_embeddings": self.pe[layer.attention_type]}

    def start(self, ids):
        base = self._base()
        self._point(None)
        h = base.embed_tokens(ids[:, None])
        self._positions(h)
        self.pe = {a: base.rotary_emb(h, self.pid, a) for a in {layer.attention_type for layer in base.layers}}
        for i in range(self.P):
            h = self._layer(i, h)
        return base.norm(h), h

    def step(self, t, h, inj, rows):
        self._point(rows, t)
        x = self._base().norm(h) + inj
        for i in range(self.P, self.P + self.R):
            x = self._layer(i, x)
        return x

    def readout(self, h, t, rows):
        self._point(rows)
        L = len(self._base().layers)
        for i in range(L - self.C, L):
            h = self._layer(i, h)
        return self.model.lm_head(self._base().norm(h)).float()


DoryAdapter.decoder = DoryDecoder


__all__ = ["DoryAdapter", "DoryDecoder"]
