"""``huginn``: Huginn / Raven (remote code ``raven_modeling_minimal.py``, ``trust_remote_code``), its adapter,
decoder and compatibility patches.

``embed_inputs`` → ``initialize_state`` → ``iterate_one_step(current_step=t)`` × T; h_t is the raw core-block output,
the exit ``predict_from_latents(h_t)`` (ln_f → coda → ln_f → head) = the model's ``forward(num_steps=t)``. h_0 and the
test-time noise come from a stream seeded per sequence (:func:`sequence_seed`). :class:`HuginnDecoder` decodes loop by
loop through Huginn's own API (``native``: its ``HuginnDynamicCache``).

The published code is written for transformers 4.4x; under 5.x it loads through
:mod:`looptrace.models.adapters.compat` with these patches (:data:`PATCHES`; what changed in transformers 5 → what the
patch does):

========================================  =====================================================================
``huginn.config_tie_word_embeddings``      ``RavenConfig.__init__`` passes ``tie_word_embeddings=`` itself *and*
                                           forwards ``**kwargs``; a config.json that carries the key (5.x writes
                                           it) gives "got multiple values for keyword argument". → drop the
                                           duplicate (it becomes ``tie_embeddings`` when that is unset). Latent
                                           in every version, so it is the one patch 4.x gets too.
``huginn.tied_weights_mapping``            5.x wants ``_tied_weights_keys`` as a mapping target → source
                                           (``'list' object has no attribute 'keys'``). → the mapping
                                           ``{"lm_head.weight": "transformer.wte.weight"}``.
``huginn.output_past_key_values``          5.x renames ``past_key_values=`` to ``cache=`` in every
                                           ``ModelOutput.__init__``; Huginn's own output dataclass declares
                                           ``past_key_values`` ("unexpected keyword argument 'cache'"). → its
                                           ``__init__`` maps ``cache`` back to the declared field.
``huginn.generation_cache_position``       5.x removed ``GenerationMixin._get_initial_cache_position`` and no
                                           longer advances ``model_kwargs["cache_position"]``, which Huginn's
                                           own decoding loops (``generate_minimal``, ``generate_with_adaptive_
                                           compute``, ...) slice inputs with. → both, 4.x behaviour, for those
                                           loops only (transformers' own ``generate`` keeps its contract).
``huginn.generate_route``                  5.x ``generate`` passes the cache as ``cache=`` and no
                                           ``cache_position``: Huginn drops the cache and re-runs every step
                                           from a fresh random state — silently different tokens. → the plain
                                           (greedy / sampling) ``generate`` runs Huginn's own ``generate_minimal``.
========================================  =====================================================================
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import inspect
from typing import Any

import torch
from torch import nn

from looptrace.config import ConfigError, InputError
from looptrace.models.adapters import compat
from looptrace.models.adapters.base import Context, HFAdapter
from looptrace.models.adapters.decoding import HFDecoder, SlotCache, module_attr
from looptrace.models.decode import DecodeUnsupported
from looptrace.models.interface import States
from looptrace.models.kv import CODA, LOOP, PRELUDE, LoopKVCache


def sequence_seed(seed: int, ids: torch.Tensor) -> int:
    """The random-stream seed of one sequence: the first 63 bits of sha256(``seed`` as 8 bytes little-endian ‖
    the sequence's token ids as int64 little-endian). A function of the sequence itself, so its trajectory does
    not depend on the batch it is in, its position there or a resume point."""
    h = hashlib.sha256(int(seed).to_bytes(8, "little", signed=True))
    h.update(ids.detach().to("cpu", torch.int64).contiguous().numpy().astype("<i8").tobytes())
    return int.from_bytes(h.digest()[:8], "little") & ((1 << 63) - 1)


class HuginnAdapter(HFAdapter):
    """Huginn / Raven (remote code, ``raven_modeling_minimal.py``): ``embed_inputs`` → ``initialize_state`` →
    ``iterate_one_step(current_step=t)`` × T; h_t is the raw core-block output, the exit at loop t is
    ``predict_from_latents(h_t)`` (ln_f → coda → ln_f → lm_head).

    Randomness: h_0 (``initialize_state``) and the test-time noise (``config.test_time_noise > 0``, one draw per
    step) come from torch's global stream. Each sequence gets its own stream, seeded by :func:`sequence_seed`,
    and draws in the order the model's own ``forward(num_steps=T)`` does on that sequence alone: h_0, then the
    noise of steps 0..T−1. Without noise h_0 is drawn per sequence and the steps run batched; with noise every
    sequence runs alone (the noise of a step is drawn for the whole batch at once)."""

    remote_class = "raven_modeling_minimal.RavenForCausalLM"
    tied_source = "transformer.wte.weight"
    METHODS = ("embed_inputs", "initialize_state", "iterate_one_step", "predict_from_latents")

    def __init__(self, model, cfg, device="cpu"):
        missing = [m for m in self.METHODS if not callable(getattr(model, m, None))]
        if missing:
            raise InputError(f"dump.adapter.path '{cfg.path}': {type(model).__name__} lacks {', '.join(missing)} "
                             f"(kind huginn expects Huginn's raven_modeling_minimal interface: {', '.join(self.METHODS)})")
        super().__init__(model, cfg, device)

    def _shape(self):
        c = self.model.config
        T = self.cfg.n_loops or getattr(c, "mean_recurrence", None)
        if T is None:
            raise InputError(f"dump.adapter.path '{self.cfg.path}': no mean_recurrence in config; set dump.adapter.n_loops")
        d = getattr(c, "n_embd", None) or getattr(c, "hidden_size", None)
        return int(T), int(d), self.model.get_output_embeddings().out_features

    def sequence_seeds(self, ids: torch.Tensor) -> list[int]:
        """:func:`sequence_seed` of every row of ``ids``."""
        return [sequence_seed(self.cfg.seed, ids[i]) for i in range(ids.shape[0])]

    @contextlib.contextmanager
    def _stream(self, seed: int):
        """torch's global stream seeded with ``seed``, restored afterwards."""
        devices = [self._device] if self._device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            yield

    def _noisy(self) -> bool:
        return float(getattr(self.model.config, "test_time_noise", 0) or 0) > 0

    def _iterate(self, e, x, block_idx):
        loops, self._block_idx = [], []
        for t in range(self.info.n_loops):
            self._block_idx.append(block_idx.clone())  # the step's block_idx input (the loop step passes it again)
            x, block_idx, _ = self.model.iterate_one_step(e, x, block_idx=block_idx.clone(), current_step=t)
            loops.append(x)
        return torch.stack(loops, dim=2)

    def _states(self, ids):
        m = self.model
        e, block_idx = m.embed_inputs(ids)
        h0, rows = [], []
        for i, seed in enumerate(self.sequence_seeds(ids)):
            with self._stream(seed):
                h0.append(m.initialize_state(e[i:i + 1]))
                if self._noisy():  # the step noise follows h_0 in the sequence's own stream
                    rows.append(self._iterate(e[i:i + 1], h0[-1], block_idx))
        h0 = torch.cat(h0, dim=0)
        hidden = torch.cat(rows, dim=0) if rows else self._iterate(e, h0, block_idx)
        self._ctx = Context(tuple(ids.shape), [], step=None if rows else {"e": e, "block_idx": self._block_idx})
        self._h0 = h0
        return States(hidden=hidden, hidden_init=h0)

    def loop_step_refusal(self) -> str | None:
        if self._noisy():
            return (f"adapter '{self.info.name}' (huginn): with test_time_noise > 0 every loop adds a fresh random "
                    "draw, so the loop map is not a function of the state alone (no Jacobian to take); set the "
                    "checkpoint's test_time_noise to 0")
        return None

    def loop_layers(self, group: int) -> list[nn.Module]:
        """``transformer.core_block`` (refused with test-time noise: then every sequence runs alone, and a layer's
        k-th call is not the batch's k-th loop)."""
        if self._noisy():
            raise NotImplementedError(f"adapter '{self.info.name}' (huginn): with test_time_noise > 0 the sequences "
                                      "run one at a time, so a layer's k-th call is not the batch's loop k; set the "
                                      "checkpoint's test_time_noise to 0 for dump.layers")
        m: Any = self.model  # RavenForCausalLM (remote code)
        return list(m.transformer.core_block)

    def loop_step(self, h: torch.Tensor, h0: torch.Tensor, loop: int) -> torch.Tensor:
        """Huginn's own ``iterate_one_step(e, h, block_idx, current_step=loop)`` — the body of the published method
        without its ``@torch.no_grad`` (``__wrapped__``), so that JVPs and VJPs flow — with the prelude output e and
        the block index :meth:`states` used for this batch. ``h0`` must be that call's ``hidden_init`` (Huginn's
        random initial state is not the injection: e is, and it is kept from the same call).

        Raises:
            ConfigError: test-time noise (:meth:`loop_step_refusal`).
            ValueError: ``h0`` is not the last :meth:`states` call's.
        """
        why = self.loop_step_refusal()
        if why:
            raise ConfigError(why)
        st = self._step_context(h, loop)
        if h0 is not self._h0 and not (h0.shape == self._h0.shape and torch.equal(h0, self._h0)):
            raise ValueError(f"adapter '{self.info.name}' (huginn): loop_step's h0 is not the hidden_init of the last "
                             "states() call (the injection e is kept from that call)")
        method: Any = type(self.model).iterate_one_step  # type: ignore[attr-defined]  # remote code's method
        step = getattr(method, "__wrapped__", method)
        x, _, _ = step(self.model, st["e"], h, block_idx=st["block_idx"][loop].clone(), current_step=loop)
        return x

    def _readout(self, h, loop):
        return self.model.predict_from_latents(h).logits

    def _reference(self, ids):
        """The model's own ``forward(num_steps=T)`` on each sequence alone, in that sequence's stream."""
        out = []
        for i, seed in enumerate(self.sequence_seeds(ids)):
            with self._stream(seed):
                out.append(self.model(input_ids=ids[i:i + 1], num_steps=self.info.n_loops).logits)
        return self.info.n_loops - 1, torch.cat(out, dim=0)


class HuginnDecoder(HFDecoder):
    """Huginn / Raven through its own API: ``embed_inputs`` → ``initialize_state`` → ``iterate_one_step`` (block_idx
    P−1 + Lc·t) → ``predict_from_latents``, every call with ``past_key_values`` and ``cache_position``.

    h_0 of each decoded position is drawn in its own stream: seed = f(``sequence_seed(seed, prompt)``, position),
    so a row's trajectory does not depend on the batch, and full depth and early exit see the same h_0 at the
    same position."""

    native = "lockstep"
    adapter: HuginnAdapter

    def __init__(self, adapter: HuginnAdapter, policy: str, **options):
        self.strategy = str(options.get("huginn_lookup_strategy") or "full")
        self.native_name = (f"Huginn HuginnDynamicCache(lookup_strategy='{self.strategy}'), rows in lockstep "
                            "(generate_with_adaptive_compute)")
        super().__init__(adapter, policy, **options)
        if adapter._noisy():
            raise DecodeUnsupported("Huginn with test_time_noise > 0: the step noise is one draw for the whole batch, "
                                    "so decoded rows would depend on the batch; set config.test_time_noise to 0")
        c = self.model.config
        self.P, self.Lc, self.C = int(c.n_layers_in_prelude), int(c.n_layers_in_recurrent_block), int(c.n_layers_in_coda)
        self.seed = int(options.get("seed", adapter.cfg.seed) or 0)

    def _where(self, i: int):
        if i < 0:
            return CODA, -i - 1
        if i < self.P:
            return PRELUDE, i
        s, j = divmod(i - self.P, self.Lc)
        return LOOP, s, j

    def reset(self, prompts, max_len):
        B = prompts.shape[0]
        if self.policy == "native":
            self.kv = None
            self.cache = module_attr(self.model, "HuginnDynamicCache")(lookup_strategy=self.strategy)
        else:
            self.kv = LoopKVCache(B, max_len, self.n_loops, self.Lc, self.P, self.C, device=self.device)
            self.cache = SlotCache(self.kv, self._where)
        self.row_seeds = [sequence_seed(self.seed, prompts[i]) for i in range(B)]
        self.pos = 0

    def initial_state(self, e: torch.Tensor, pos: int) -> torch.Tensor:
        """h_0 of position ``pos`` for every row of ``e`` [batch, 1, D] (row i in its own stream)."""
        out = []
        for i in range(e.shape[0]):
            with self.adapter._stream((self.row_seeds[i] + 1_000_003 * (pos + 1)) % (1 << 63)):
                out.append(self.model.initialize_state(e[i:i + 1]))
        return torch.cat(out, dim=0)

    def start(self, ids):
        self._point(None)
        self._positions(None)
        e, _ = self.model.embed_inputs(ids[:, None], past_key_values=self.cache, use_cache=True, cache_position=self.cp)
        return e, self.initial_state(e, self.pos)

    def step(self, t, h, inj, rows):
        self._point(rows)
        bi = torch.tensor(self.P - 1 + self.Lc * t, dtype=torch.long)
        x, _, _ = self.model.iterate_one_step(inj, h, cache_position=self.cp, block_idx=bi,
                                              past_key_values=self.cache, current_step=t)
        return x

    def readout(self, h, t, rows):
        self._point(rows)
        return self.model.predict_from_latents(h, cache_position=self.cp, past_key_values=self.cache).logits.float()


# ---------------------------------------------------------------------------------------------
# Compatibility patches (transformers 5)
# ---------------------------------------------------------------------------------------------


def _huginn_config_tie(rc: compat.RemoteCode) -> bool:
    cls = rc.config_cls
    params = inspect.signature(cls.__init__).parameters
    if "tie_embeddings" not in params or "tie_word_embeddings" in params or \
            not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return False
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        if "tie_word_embeddings" in kwargs:
            tied = kwargs.pop("tie_word_embeddings")
            kwargs.setdefault("tie_embeddings", tied)
        init(self, *args, **kwargs)

    cls.__init__ = __init__
    return True


def _huginn_generation_cache_position(rc: compat.RemoteCode) -> bool:
    # lazy: transformers: a multi-second import, only once a checkpoint is loaded
    from transformers.generation.utils import GenerationMixin

    cls = rc.model_cls
    loops = [m for m in ("generate_minimal", "generate_with_adaptive_compute", "generate_speculative",
                         "generate_diffusion_style") if m in cls.__dict__]
    if hasattr(GenerationMixin, "_get_initial_cache_position") or not loops:
        return False
    cls._get_initial_cache_position = _initial_cache_position
    for m in loops:
        setattr(cls, m, _with_cache_position_updates(cls.__dict__[m]))
    return True


def _initial_cache_position(self, seq_length, device, model_kwargs):
    """4.x ``GenerationMixin._get_initial_cache_position`` (decoder-only): positions of the not-yet-cached inputs."""
    if model_kwargs.get("cache_position") is not None:
        return model_kwargs
    embeds = model_kwargs.get("inputs_embeds")
    n = embeds.shape[1] if embeds is not None else seq_length
    pos = torch.arange(n, dtype=torch.int64, device=embeds.device if embeds is not None else device)
    cache = model_kwargs.get("past_key_values")
    if cache is not None:
        pos = pos[cache.get_seq_length():]
    model_kwargs["cache_position"] = pos
    return model_kwargs


def _update_kwargs_4x(self, outputs, model_kwargs, is_encoder_decoder=False, num_new_tokens=1):
    """4.x ``_update_model_kwargs_for_generation`` (decoder-only): carry the cache, grow the attention mask,
    advance ``cache_position`` — the contract Huginn's own loops were written against."""
    for name in ("past_key_values", "cache"):
        if name in outputs:
            model_kwargs["past_key_values"] = getattr(outputs, name)
            break
    mask = model_kwargs.get("attention_mask")
    if mask is not None:
        model_kwargs["attention_mask"] = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=-1)
    pos = model_kwargs["cache_position"]
    if model_kwargs.get("use_cache", True):
        model_kwargs["cache_position"] = pos[-1:] + num_new_tokens
    else:
        new = torch.arange(int(pos[-1]) + 1, int(pos[-1]) + num_new_tokens + 1, dtype=pos.dtype, device=pos.device)
        model_kwargs["cache_position"] = torch.cat([pos, new])
    return model_kwargs


def _with_cache_position_updates(loop):
    @functools.wraps(loop)
    def run(self, *args, **kwargs):
        own = self.__dict__.get("_update_model_kwargs_for_generation")
        self.__dict__["_update_model_kwargs_for_generation"] = _update_kwargs_4x.__get__(self)
        try:
            return loop(self, *args, **kwargs)
        finally:
            if own is None:
                self.__dict__.pop("_update_model_kwargs_for_generation", None)
            else:
                self.__dict__["_update_model_kwargs_for_generation"] = own

    return run


#: ``generate`` keyword arguments that Huginn's own dispatcher sends to its own loops.
_HUGINN_OWN_GENERATE = ("criterion", "exit_threshold", "exit_evaluator", "draft_steps", "lookahead_for_draft",
                        "verification_threshold", "headway", "state_noise_mixing", "inner_recurrence",
                        "freeze_strategy", "continuous_compute")


def _huginn_generate_route(rc: compat.RemoteCode) -> bool:
    cls = rc.model_cls
    if "generate" not in cls.__dict__ or "generate_minimal" not in cls.__dict__ or not compat.tf_generate_passes_cache():
        return False
    own = cls.__dict__["generate"]

    @functools.wraps(own)
    def generate(self, *args, **kwargs):
        if any(k in kwargs for k in _HUGINN_OWN_GENERATE):
            return own(self, *args, **kwargs)

        input_ids = args[0] if args else kwargs.pop("input_ids")
        gc = args[1] if len(args) > 1 else kwargs.pop("generation_config", None)
        gc = copy.deepcopy(gc if gc is not None else self.generation_config)
        if int(kwargs.get("num_beams", getattr(gc, "num_beams", 1)) or 1) > 1:
            raise NotImplementedError("huginn under transformers 5: beam search is not supported (looptrace's "
                                      "compatibility shim routes generate to Huginn's own generate_minimal)")
        lengths = {k: kwargs.pop(k) for k in ("max_new_tokens", "max_length") if k in kwargs}
        model_kwargs = gc.update(**kwargs)  # generation options into the config, the rest are model kwargs
        return self.generate_minimal(input_ids, gc, **lengths, **model_kwargs)

    cls.generate = generate
    return True


#: Huginn's compatibility patches (:mod:`looptrace.models.adapters.compat`), in the order they are applied.
PATCHES: tuple[compat.Patch, ...] = (
    compat.Patch("huginn.config_tie_word_embeddings", "huginn", lambda rc: rc.config_cls, _huginn_config_tie),
    compat.Patch("huginn.tied_weights_mapping", "huginn", lambda rc: rc.model_cls, compat.tied_weights_mapping),
    compat.Patch("huginn.output_past_key_values", "huginn", lambda rc: rc.module, compat.output_past_key_values),
    compat.Patch("huginn.generation_cache_position", "huginn", lambda rc: rc.model_cls,
                 _huginn_generation_cache_position),
    compat.Patch("huginn.generate_route", "huginn", lambda rc: rc.model_cls, _huginn_generate_route),
)


HuginnAdapter.decoder = HuginnDecoder
HuginnAdapter.patches = PATCHES


__all__ = ["HuginnAdapter", "HuginnDecoder", "PATCHES", "sequence_seed"]
