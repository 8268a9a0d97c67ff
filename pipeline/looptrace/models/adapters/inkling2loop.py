"""``inkling2loop``: transformers' native ``Inkling2LoopForCausalLM`` (or the multimodal wrapper's language model).

Layers ``[loop_layer_index_start, loop_layer_index_end)`` run ``loop_num_passes`` times; every pass restarts from the
pre-loop state and receives messages from the previous pass. Its layers read *block attention residuals* — a stack
of block summaries that the coda reads too — so the state after pass t is (h_t, block_states_t): h_t is stored, and
the exit at loop t replays the coda on (h_t, block_states_t) of the same batch (kept from the last ``states`` call),
then ``final_input`` + norm + head + logit softcap. No loop step and no decoder: its passes carry block states beside
h_t.
"""

from __future__ import annotations

import torch

from looptrace.config import InputError
from looptrace.models.adapters.base import Call, Context, HFAdapter, hidden_of, hooks, recording, replay
from looptrace.models.interface import States


class Inkling2LoopAdapter(HFAdapter):
    """``Inkling2LoopForCausalLM`` (or the multimodal wrapper's language model), see module doc."""

    auto_classes = {"inkling2_loop": "AutoModelForImageTextToText"}  # the released multimodal wrapper
    no_decoder = "its layers read whole-pass block states"

    def __init__(self, model, cfg, device="cpu"):
        self.text = getattr(model.model, "language_model", model.model)
        c = self.text.config
        if cfg.n_loops is not None:
            c.loop_num_passes = cfg.n_loops
        self.s, self.e, self.L = c.loop_layer_index_start, c.loop_layer_index_end, c.num_hidden_layers
        super().__init__(model, cfg, device)

    def _shape(self):
        c = self.text.config
        return c.loop_num_passes, c.hidden_size, self.model.lm_head.out_features

    def _states(self, ids):
        tm = self.text
        loops: list[torch.Tensor] = []
        blocks: list[torch.Tensor] = []
        init: list[torch.Tensor] = []
        coda: list[Call] = []

        def on_loop_end(mod, args, kwargs, out):
            # the model appends a block summary *after* a boundary layer (its input state): mirror that so
            # blocks[t] is exactly the block_states the coda would see after pass t
            h_in = hidden_of(args, kwargs)
            b_in = args[1] if len(args) > 1 else kwargs["block_states"]
            blocks.append(torch.cat([b_in, h_in.unsqueeze(-2)], dim=-2) if mod.is_block_boundary else b_in)
            loops.append(out)

        with hooks(tm.layers[self.e - 1].register_forward_hook(on_loop_end, with_kwargs=True),
                    tm.layers[self.s - 1].register_forward_hook(lambda m, a, o: init.append(o))), \
                recording(tm.layers, range(self.e, self.L), coda):
            tm(input_ids=ids, use_cache=False)
        hidden = torch.stack(loops, dim=2)
        self._ctx = Context(tuple(ids.shape), coda, hidden=hidden, blocks=blocks)
        return States(hidden=hidden, hidden_init=init[0])

    def _readout(self, h, loop):
        ctx, tm = self._ctx, self.text
        if not torch.equal(h, ctx.hidden[:, :, loop]):
            raise InputError(f"adapter '{self.info.name}' (inkling2loop): the exit reads the block states of the "
                             "pass, so readout(h, t) only accepts the h_t of the last states() call")
        block = ctx.blocks[loop]
        for i, call in zip(range(self.e, self.L), ctx.coda, strict=True):
            layer = tm.layers[i]
            new = replay(layer, call, h, block)
            if layer.is_block_boundary:
                block = torch.cat([block, h.unsqueeze(-2)], dim=-2)
            h = new
        h = tm.final_input(block, h)[0]
        h = tm.norm(h).to(tm.embed_tokens.weight.dtype)
        return self.model.logit_softcap(self.model.lm_head(h).float())

    def _reference(self, ids):
        return self.info.n_loops - 1, self.model(input_ids=ids, use_cache=False).logits


__all__ = ["Inkling2LoopAdapter"]
