"""``ouro``: Ouro (remote code ``modeling_ouro.py``, ``trust_remote_code``), its adapter, decoder and compatibility
patches.

``model.model(...)`` returns the per-step hidden states (normed; each feeds the next step) and per-step exit-gate
logits; the gate is stored (``gate_logit``) so Ouro's Q-exit (SPEC §4) is evaluated. Exit at loop t =
``lm_head(h_t)``, the model's own ``forward(exit_at_step=t−1)``. :class:`OuroDecoder` decodes loop by loop
(its layers address the cache as ``current_ut·L + layer_idx``; ``native`` is Ouro's ``UniversalTransformerCache``).

The published code is written for transformers 4.55; under 5.x it loads through
:mod:`looptrace.models.adapters.compat` with these patches (:data:`PATCHES`; what changed in transformers 5 → what the
patch does):

========================================  =====================================================================
``ouro.config_pad_token_id``               5.x ``PreTrainedConfig`` no longer defines ``pad_token_id``;
                                           ``OuroModel.__init__`` reads it. → class default ``None`` (4.x value).
``ouro.rope_default``                      5.x ``ROPE_INIT_FUNCTIONS`` has no ``'default'`` (``KeyError:
                                           'default'``). → the remote module gets its own table with the
                                           default rotary frequencies 1/θ^(2i/d) (scale 1).
``ouro.rope_init_weights``                 5.x ``_init_weights`` re-initialises rotary buffers through
                                           ``module.compute_default_rope_parameters``. → that staticmethod.
``ouro.mask_kwargs``                       5.x ``create_causal_mask(config, inputs_embeds, attention_mask, cache,
                                           position_ids, ...)``: ``input_embeds`` → ``inputs_embeds``,
                                           ``past_key_values`` → ``cache``, no ``cache_position``. → a
                                           module-local wrapper that renames / drops them.
``ouro.tied_weights_mapping``              5.x wants ``_tied_weights_keys`` as a mapping target → source
                                           (only reached with ``tie_word_embeddings: true``). → the mapping
                                           ``{"lm_head.weight": "model.embed_tokens.weight"}``
                                           (:func:`~looptrace.models.adapters.compat.tied_weights_mapping`).
``ouro.cache_kwarg``                       5.x ``generate`` passes the cache as ``cache=``; Ouro's forwards
                                           take ``past_key_values`` and swallow ``cache`` in ``**kwargs`` (every
                                           step a fresh cache: silently different tokens). → map it.
``ouro.cache_mask_sizes``                  5.x masks call ``cache.get_mask_sizes(query_length: int)``; Ouro's
                                           ``UniversalTransformerCache`` expects a ``cache_position`` tensor (or
                                           inherits one reading its unused ``layers``). → kv length = cached +
                                           query length, offset 0.
========================================  =====================================================================
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
from torch import nn

from looptrace.config import InputError
from looptrace.models.adapters import compat
from looptrace.models.adapters.base import Call, Context, HFAdapter, hooks, recording_calls, replay
from looptrace.models.adapters.decoding import HFDecoder, SlotCache, module_attr
from looptrace.models.interface import States
from looptrace.models.kv import LOOP, LoopKVCache


def _ouro_set_steps(model: nn.Module, n: int) -> None:
    """Run ``n`` recurrent steps: ``OuroModel`` copies ``total_ut_steps`` into an instance attribute at
    construction and its forward loops over that attribute, so the configs alone are not enough."""
    base: Any = model.model  # OuroModel (remote code): total_ut_steps is a plain int attribute
    c: Any  # the remote code's configs (attributes of their own)
    for c in {id(model.config): model.config, id(base.config): base.config}.values():
        c.total_ut_steps = n
    if hasattr(base, "total_ut_steps"):
        base.total_ut_steps = n


class OuroAdapter(HFAdapter):
    """Ouro (remote code, ``modeling_ouro.py``): ``model.model(...)`` → (``BaseModelOutputWithPast``, [h_1..h_T],
    [gate_1..gate_T]); each h_t is already normed (``OuroModel`` applies ``norm`` after every step and feeds the
    normed state to the next), so the exit at loop t is ``lm_head(h_t)``; gate_t is ``[batch, seq, 1]``."""

    remote_class = "modeling_ouro.OuroForCausalLM"
    tied_source = "model.embed_tokens.weight"
    has_gate = True

    @classmethod
    def config_overrides(cls, cfg):
        """``total_ut_steps`` = ``n_loops`` when set: ``OuroModel`` copies it at construction."""
        return {"total_ut_steps": cfg.n_loops} if cfg.n_loops is not None else {}

    def __init__(self, model, cfg, device="cpu"):
        if cfg.n_loops is not None:
            _ouro_set_steps(model, cfg.n_loops)
        super().__init__(model, cfg, device)

    def _shape(self):
        c = self.model.config
        T = getattr(self.model.model, "total_ut_steps", None) or getattr(c, "total_ut_steps", None)
        if T is None:
            raise InputError(f"dump.adapter.path '{self.cfg.path}': Ouro config has no total_ut_steps; "
                             "set dump.adapter.n_loops")
        return int(T), c.hidden_size, self.model.get_output_embeddings().out_features

    @staticmethod
    def _split(out) -> tuple[list, list]:
        if isinstance(out, tuple | list) and len(out) >= 3:
            return list(out[1]), list(out[2])
        raise InputError("ouro adapter: model.model(...) did not return (output, hidden_states_list, gate_list) as "
                         f"Ouro's modeling_ouro.OuroModel does (got {type(out).__name__})")

    def _states(self, ids):
        init: list[torch.Tensor] = []
        calls: list[Call] = []  # every layer call of every step (the loop step replays them)
        emb = self.model.get_input_embeddings()
        with hooks(emb.register_forward_hook(lambda m, a, o: init.append(o) if not init else None)), \
                recording_calls(self.loop_layers(0), calls):
            out = self.model.model(input_ids=ids, use_cache=False)
        hs, gates = self._split(out)
        g = torch.stack([x.reshape(*x.shape[:2], -1)[..., 0].float() for x in gates], dim=2)  # exact for bf16/fp16
        self._ctx = Context(tuple(ids.shape), [], step={"calls": calls})
        return States(hidden=torch.stack(hs, dim=2), hidden_init=init[0], gate_logits=g)

    def loop_layers(self, group: int) -> list[nn.Module]:
        """``OuroModel.layers[:num_hidden_layers]`` (every step runs them all)."""
        base: Any = self.model.model  # OuroModel (remote code)
        return list(base.layers[: base.config.num_hidden_layers])

    def loop_step(self, h: torch.Tensor, h0: torch.Tensor, loop: int) -> torch.Tensor:
        """``OuroModel``'s step ``current_ut = loop``: its layers, each called with the arguments (masks, rotary
        tables, ``current_ut``...) the model's own forward gave it at this step, then ``norm`` (the normed state
        is both h_t and the next step's input)."""
        calls = self._step_context(h, loop)["calls"]
        layers = self.loop_layers(0)
        L = len(layers)
        if len(calls) != L * self.info.n_loops:
            raise InputError(f"adapter '{self.info.name}' (ouro): the forward made {len(calls)} layer calls, expected "
                             f"{L} layers x {self.info.n_loops} steps; the checkpoint's code loops differently")
        for layer, call in zip(layers, calls[loop * L:(loop + 1) * L], strict=True):
            h = replay(layer, call, h)
        base: Any = self.model.model
        return base.norm(h)

    def _readout(self, h, loop):
        return self.model.get_output_embeddings()(h)

    def _reference(self, ids):
        # The plain forward is not the last step: with config.early_exit_threshold (1.0 by default) it takes Ouro's
        # Q-exit path, where the running CDF, computed in the model dtype, can reach the threshold before step T.
        T = self.info.n_loops
        kw = {"exit_at_step": T - 1} if "exit_at_step" in inspect.signature(self.model.forward).parameters else {}
        return T - 1, self.model(input_ids=ids, use_cache=False, **kw).logits


class OuroDecoder(HFDecoder):
    """Ouro: ``L`` shared layers × T steps, ``norm`` after every step (the normed state feeds the next), exit =
    ``lm_head(h_t)``, gate = ``early_exit_gate(h_t)``; its layers call ``update(k, v, current_ut·L + layer_idx)``."""

    has_gate = True
    native = "all"
    native_name = ("Ouro: every token runs all T steps (UniversalTransformerCache, one slot per step × layer); the "
                   "exit only picks the readout")

    def __init__(self, adapter: OuroAdapter, policy: str, **options):
        super().__init__(adapter, policy, **options)
        self.L = int(self.model.config.num_hidden_layers)
        base = self.model.model
        sliding = bool(base.config.sliding_window) and any(
            getattr(layer, "attention_type", "") == "sliding_attention" for layer in base.layers[: self.L])
        # a sliding-window layer's cache read keeps only the last W keys of the chunk's last position
        self.chunk_verify = policy != "native" and not sliding

    def reset(self, prompts, max_len):
        B = prompts.shape[0]
        base = self.model.model
        if self.policy == "native":
            self.kv = None
            self.cache = module_attr(base, "UniversalTransformerCache")(max_cache_size=self.n_loops * self.L)
        else:
            self.kv = LoopKVCache(B, max_len, self.n_loops, self.L, windows={
                (LOOP, j): int(base.config.sliding_window) for j, layer in enumerate(base.layers[: self.L])
                if getattr(layer, "attention_type", "") == "sliding_attention" and base.config.sliding_window},
                device=self.device)
            self.cache = SlotCache(self.kv, lambda i: (LOOP, i // self.L, i % self.L))
        self.pos = 0

    def start(self, ids):
        base = self.model.model
        self._point(None)
        h = base.embed_tokens(ids[:, None])
        self._positions(h)
        self.pe = base.rotary_emb(h, self.pid)
        return None, h

    def step(self, t, h, inj, rows, mask: torch.Tensor | None = None):
        base = self.model.model
        self._point(rows)
        for layer in base.layers[: self.L]:
            h = layer(h, attention_mask=mask, position_ids=self.pid, past_key_value=self.cache, use_cache=True,
                      cache_position=self.cp, position_embeddings=self.pe, current_ut=t)
            h = h[0] if isinstance(h, tuple) else h
        return base.norm(h)

    def verify(self, ids, inj, h, k):
        if not self.chunk_verify or h is None:
            return super().verify(ids, inj, h, k)
        # steps k+1..T over the chunk with an explicit causal mask (the model's attention aligns a multi-token query
        # top-left without one); numbers equal decoding one position at a time where the BLAS is row-invariant
        self.pid, mask = self._chunk(h, ids.shape[1])
        self.cp = self.pid[0]
        self.pe = self.model.model.rotary_emb(h, self.pid)
        for t in range(k, self.n_loops):
            h = self.step(t, h, inj, None, mask)
        self.pos += ids.shape[1]
        return self.readout(h, self.n_loops - 1, None)

    def readout(self, h, t, rows):
        return self.model.get_output_embeddings()(h).float()

    def gate_logit(self, h):
        g = self.model.model.early_exit_gate(h)
        return g.reshape(*g.shape[:2], -1)[..., 0].float()


# ---------------------------------------------------------------------------------------------
# Compatibility patches (transformers 5)
# ---------------------------------------------------------------------------------------------


def _ouro_pad_token_id(rc: compat.RemoteCode) -> bool:
    cls = rc.config_cls
    try:
        probe = cls()
    except Exception:  # noqa: BLE001 - a config that cannot default-construct: nothing to detect
        return False
    if hasattr(probe, "pad_token_id"):
        return False
    type.__setattr__(cls, "pad_token_id", None)
    return True


def _default_rope_parameters(config, device=None, seq_len=None, **_):
    """Default rotary frequencies (the 4.x ``'default'`` rope type): inv_freq_i = 1 / θ^(2i/d), scaling 1."""
    theta = getattr(config, "rope_theta", None)
    if theta is None:
        theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dim = int(head_dim * getattr(config, "partial_rotary_factor", 1.0))
    exponent = torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim
    return 1.0 / (theta ** exponent), 1.0


def _ouro_rope_default(rc: compat.RemoteCode) -> bool:
    mod = rc.module
    table = getattr(mod, "ROPE_INIT_FUNCTIONS", None)
    if table is None or "default" in table:
        return False
    mod.ROPE_INIT_FUNCTIONS = {**table, "default": _default_rope_parameters}
    return True


def _rotary_classes(mod) -> list[type[Any]]:
    return [v for k, v in vars(mod).items() if isinstance(v, type) and k.endswith("RotaryEmbedding")
            and v.__module__ == mod.__name__]


def _ouro_rope_init_weights(rc: compat.RemoteCode) -> bool:
    if compat.tf_rope_has_default():
        return False
    changed = False
    for cls in _rotary_classes(rc.module):
        if not hasattr(cls, "compute_default_rope_parameters"):
            cls.compute_default_rope_parameters = staticmethod(_default_rope_parameters)
            changed = True
    return changed


def _mask_kwargs_wrapper(fn):
    params = inspect.signature(fn).parameters

    @functools.wraps(fn)
    def create_mask(*args, **kw):
        if "input_embeds" in kw:
            kw["inputs_embeds"] = kw.pop("input_embeds")
        if "past_key_values" in kw and "cache" in params:
            kw["cache"] = kw.pop("past_key_values")
        if "cache_position" in kw and "cache_position" not in params:
            del kw["cache_position"]
        return fn(*args, **kw)

    return create_mask


def _ouro_mask_kwargs(rc: compat.RemoteCode) -> bool:
    mod, changed = rc.module, False
    for name in ("create_causal_mask", "create_sliding_window_causal_mask"):
        fn = getattr(mod, name, None)
        if fn is not None and "input_embeds" not in inspect.signature(fn).parameters and \
                "inputs_embeds" in inspect.signature(fn).parameters:
            setattr(mod, name, _mask_kwargs_wrapper(fn))
            changed = True
    return changed


def _cache_to_past_key_values(forward):
    @functools.wraps(forward)
    def run(self, *args, **kwargs):
        if "cache" in kwargs:
            cache = kwargs.pop("cache")
            if kwargs.get("past_key_values") is None:
                kwargs["past_key_values"] = cache
        return forward(self, *args, **kwargs)

    return run


def _ouro_cache_kwarg(rc: compat.RemoteCode) -> bool:
    if not compat.tf_generate_passes_cache():
        return False
    changed = False
    for cls in (rc.model_cls, getattr(rc.module, "OuroModel", None)):
        if cls is None or "forward" not in cls.__dict__:
            continue
        params = inspect.signature(cls.__dict__["forward"]).parameters
        if "cache" not in params and "past_key_values" in params:
            cls.forward = _cache_to_past_key_values(cls.__dict__["forward"])
            changed = True
    return changed


def _ouro_cache_mask_sizes(rc: compat.RemoteCode) -> bool:
    cls = getattr(rc.module, "UniversalTransformerCache", None)
    if cls is None or not compat.tf_mask_sizes_take_length():
        return False

    def get_mask_sizes(self, query, layer_idx: int = 0):
        """(kv length, kv offset) of the mask: the cached positions of slot ``layer_idx`` plus the query's."""
        q = int(query) if isinstance(query, int) else int(query.shape[0])
        return self.get_seq_length(layer_idx) + q, 0

    cls.get_mask_sizes = get_mask_sizes
    return True


#: Ouro's compatibility patches (:mod:`looptrace.models.adapters.compat`), in the order they are applied.
PATCHES: tuple[compat.Patch, ...] = (
    compat.Patch("ouro.config_pad_token_id", lambda rc: rc.config_cls, _ouro_pad_token_id),
    compat.Patch("ouro.rope_default", lambda rc: rc.module, _ouro_rope_default),
    compat.Patch("ouro.rope_init_weights", lambda rc: rc.module, _ouro_rope_init_weights),
    compat.Patch("ouro.mask_kwargs", lambda rc: rc.module, _ouro_mask_kwargs),
    compat.Patch("ouro.tied_weights_mapping", lambda rc: rc.model_cls, compat.tied_weights_mapping),
    compat.Patch("ouro.cache_kwarg", lambda rc: rc.model_cls, _ouro_cache_kwarg),
    compat.Patch("ouro.cache_mask_sizes", lambda rc: rc.module, _ouro_cache_mask_sizes),
)


OuroAdapter.decoder = OuroDecoder
OuroAdapter.patches = PATCHES


__all__ = ["OuroAdapter", "OuroDecoder", "PATCHES"]
