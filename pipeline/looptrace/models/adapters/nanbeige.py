"""``nanbeige``: Nanbeige4.2 (remote code ``modeling_nanbeige.py``, ``trust_remote_code``), its adapter, decoder and
compatibility patches.

``NanbeigeModel`` runs its **whole** decoder stack (``num_hidden_layers`` layers) ``num_loops`` times with shared
weights (``len(loop_loss_weights) + 1`` times when that list is not empty) and applies its final ``norm`` after
every loop; the normed state feeds the next loop. So h_t = norm(layers(h_{t−1})), h_0 = the embedding output, and
the exit at loop t is ``lm_head(h_t)`` — the model's own forward with ``config.num_loops = t``. With
``skip_loop_final_norm`` the norm runs once, after the last loop: h_t is the raw output of loop t and the exit
``lm_head(norm(h_t))``. Its attention layers address one cache slot per (loop, layer): ``layer_idx + loop_idx·L``
(``num_loops × L`` slots of a ``DynamicCache``); :class:`NanbeigeDecoder` decodes loop by loop through that layout
(``native``: the model's own ``DynamicCache``).

The options the published Nanbeige4.2 checkpoints leave off — LoopSplit (``enable_double_loop_split``),
hyper-connections / mHC, depth attention and n-gram embeddings — change what a loop is (a middle block, several
residual streams, attention across depths, extra inputs per layer); the adapter refuses them in one line.

The published code is written against transformers 4.x; under 5.x it loads through
:mod:`looptrace.models.adapters.compat` with these patches (:data:`PATCHES`; what changed in transformers 5 → what the
patch does):

==========================================  ===================================================================
``nanbeige.rope_scaling_type``               5.x standardises ``config.rope_scaling`` (an alias of
                                             ``rope_parameters``): ``null`` becomes ``{"rope_type": "default",
                                             "rope_theta": θ}``, and ``NanbeigeAttention._init_rope`` reads
                                             ``rope_scaling["type"]`` of any non-None value (``KeyError:
                                             'type'``). → ``_init_rope`` sees the 4.x value: None for the default
                                             rope, ``{"type", "factor"}`` for linear / dynamic scaling.
``nanbeige.rope_inv_freq``                   5.x builds the model on the meta device and leaves non-persistent
                                             buffers uninitialised unless ``_init_weights`` recomputes them;
                                             Nanbeige's only initialises Linear / Embedding weights, so every
                                             rotary ``inv_freq`` is garbage (zeros: no positions). →
                                             ``_init_weights`` also recomputes ``inv_freq`` = 1/base^(2i/dim), as
                                             ``NanbeigeRotaryEmbedding.__init__`` does.
``nanbeige.tied_weights_mapping``            5.x wants ``_tied_weights_keys`` as a mapping target → source
                                             (``'list' object has no attribute 'keys'``). → the mapping
                                             ``{"lm_head.weight": "model.embed_tokens.weight"}``.
``nanbeige.dynamic_cache``                   5.x's ``DynamicCache`` has no ``from_legacy_cache`` /
                                             ``to_legacy_cache`` (a forward with ``use_cache`` and no cache calls
                                             the first: ``AttributeError``), and its ``get_max_length()`` says −1
                                             for "unbounded" (4.x: None; an empty cache raises) where
                                             ``prepare_inputs_for_generation`` expects None. → the remote module
                                             gets a ``DynamicCache`` subclass with the 4.x methods.
``nanbeige.generation_mixin``                5.x ``PreTrainedModel`` does not inherit ``GenerationMixin`` (only
                                             ``AutoModelForCausalLM`` adds it to remote classes);
                                             ``NanbeigeForCausalLM.generate`` calls ``super().generate`` (``'super'
                                             object has no attribute 'generate'``). → ``GenerationMixin`` appended
                                             to the class's bases, as the Auto class does.
``nanbeige.generation_inputs``               5.x ``generate`` passes the cache as ``cache=`` and, every step, the
                                             whole sequence's ``position_ids``; Nanbeige's
                                             ``prepare_inputs_for_generation`` takes ``past_key_values`` (``The
                                             following `model_kwargs` are not used by the model: ['cache']``) and
                                             derives ``position_ids`` itself (given ones are not cut to the new
                                             tokens: query and cache positions disagree). → it takes ``cache``
                                             and passes it as ``past_key_values``, and the given
                                             ``position_ids`` are dropped (the code derives them from the
                                             attention mask, as under 4.x).
==========================================  ===================================================================
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

#: Config switches of the published code the adapter refuses (attribute -> what it is), when truthy.
UNSUPPORTED = {
    "enable_double_loop_split": "LoopSplit (a looped middle block between unlooped layers)",
    "enable_hyper_connection": "hyper-connections (several residual streams)",
    "enable_depth_attention": "depth attention (queries mixing values of earlier depths)",
}


def _set_loops(model: nn.Module, n: int) -> None:
    """Run ``n`` loops: ``NanbeigeModel._get_num_loops`` reads ``config.num_loops`` at every forward unless
    ``loop_loss_weights`` is non-empty (then it runs ``len + 1``); that list only sizes the loop count at inference."""
    c: Any  # the remote code's configs (attributes of their own)
    base: Any = model.model
    for c in {id(model.config): model.config, id(base.config): base.config}.values():
        c.num_loops = n
        c.loop_loss_weights = []


class NanbeigeAdapter(HFAdapter):
    """Nanbeige4.2 (remote code, ``modeling_nanbeige.py``): the whole decoder stack × T loops, ``norm`` after every
    loop (module doc). States are captured by forward hooks on ``NanbeigeModel``'s own forward: h_t is the output of
    ``norm`` at loop t (of the last layer with ``skip_loop_final_norm``)."""

    remote_class = "modeling_nanbeige.NanbeigeForCausalLM"
    tied_source = "model.embed_tokens.weight"

    @classmethod
    def config_overrides(cls, cfg):
        """``num_loops`` = ``n_loops`` when set (and no ``loop_loss_weights``, which would override it)."""
        return {"num_loops": cfg.n_loops, "loop_loss_weights": []} if cfg.n_loops is not None else {}

    def __init__(self, model, cfg, device="cpu"):
        c, base = model.config, model.model
        on = [f"{k} ({why})" for k, why in UNSUPPORTED.items() if getattr(c, k, None)]
        if getattr(base, "ngram_embeddings", None) is not None or len(getattr(base, "ngram_layer_fusion", ())):
            on.append("emb_neighbor_num (n-gram embeddings)")
        if on:
            raise InputError(f"dump.adapter.path '{cfg.path}': the Nanbeige config enables {'; '.join(on)}; the "
                             "nanbeige adapter reads the looped whole stack the published Nanbeige4.2 checkpoints "
                             "run (num_loops, skip_loop_final_norm) — switch those off or use a checkpoint "
                             "without them")
        if cfg.n_loops is not None:
            _set_loops(model, cfg.n_loops)
        self.skip_norm = bool(getattr(c, "skip_loop_final_norm", False))
        super().__init__(model, cfg, device)

    def _shape(self):
        base: Any = self.model.model  # NanbeigeModel (remote code)
        T = base._get_num_loops() if hasattr(base, "_get_num_loops") else self.model.config.num_loops
        return int(T), int(self.model.config.hidden_size), self.model.get_output_embeddings().out_features

    def _states(self, ids):
        base: Any = self.model.model
        init: list[torch.Tensor] = []
        raw: list[torch.Tensor] = []  # the last layer's output at every loop
        normed: list[torch.Tensor] = []  # norm's output: after every loop (after the last only when skipped)
        calls: list[Call] = []  # every layer call of every loop (the loop step replays them)
        layers = self.loop_layers(0)
        with hooks(base.embed_tokens.register_forward_hook(lambda m, a, o: init.append(o) if not init else None),
                   layers[-1].register_forward_hook(lambda m, a, o: raw.append(o[0] if isinstance(o, tuple) else o)),
                   base.norm.register_forward_hook(lambda m, a, o: normed.append(o))), \
                recording_calls(layers, calls):
            base(input_ids=ids, use_cache=False)
        hs = raw if self.skip_norm else normed
        T = self.info.n_loops
        if len(hs) != T or len(calls) != T * len(layers):
            raise InputError(f"adapter '{self.cfg.run_name}' (nanbeige): the forward made {len(calls)} layer calls "
                             f"and {len(normed)} norm calls, expected {len(layers)} layers x {T} loops; the "
                             "checkpoint's code loops differently")
        self._ctx = Context(tuple(ids.shape), [], step={"calls": calls})
        return States(hidden=torch.stack(hs, dim=2), hidden_init=init[0])

    def loop_layers(self, group: int) -> list[nn.Module]:
        """``NanbeigeModel.layers`` (every loop runs them all)."""
        base: Any = self.model.model
        return list(base.layers)

    def loop_step(self, h: torch.Tensor, h0: torch.Tensor, loop: int) -> torch.Tensor:
        """``NanbeigeModel``'s loop ``loop_idx = loop``: its layers, each called with the arguments (mask, position
        ids, ``loop_idx``...) the model's own forward gave it at this loop, then ``norm`` (unless
        ``skip_loop_final_norm``: then the raw output is both h_t and the next loop's input)."""
        calls = self._step_context(h, loop)["calls"]
        layers = self.loop_layers(0)
        L = len(layers)
        for layer, call in zip(layers, calls[loop * L:(loop + 1) * L], strict=True):
            h = replay(layer, call, h)
        if self.skip_norm:
            return h
        base: Any = self.model.model
        return base.norm(h)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """``NanbeigeForCausalLM``'s head on a (final-normed) state: ``lm_head``, or with ``pretraining_tp > 1`` the
        concatenation of its row slices, as the model's forward computes it."""
        model: Any = self.model  # the remote NanbeigeForCausalLM
        lm = model.get_output_embeddings()  # nn.Linear
        tp = int(getattr(model.config, "pretraining_tp", 1) or 1)
        if tp <= 1:
            return lm(h)
        slices = lm.weight.split(lm.out_features // tp, dim=0)
        return torch.cat([nn.functional.linear(h, w) for w in slices], dim=-1)

    def _readout(self, h, loop):
        if self.skip_norm:
            base: Any = self.model.model
            h = base.norm(h)
        return self.head(h)


class NanbeigeDecoder(HFDecoder):
    """Nanbeige: ``L`` shared layers × T loops, ``norm`` after every loop (unless ``skip_loop_final_norm``), exit =
    the adapter's; its layers call ``update(k, v, layer_idx + loop_idx·L)``."""

    native = "all"
    native_name = ("Nanbeige: every token runs all T loops (its DynamicCache, one slot per loop × layer: "
                   "loop·L + layer); the exit only picks the readout")

    def __init__(self, adapter: NanbeigeAdapter, policy: str, **options):
        super().__init__(adapter, policy, **options)
        self.L = len(adapter.loop_layers(0))
        self.skip_norm = adapter.skip_norm
        # no sliding-window layers: a chunk of positions attends like one position at a time (with a causal mask)
        self.chunk_verify = policy != "native"

    def reset(self, prompts, max_len):
        B = prompts.shape[0]
        if self.policy == "native":
            self.kv = None
            self.cache = module_attr(self.model.model, "DynamicCache")()
        else:
            self.kv = LoopKVCache(B, max_len, self.n_loops, self.L, device=self.device)
            L = self.L
            self.cache = SlotCache(self.kv, lambda i: (LOOP, i // L, i % L))
        self.pos = 0

    def start(self, ids):
        self._point(None)
        h = self.model.model.embed_tokens(ids[:, None])
        self._positions(h)
        return None, h

    def step(self, t, h, inj, rows, mask: torch.Tensor | None = None):
        base = self.model.model
        self._point(rows)
        for layer in base.layers:
            out = layer(h, attention_mask=mask, position_ids=self.pid, past_key_value=self.cache, use_cache=True,
                        cache_position=self.cp, loop_idx=t)
            h = out[0] if isinstance(out, tuple) else out
        return h if self.skip_norm else base.norm(h)

    def verify(self, ids, inj, h, k):
        if not self.chunk_verify or h is None:
            return super().verify(ids, inj, h, k)
        # loops k+1..T over the chunk with an explicit causal mask (a multi-token query over cached keys needs one)
        self.pid, mask = self._chunk(h, ids.shape[1])
        self.cp = self.pid[0]
        for t in range(k, self.n_loops):
            h = self.step(t, h, inj, None, mask)
        self.pos += ids.shape[1]
        return self.readout(h, self.n_loops - 1, None)

    def readout(self, h, t, rows):
        return self.adapter._readout(h, t).float()


# ---------------------------------------------------------------------------------------------
# Compatibility patches (transformers 5)
# ---------------------------------------------------------------------------------------------

def _tf_standardises_rope_scaling() -> bool:
    # lazy: transformers: a multi-second import, only once a checkpoint is loaded
    from transformers import PretrainedConfig

    return isinstance(inspect.getattr_static(PretrainedConfig, "rope_scaling", None), property)


def _legacy_rope_scaling(value: Any) -> Any:
    """The 4.x ``rope_scaling`` of a 5.x-standardised value: None for the default rope, ``{"type", "factor"}``
    otherwise; a value that already has ``type`` (or is None) unchanged."""
    if not isinstance(value, dict) or "type" in value:
        return value
    kind = value.get("rope_type")
    if kind in (None, "default"):
        return None
    return {"type": kind, "factor": value.get("factor")}


class _ConfigView:
    """A config whose ``rope_scaling`` reads as another value (every other attribute is the config's)."""

    def __init__(self, config: Any, rope_scaling: Any):
        object.__setattr__(self, "_config", config)
        object.__setattr__(self, "rope_scaling", rope_scaling)

    def __getattr__(self, name: str) -> Any:
        return getattr(object.__getattribute__(self, "_config"), name)


def _nanbeige_rope_scaling_type(rc: compat.RemoteCode) -> bool:
    if not _tf_standardises_rope_scaling():
        return False
    changed = False
    for cls in _remote_classes(rc, "_init_rope"):
        init_rope = cls.__dict__["_init_rope"]

        @functools.wraps(init_rope)
        def _init_rope(self, _orig=init_rope):
            config = self.config
            legacy = _legacy_rope_scaling(getattr(config, "rope_scaling", None))
            if legacy is getattr(config, "rope_scaling", None):
                return _orig(self)
            self.config = _ConfigView(config, legacy)
            try:
                return _orig(self)
            finally:
                self.config = config

        cls._init_rope = _init_rope
        changed = True
    return changed


def _remote_classes(rc: compat.RemoteCode, method: str) -> list[type[Any]]:
    """The remote module's classes that define ``method`` themselves."""
    mod = rc.module
    return [v for v in vars(mod).values() if isinstance(v, type) and v.__module__ == mod.__name__
            and method in v.__dict__]


def _tf_leaves_buffers_to_init_weights() -> bool:
    # lazy: transformers: a multi-second import, only once a checkpoint is loaded
    from transformers import PreTrainedModel

    return hasattr(PreTrainedModel, "named_non_persistent_buffers")


def _rotary_inv_freq(module: nn.Module) -> torch.Tensor:
    """``NanbeigeRotaryEmbedding.__init__``'s frequencies: 1 / base^(arange(0, dim, 2) / dim) (float32)."""
    m: Any = module
    exponent = torch.arange(0, m.dim, 2, dtype=torch.int64).float().to(m.inv_freq.device) / m.dim
    return 1.0 / (m.base ** exponent)


def _nanbeige_rope_inv_freq(rc: compat.RemoteCode) -> bool:
    if not _tf_leaves_buffers_to_init_weights():
        return False
    changed = False
    for cls in _remote_classes(rc, "_init_weights"):
        init_weights = cls.__dict__["_init_weights"]

        @functools.wraps(init_weights)
        def _init_weights(self, module, _orig=init_weights):
            if type(module).__name__.endswith("RotaryEmbedding") and all(
                    hasattr(module, a) for a in ("inv_freq", "dim", "base")):
                with torch.no_grad():
                    module.inv_freq.copy_(_rotary_inv_freq(module))
                return None
            return _orig(self, module)

        cls._init_weights = _init_weights
        changed = True
    return changed


def _tf_cache_lacks_legacy() -> bool:
    # lazy: transformers: a multi-second import, only once a checkpoint is loaded
    from transformers.cache_utils import DynamicCache

    return not hasattr(DynamicCache, "from_legacy_cache")


def _legacy_dynamic_cache(base: type[Any]) -> type[Any]:
    """``base`` (transformers' ``DynamicCache``) with its 4.x methods back."""

    class DynamicCache(base):  # type: ignore[misc, valid-type]
        """transformers' ``DynamicCache`` with the 4.x ``from_legacy_cache`` / ``to_legacy_cache`` and
        ``get_max_length`` (None: no maximum) that Nanbeige's code calls (looptrace compatibility shim)."""

        @classmethod
        def from_legacy_cache(cls, past_key_values=None):
            cache = cls()
            for i, (k, v) in enumerate(past_key_values or ()):
                cache.update(k, v, i)
            return cache

        def to_legacy_cache(self):
            return tuple((layer.keys, layer.values) for layer in self.layers)

        def get_max_length(self, *args, **kwargs):
            return None

    DynamicCache.__qualname__ = base.__qualname__
    return DynamicCache


def _nanbeige_dynamic_cache(rc: compat.RemoteCode) -> bool:
    mod = rc.module
    cls = getattr(mod, "DynamicCache", None)
    if cls is None or not _tf_cache_lacks_legacy():
        return False
    mod.DynamicCache = _legacy_dynamic_cache(cls)
    return True


def _nanbeige_generation_mixin(rc: compat.RemoteCode) -> bool:
    # lazy: transformers: a multi-second import, only once a checkpoint is loaded
    from transformers import PreTrainedModel
    from transformers.generation import GenerationMixin

    cls = rc.model_cls
    if hasattr(PreTrainedModel, "generate") or issubclass(cls, GenerationMixin):
        return False
    # after the class's own bases (PreTrainedModel first), as AutoModelForCausalLM's subclass has it
    setattr(cls, "__bases__", (*cls.__bases__, GenerationMixin))  # noqa: B010 - a read-only property for mypy
    return True


def _prepare_inputs_4x(prepare):
    @functools.wraps(prepare)
    def run(self, input_ids, *args, **kwargs):
        if "cache" in kwargs:
            cache = kwargs.pop("cache")
            if kwargs.get("past_key_values") is None:
                kwargs["past_key_values"] = cache
        kwargs.pop("position_ids", None)  # 4.x generate never passed them: the code derives them per step
        return prepare(self, input_ids, *args, **kwargs)

    # generate checks its keyword arguments against this signature: it takes ``cache``
    sig = inspect.signature(prepare)
    params = list(sig.parameters.values())
    at = next((i for i, q in enumerate(params) if q.kind is q.VAR_KEYWORD), len(params))
    params.insert(at, inspect.Parameter("cache", inspect.Parameter.KEYWORD_ONLY, default=None))
    run.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
    return run


def _nanbeige_generation_inputs(rc: compat.RemoteCode) -> bool:
    if not compat.tf_generate_passes_cache():
        return False
    fn = rc.model_cls.__dict__.get("prepare_inputs_for_generation")
    if fn is None or "cache" in inspect.signature(fn).parameters:
        return False
    rc.model_cls.prepare_inputs_for_generation = _prepare_inputs_4x(fn)
    return True


#: Nanbeige's compatibility patches (:mod:`looptrace.models.adapters.compat`), in the order they are applied.
PATCHES: tuple[compat.Patch, ...] = (
    compat.Patch("nanbeige.rope_scaling_type", lambda rc: rc.module, _nanbeige_rope_scaling_type),
    compat.Patch("nanbeige.rope_inv_freq", lambda rc: rc.module, _nanbeige_rope_inv_freq),
    compat.Patch("nanbeige.tied_weights_mapping", lambda rc: rc.model_cls, compat.tied_weights_mapping),
    compat.Patch("nanbeige.dynamic_cache", lambda rc: rc.module, _nanbeige_dynamic_cache),
    compat.Patch("nanbeige.generation_mixin", lambda rc: rc.model_cls, _nanbeige_generation_mixin),
    compat.Patch("nanbeige.generation_inputs", lambda rc: rc.model_cls, _nanbeige_generation_inputs),
)


NanbeigeAdapter.decoder = NanbeigeDecoder
NanbeigeAdapter.patches = PATCHES


__all__ = ["PATCHES", "UNSUPPORTED", "NanbeigeAdapter", "NanbeigeDecoder"]
