"""Loop-by-loop decoders of the Hugging Face adapters (``dory``, ``retrofit``, ``ouro``, ``huginn``).

Each runs the model's **own** modules — its embedding, decoder layers / ``iterate_one_step``, norms, coda and head
— in the order its forward does, one position at a time (:class:`looptrace.models.decode.LoopDecoder`), with a
cache object passed where the model's attention expects its cache: the layers call ``update(key, value, index,
...)`` on it exactly as they call their own cache, so the attention maths is the model's. The cache is

- looptrace's :class:`~looptrace.models.kv.LoopKVCache` (policies ``share`` and ``recompute``; one slot per
  (loop, layer), batch compaction), addressed through the model's own index layout — Huginn: ``block_idx``
  (prelude 0..P−1, core P + Lc·step + layer, coda −1, −2); Ouro: ``current_ut·L + layer_idx``; Dory and
  retrofit: the layer index, with the loop set by the decoder; or
- the model's own cache for ``native``: Huginn's ``HuginnDynamicCache(lookup_strategy=...)`` (rows in lockstep:
  it keeps the batch inside each entry), Ouro's ``UniversalTransformerCache`` (all T steps run, as its
  ``generate``), Dory's ``last_loop`` mode (one slot per recurrent layer: the last loop a position ran).

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
from typing import Any, cast

import torch

from looptrace.models.adapters.hf import (
    DoryAdapter,
    HFAdapter,
    HuginnAdapter,
    OuroAdapter,
    RetrofitAdapter,
    sequence_seed,
)
from looptrace.models.adapters.registry import adapter_kinds, register_decoder
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


def _module_attr(obj, name: str):
    """A class of the module that defined ``obj``'s class (the remote code's own cache classes)."""
    cls = getattr(sys.modules.get(type(obj).__module__), name, None)
    if cls is None:
        raise DecodeUnsupported(f"KV policy native: the model's code ({type(obj).__module__}) has no {name}")
    return cls


class _HFDecoder(LoopDecoder):
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
        cached ``pos`` (query i sees keys ≤ pos + i; the model's attention slices it to the keys it holds)."""
        p = self.pos
        pid = torch.arange(p, p + q, device=self.device)[None]
        allowed = torch.ones(q, p + q, dtype=torch.bool, device=self.device).tril(diagonal=p)
        mask = torch.zeros(1, 1, q, p + q, dtype=h.dtype, device=self.device)
        return pid, mask.masked_fill(~allowed, torch.finfo(h.dtype).min)


class _LayerListDecoder(_HFDecoder):
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


@register_decoder("dory")
class DoryDecoder(_LayerListDecoder):
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


@register_decoder("retrofit")
class RetrofitDecoder(_LayerListDecoder):
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


@register_decoder("ouro")
class OuroDecoder(_HFDecoder):
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
        self.chunk_verify = policy != "native" and not sliding

    def reset(self, prompts, max_len):
        B = prompts.shape[0]
        base = self.model.model
        if self.policy == "native":
            self.kv = None
            self.cache = _module_attr(base, "UniversalTransformerCache")(max_cache_size=self.n_loops * self.L)
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


@register_decoder("huginn")
class HuginnDecoder(_HFDecoder):
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
            self.cache = _module_attr(self.model, "HuginnDynamicCache")(lookup_strategy=self.strategy)
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


def hf_decoder(adapter, policy: str, **options) -> LoopDecoder:
    """The decoder of an adapter of :func:`looptrace.models.adapters.hf.load_adapter` for ``policy``.

    Raises:
        DecodeUnsupported: the kind has no decoder (``inkling2loop``), or no ``native`` policy, or Huginn's noise.
    """
    kind = getattr(adapter, "kind", type(adapter).__name__)
    entry = adapter_kinds().get(kind)
    if entry is None or entry.decoder is None or not isinstance(adapter, entry.adapter):
        why = f" ({entry.no_decoder})" if entry is not None and entry.no_decoder else ""
        raise DecodeUnsupported(f"adapter kind '{kind}' has no loop-by-loop decoder{why}")
    with adapter._remote_code_errors():
        return entry.decoder(adapter, policy, **options)


__all__ = ["DoryDecoder", "HuginnDecoder", "OuroDecoder", "RetrofitDecoder", "SlotCache", "hf_decoder"]
