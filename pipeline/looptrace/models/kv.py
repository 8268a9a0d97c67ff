"""The key/value cache of token-by-token decoding in a looped model: one slot per (loop, layer).

A looped model applies its block of L layers T times, so a position has T·L keys/values in the looped
block (plus one per prelude and per coda layer). :class:`LoopKVCache` keeps all of them, preallocated:

    prelude  [P,   batch, heads, max_len, head_dim]     slot i          (written once per position)
    loop     [T·L, batch, heads, max_len, head_dim]     slot t·L + j    (loop t = 0..T−1, block layer j)
    coda     [C,   batch, heads, max_len, head_dim]     slot k          (one per position: its last readout)

(keys and values alike). The layout is Huginn's cache index layout (REPORT §6: prelude 0..P−1, core
P + Lc·step + layer, coda −1, −2) with the coda kept once per position, as Huginn's own cache does: every
readout of a position overwrites its coda slot, so it ends as the readout at the position's exit loop.

A position that exits at loop d leaves loops d+1..T−1 unwritten; what later positions see there is the
KV policy (:mod:`looptrace.online.generate`): ``share`` copies loop d's keys/values into them
(:meth:`LoopKVCache.share`: Huginn's ``latest-m4`` — a token that exited at recurrence d serves its
recurrence-d KV of the same layer to every later recurrence), ``recompute`` computes them.

Batch compaction: ``rows`` (set by the decoder before each call) are the batch rows of the call's inputs
(None = all rows, the fast path with no copy); writes go to those rows, reads gather them
(``index_select``). ``pos`` is the first position being written; a call of q positions writes
``pos..pos+q−1`` and reads ``0..pos+q−1`` (the last ``window`` of them for a sliding-window layer).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

PRELUDE, LOOP, CODA = "prelude", "loop", "coda"
KINDS = (PRELUDE, LOOP, CODA)


class LoopKVCache:
    """Keys/values of every (loop, layer) of a looped model (module docstring).

    Args:
        batch: batch rows.
        max_len: positions (prompt + new tokens).
        n_loops: T.
        n_layers: layers of the looped block (L).
        n_prelude, n_coda: layers before / after the loop that attend.
        shared_loops: one slot per block layer for every loop (Dory's ``last_loop`` cache mode: each position
            keeps the keys/values of the last loop it ran).
        windows: ``{(kind, layer): W}`` sliding-window layers (``layer`` = i, or j of the block): a read returns
            the last W positions.
        device: torch device.

    Attributes:
        pos: first position the next call writes.
        rows: batch rows of the next call (LongTensor) or None (all).
        loop: loop of the next loop-layer call, for callers whose layers do not say it (set by the decoder).
    """

    def __init__(self, batch: int, max_len: int, n_loops: int, n_layers: int, n_prelude: int = 0, n_coda: int = 0,
                 shared_loops: bool = False, windows: Mapping[tuple[str, int], int] | None = None,
                 device: torch.device | str = "cpu"):
        self.batch, self.max_len, self.n_loops, self.n_layers = int(batch), int(max_len), int(n_loops), int(n_layers)
        self.shared_loops = bool(shared_loops)
        self.n_slots = {PRELUDE: int(n_prelude), LOOP: n_layers * (1 if shared_loops else n_loops), CODA: int(n_coda)}
        self.windows = dict(windows or {})
        self.device = torch.device(device)
        self.k: dict[str, torch.Tensor] = {}
        self.v: dict[str, torch.Tensor] = {}
        self.pos = 0
        self.rows: torch.Tensor | None = None
        self.loop = 0

    # -- addressing ------------------------------------------------------------------------------
    def slot(self, kind: str, *index: int) -> int:
        """Slot of layer ``("prelude", i)``, ``("loop", t, j)`` or ``("coda", i)``."""
        if kind == LOOP:
            t, j = index
            if not (0 <= t < self.n_loops and 0 <= j < self.n_layers):
                raise IndexError(f"loop layer ({t}, {j}) outside T = {self.n_loops}, L = {self.n_layers}")
            return j if self.shared_loops else t * self.n_layers + j
        (i,) = index
        if not 0 <= i < self.n_slots[kind]:
            raise IndexError(f"{kind} layer {i} outside 0..{self.n_slots[kind] - 1}")
        return i

    def layer(self, kind: str, *index: int):
        """The cache as one layer's attention sees it: ``kv(k, v) -> (keys, values)`` (``looptrace.models.looped.KV``)."""
        def kv(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return self.update(kind, index, k, v)
        return kv

    def _buffers(self, kind: str, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        K = self.k.get(kind)
        if K is None:
            _, H, _, Dk = k.shape
            shape = (self.n_slots[kind], self.batch, H, self.max_len)
            K = self.k[kind] = torch.zeros((*shape, Dk), dtype=k.dtype, device=self.device)
            self.v[kind] = torch.zeros((*shape, v.shape[-1]), dtype=v.dtype, device=self.device)
        return K, self.v[kind]

    # -- the attention's call --------------------------------------------------------------------
    def update(self, kind: str, index: tuple[int, ...], k: torch.Tensor, v: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k``/``v`` [rows, heads, q, head_dim] at positions ``pos..pos+q−1`` of layer ``(kind, *index)``;
        return the keys/values those positions attend to ([rows, heads, keys, head_dim])."""
        s = self.slot(kind, *index)
        K, V = self._buffers(kind, k, v)
        p, q = self.pos, k.shape[2]
        if p + q > self.max_len:
            raise IndexError(f"decoding position {p + q - 1} beyond the cache's {self.max_len} positions")
        Ks, Vs = K[s], V[s]
        rows = self.rows
        w = self.windows.get((kind, index[-1] if kind == LOOP else index[0]))
        lo = 0 if w is None else max(0, p + q - w)
        if rows is None:
            Ks[:, :, p:p + q] = k
            Vs[:, :, p:p + q] = v
            return Ks[:, :, lo:p + q], Vs[:, :, lo:p + q]
        Ks[rows, :, p:p + q] = k
        Vs[rows, :, p:p + q] = v
        return Ks[:, :, lo:p + q].index_select(0, rows), Vs[:, :, lo:p + q].index_select(0, rows)

    # -- KV policies -----------------------------------------------------------------------------
    def share(self, rows: torch.Tensor | None, loop: int) -> None:
        """Policy ``share``: the current position of ``rows`` (None = all) exited after loop ``loop`` (0-based):
        copy its loop-``loop`` keys/values of every block layer into loops ``loop+1..T−1``."""
        if self.shared_loops or loop >= self.n_loops - 1 or LOOP not in self.k:
            return
        p, L, T = self.pos, self.n_layers, self.n_loops
        for store in (self.k[LOOP], self.v[LOOP]):
            x = store.view(T, L, *store.shape[1:])  # [T, L, B, H, S, D]
            if rows is None:
                x[loop + 1:, :, :, :, p] = x[loop, :, :, :, p]
            else:
                for r in rows.tolist():
                    x[loop + 1:, :, r, :, p] = x[loop, :, r, :, p]

    def entry(self, kind: str, *index: int, row: int = 0, pos: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored key and value [heads, head_dim] of one layer, row and position (tests, inspection)."""
        s = self.slot(kind, *index)
        p = self.pos if pos is None else pos
        return self.k[kind][s, row, :, p], self.v[kind][s, row, :, p]


__all__ = ["CODA", "KINDS", "LOOP", "PRELUDE", "LoopKVCache"]
