"""Token-by-token decoding of a looped model, one loop at a time (the ``generate`` stage's model side).

A :class:`LoopDecoder` runs one new position of every batch row through the model in pieces that an exit
rule can interleave with (:mod:`looptrace.online.generate` drives it):

    start(ids)            embedding (+ prelude) of the rows' current position      -> (inj, h_init)
    step(t, h, inj, rows) loop t (0-based) of the looped block on batch rows ``rows``  -> h_t
    readout(h, t, rows)   the exit path after loop t (coda, norm, head)             -> logits [b, 1, vocab]
    gate_logit(h)         the native halting gate (Ouro)                            -> [b, 1]
    share(rows, t)        KV policy ``share``: rows exited after loop t
    advance()             the next position
    verify(ids, inj, h, k) positions pos..pos+q−1 at full depth (speculative decoding) -> logits [b, q, vocab]

Every attention layer reads and extends a cache with one slot per (loop, layer) — looptrace's own
:class:`~looptrace.models.kv.LoopKVCache`, or the model's own cache class for the ``native`` policy — so a
decoded position costs the loops it runs. ``rows`` is the compacted batch (None = every row): exited rows
leave it and pay nothing more for that position. ``h_init`` is the state entering loop 1 (the dump's
``hidden_init``); ``inj`` what the model re-injects every loop (h_0, Huginn's embedded input, Dory's normed
prelude output; None for Ouro).

Decoders exist for looptrace's own :class:`~looptrace.models.looped.LoopedTransformer` (here) and for the
``dory``, ``retrofit``, ``ouro``, ``huginn`` and ``nanbeige`` adapters (each in its kind's module, beside the
adapter, on :mod:`looptrace.models.adapters.decoding`); :func:`looptrace.models.decoders.decoder_for` picks one.

KV policies (``policy``) for the loops a position skipped after exiting at loop d:

- ``share``: copy its loop-d keys/values into loops d+1..T−1 (recompute-free; Huginn's ``latest-m4``);
- ``recompute``: run loops d+1..T−1 for it (no saving: the exactness reference — the cache is exactly
  full depth's, only the emitted token comes from loop d);
- ``native``: the model's own policy, where it has one (:attr:`LoopDecoder.native`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from looptrace.models.kv import LoopKVCache
from looptrace.models.looped import LoopedTransformer

POLICIES = ("share", "recompute", "native")

#: How the driver runs a ``native`` policy: ``compact`` (exited rows leave the batch, like ``share``),
#: ``lockstep`` (the model's cache holds the batch in each entry: rows loop together until every row exited,
#: exited rows keep computing — Huginn's ``generate_with_adaptive_compute``), ``all`` (every row runs all T
#: loops and the exit only picks the readout — Ouro's ``generate``).
NATIVE_MODES = ("compact", "lockstep", "all")


class DecodeUnsupported(ValueError):
    """This model (or model × policy) cannot be decoded loop by loop; the message says why."""


class LoopDecoder(ABC):
    """One looped model decoded position by position (module docstring).

    Attributes:
        n_loops, d_model, vocab_size: T, state width, readout width.
        has_gate: whether :meth:`gate_logit` exists (Ouro).
        policy: the KV policy this decoder was built for.
        native: how the driver runs the ``native`` policy (:data:`NATIVE_MODES`), None when the model has none.
        native_name: what the model's own policy is (for the report).
        pos: the current position (prompt positions first).
    """

    n_loops: int
    d_model: int
    vocab_size: int
    has_gate: bool = False
    native: str | None = None
    native_name: str = ""
    cache: Any  # set by reset: a LoopKVCache, or a model's own cache class (None before)

    def __init__(self, policy: str):
        if policy not in POLICIES:
            raise ValueError(f"KV policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.policy = policy
        self.pos = 0

    # -- to implement ------------------------------------------------------------------------
    @abstractmethod
    def reset(self, prompts: torch.Tensor, max_len: int) -> None:
        """Start a batch of sequences ([batch, prompt_len] ids, a fresh cache of ``max_len`` positions)."""

    @abstractmethod
    def start(self, ids: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Embed the current position of every row ([batch] ids): (inj, h_init), each [batch, 1, d_model]."""

    @abstractmethod
    def step(self, t: int, h: torch.Tensor, inj: torch.Tensor | None, rows: torch.Tensor | None) -> torch.Tensor:
        """Loop ``t`` (0-based) on batch rows ``rows`` (None = all): h_{t} [b, 1, D] -> h_{t+1}."""

    @abstractmethod
    def readout(self, h: torch.Tensor, t: int, rows: torch.Tensor | None) -> torch.Tensor:
        """Logits [b, 1, vocab] (float32) of an exit after loop ``t`` (the coda writes its slot of ``rows``)."""

    def gate_logit(self, h: torch.Tensor) -> torch.Tensor:
        """The native halting gate's logit of h_t [b, 1, D]: [b, 1] float32."""
        raise NotImplementedError(f"{type(self).__name__} has no halting gate")

    def share(self, rows: torch.Tensor | None, t: int) -> None:
        """Policy ``share``: the current position of ``rows`` exited after loop ``t``."""
        self.cache.share(rows, t)

    def advance(self) -> None:
        """Move to the next position (:meth:`start` points the cache at it)."""
        self.pos += 1

    #: Whether :meth:`verify` continues the drafted states from loop k over the whole chunk in one pass (True),
    #: or re-runs each position at full depth through the decode path (the generic form: exact for every kind,
    #: no saving).
    chunk_verify: bool = False

    def verify(self, ids: torch.Tensor, inj: torch.Tensor | None, h: torch.Tensor | None, k: int) -> torch.Tensor:
        """Full-depth logits of positions ``pos..pos+q−1`` (speculative decoding's verification,
        :mod:`looptrace.online.speculative`); every slot of those positions is (re)written and ``pos`` advances by q.

        Args:
            ids: [batch, q] the positions' token ids.
            inj, h: [batch, q, d_model] the injection and the state after loop ``k`` of each position, as the
                draft left them (their loops 1..k and prelude keys/values are in the cache); used only where
                :attr:`chunk_verify`.
            k: the draft's loops.

        Returns:
            [batch, q, vocab] float32: the readout after loop T of each position.

        The generic form runs each position like :meth:`prefill` does (the calls of full-depth decoding, so the
        same numbers on every kind).
        """
        out = []
        for i in range(ids.shape[1]):
            inj_i, h_i = self.start(ids[:, i])
            for t in range(self.n_loops):
                h_i = self.step(t, h_i, inj_i, None)
            out.append(self.readout(h_i, self.n_loops - 1, None))
            self.advance()
        return torch.cat(out, dim=1)

    # -- shared ------------------------------------------------------------------------------
    def prefill(self, ids: torch.Tensor) -> None:
        """Run prompt positions [batch, S] at full depth (every loop's KV, the coda's at loop T), one position at
        a time through the decode path (exact for every kind; a decoder may do it in one chunk)."""
        for i in range(ids.shape[1]):
            inj, h = self.start(ids[:, i])
            for t in range(self.n_loops):
                h = self.step(t, h, inj, None)
            self.readout(h, self.n_loops - 1, None)
            self.advance()


class LoopedTransformerDecoder(LoopDecoder):
    """looptrace's own :class:`~looptrace.models.looped.LoopedTransformer`, with a :class:`LoopKVCache`.

    The prompt is prefilled in one chunk (causal attention over the empty cache). No native policy.
    """

    native_name = "none (looptrace's LoopedTransformer has no KV policy of its own)"

    def __init__(self, model: LoopedTransformer, policy: str):
        super().__init__(policy)
        cfg = model.cfg
        if not cfg.causal:
            raise DecodeUnsupported("generation needs a causal model (model.causal is false)")
        if policy == "native":
            raise DecodeUnsupported("KV policy native: looptrace's LoopedTransformer has no KV policy of its own")
        if policy == "share" and len(cfg.groups) > 1:
            raise DecodeUnsupported("KV policy share copies a loop's keys/values into later loops of the same block; "
                                    f"this model has {len(cfg.groups)} looped groups (use recompute)")
        self.model = model
        self.n_loops, self.d_model, self.vocab_size = cfg.n_loops, cfg.d_model, cfg.vocab_size
        self.has_gate = model.gate is not None
        self.groups = cfg.loop_group
        self.cache: LoopKVCache | None = None
        self.device = next(model.parameters()).device
        # Loop memory ([RT], models with loop_memory): the current position's layer outputs of every loop it ran,
        # [T, L, batch, 1, d_model] (loop t, block layer j), written by the rows that ran loop t; a row reads its
        # own entries of its group's earlier loops (a row exited early and recomputed later finds them there).
        self.memory: torch.Tensor | None = None
        self.group_start = [cfg.loop_group.index(g) for g in cfg.loop_group]
        # loop memory is kept per position (self.memory): such a model verifies position by position
        self.chunk_verify = not cfg.loop_memory

    def reset(self, prompts, max_len):
        cfg = self.model.cfg
        if max_len > cfg.block_size:
            raise DecodeUnsupported(f"{max_len} positions exceed the model's block_size {cfg.block_size} "
                                    "(learned positions); shorten the prompt or the new tokens")
        self.cache = LoopKVCache(prompts.shape[0], max_len, self.n_loops, max(g.n_layer for g in cfg.groups),
                                 cfg.n_prelude, cfg.n_coda, device=self.device)
        self.pos = 0

    def prefill(self, ids):
        if ids.shape[1] == 0:
            return
        m, c = self.model, self.cache
        c.rows, c.pos = None, self.pos
        h0 = m.embed(ids, self.pos, c)
        h = h0
        memory = None
        for t in range(self.n_loops):
            if self.group_start[t] == t:
                memory = m.empty_memory(self.groups[t], h0)
            h, outputs = m.step_outputs(h, h0, self.groups[t], c, t, memory)
            if memory is not None:
                memory = m.extend_memory(memory, outputs)
        m.readout(h, c)
        self.pos += ids.shape[1]

    def start(self, ids):
        c = self.cache
        c.rows, c.pos = None, self.pos
        h0 = self.model.embed(ids[:, None], self.pos, c)
        if self.model.cfg.loop_memory:  # a new position: its memory starts empty
            L = max(g.n_layer for g in self.model.cfg.groups)
            self.memory = h0.new_zeros(self.n_loops, L, *h0.shape)  # [T, L, B, 1, D]
        return h0, h0

    def step(self, t, h, inj, rows):
        self.cache.rows = rows
        m = self.model
        if self.memory is None:
            return m.step(h, inj, self.groups[t], self.cache, t)
        g = self.groups[t]
        past = self.memory[self.group_start[t]:t, :m.cfg.groups[g].n_layer]  # [m, L_g, B, 1, D]
        if rows is not None:
            past = past.index_select(2, rows)
        memory = tuple(past[:, j].permute(1, 2, 0, 3) for j in range(past.shape[1]))  # [b, 1, m, D] each
        h, outputs = m.step_outputs(h, inj, g, self.cache, t, memory)
        for j, o in enumerate(outputs):
            if rows is None:
                self.memory[t, j] = o
            else:
                self.memory[t, j, rows] = o
        return h

    def readout(self, h, t, rows):
        self.cache.rows = rows
        return self.model.readout(h, self.cache).float()

    def verify(self, ids, inj, h, k):
        if not self.chunk_verify or inj is None or h is None:
            return super().verify(ids, inj, h, k)
        # Loops k+1..T of the q drafted positions in one chunk: their loops 1..k (and prelude) keys/values are the
        # draft's, which are full depth's (loop t of a position reads only loop-t keys/values of positions up to it,
        # all exact), and each query sees the cached prefix through the causal offset mask.
        c, m = self.cache, self.model
        c.rows, c.pos = None, self.pos
        for t in range(k, self.n_loops):
            h = m.step(h, inj, self.groups[t], c, t)
        z = m.readout(h, c).float()
        self.pos += ids.shape[1]
        return z

    def gate_logit(self, h):
        if self.model.gate is None:
            raise NotImplementedError("the model has no halting gate")
        return self.model.gate_logit(h).float()


__all__ = ["NATIVE_MODES", "POLICIES", "DecodeUnsupported", "LoopDecoder", "LoopedTransformerDecoder"]
