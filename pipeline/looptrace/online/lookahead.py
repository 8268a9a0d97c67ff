"""Decoding with early exit without a host round trip per loop (docs/generate.md).

:func:`looptrace.online.generate.decode_tokens` decides after every loop on the host whether to go on
(``bool(und.any())``, ``bool(fire.any())``, the compaction's ``nonzero``): on an accelerator each of those waits
for the device to finish the loop and leaves it idle while Python decides and enqueues the next one. This module
decodes the same tokens with the decision kept on the device:

- the rule's condition, the undecided mask, the exit depth and the exit state/readout of every row are tensors,
  updated with ``torch.where`` (no data-dependent shapes, so no synchronisation); exited rows keep computing
  until the whole batch has decided (the masking form of ``decode_tokens(compact=False)``, whose tokens equal
  compaction's);
- the loop's stop flag ("some row is undecided") is copied to a host buffer without blocking (pinned memory, a
  CUDA event), and read only **after loop t+1 has been enqueued**: the device runs loop t+1 while the host
  waits for loop t's flag. Loop t+1 is speculative: when every row had decided at loop t it is wasted (its
  keys/values are overwritten by the KV policy, which runs after the position: ``share`` copies the exit loop's
  keys/values over them, ``recompute`` recomputes them from the exit state);
- after the position, one host read of the position's exit depths groups the rows by exit loop, which the KV
  policy and the emitted tokens' readouts need (one read per token, not per loop).

The tokens, exit depths and log-probabilities are those of ``decode_tokens(compact=False)`` bit for bit (the
same readouts on the same row subsets; tests/test_generate.py), hence those of the default compaction: for
looptrace's own model bit for bit on every CPU (its inference passes run batch-invariant kernels,
:mod:`looptrace.models.invariant`, so a row computes the same numbers in a compacted batch), for the adapters
where their BLAS is row-invariant. On a CPU the speculative loop is pure
cost (there is nothing to overlap), so ``decode_tokens`` keeps the per-loop path as its default
(``lookahead=False``; ``generate.lookahead`` in params.yaml).

Supports the ``share`` and ``recompute`` policies (and ``native`` where the model's native mode is ``compact``);
Huginn's lockstep and Ouro's all-loops native modes keep the per-loop path. A rule whose signal is computed on
the host (the step signals, e.g. ``rel_step``, and ``q_exit``: float64 numpy, bit-identical to the store's) is
decided on the device by its device form (:mod:`looptrace.online.device_rules`: the same decisions, certified;
a position where a row's decision is not certain is run again with the host rule), so no loop waits for the
host; a rule without one (a refit gate, ``argmax_stable``, a user's history rule) still copies h_t to the host
every loop; the driver adds none.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from looptrace.models.decode import DecodeUnsupported, LoopDecoder
from looptrace.online.device_rules import DeviceRule, device_rule
from looptrace.online.genrun import GenRun

if TYPE_CHECKING:
    from looptrace.online.engine import OnlineRule


class _StopFlags:
    """Per-loop "some row is undecided" flags, copied to the host without blocking the device.

    ``put(t, und)`` enqueues the copy of ``und.any()`` for loop t; ``get(t)`` waits for that copy only (CUDA: its
    event; later work stays queued) and returns it. The host reads a numpy view of the buffer, so no tensor
    method (``item``, ``__bool__``, ``cpu``) runs per loop.
    """

    def __init__(self, n_loops: int, device: torch.device):
        self.cuda = device.type == "cuda"
        self.buf = torch.zeros(n_loops, dtype=torch.bool, pin_memory=self.cuda)
        self.view = self.buf.numpy()
        self.events: list[torch.cuda.Event | None] = [None] * n_loops

    def put(self, t: int, und: torch.Tensor) -> None:
        self.buf[t].copy_(und.any(), non_blocking=self.cuda)
        if self.cuda:
            ev = torch.cuda.Event()
            ev.record()
            self.events[t] = ev

    def get(self, t: int) -> bool:
        ev = self.events[t]
        if ev is not None:
            ev.synchronize()
        return bool(self.view[t])


def _rows(idx: list[int], batch: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Host row indices as a device tensor, and as a decoder's rows argument (None = every row in order)."""
    r = torch.tensor(idx, dtype=torch.int64, device=device)
    return r, (None if len(idx) == batch else r)


def _position(dec: LoopDecoder, rule: OnlineRule | None, inj: torch.Tensor | None, h: torch.Tensor,
              flags: _StopFlags | None, B: int, T: int, needs_z: bool):
    """The loops of one position from h_0 = ``h``, each loop's stop flag read after the next loop is enqueued.

    ``rule``: a host rule (``fires``) or a :class:`~looptrace.online.device_rules.DeviceRule` (``decide``: its
    uncertain rows are gathered in ``pending``; the caller then redoes the position with the host rule).

    Returns:
        (h at the last loop run [B, 1, D], exit depths [B] int64 (T where no row fired), exit states [B, 1, D],
        exit readouts [B, 1, V] or None, pending [B] bool (a device rule's uncertain undecided rows), row loops run).
    """
    dev = h.device
    if rule is not None:
        rule.reset(dec, h)
    decide = rule.decide if isinstance(rule, DeviceRule) else None
    und = torch.ones(B, dtype=torch.bool, device=dev)
    pending = torch.zeros(B, dtype=torch.bool, device=dev)
    d = torch.full((B,), T, dtype=torch.int64, device=dev)  # exit depth (1-based); T until a row fires
    h_exit = torch.zeros_like(h)  # the state each row exited with (rows still undecided: garbage)
    z_exit = None  # the readout at the exit ([B, 1, V], logit rules)
    work = 0
    for t in range(T):
        h = dec.step(t, h, inj, None)
        work += B
        last = t == T - 1
        if rule is None:
            continue
        assert flags is not None  # made with the rule
        if t > 0 and not flags.get(t - 1):  # every row decided at loop t: this loop was speculative
            break
        z = dec.readout(h, t, None) if (needs_z or last) else None
        if last:
            fire = und
        elif decide is not None:
            cond, unc = decide(t + 1, h, z, dec)
            fire = cond.reshape(-1) & und
            if unc is not None:
                pending = pending | (unc.reshape(-1) & und)
        else:
            fire = rule.fires(t + 1, h, z, dec).reshape(-1) & und
        f3 = fire[:, None, None]
        d = torch.where(fire, t + 1, d)
        h_exit = torch.where(f3, h, h_exit)
        if z is not None:
            z_exit = z if z_exit is None else torch.where(f3, z, z_exit)
        und = und & ~fire
        if not last:
            flags.put(t, und)
    return h, d, h_exit, z_exit, pending, work


@torch.inference_mode()
def decode_tokens_lookahead(dec: LoopDecoder, prompts: torch.Tensor, new_tokens: int, rule: OnlineRule | None = None,
                            force: torch.Tensor | None = None, device_rules: bool = True) -> GenRun:
    """Greedy decoding with early exit, the stop decision of loop t read after loop t+1 is enqueued.

    Same arguments and result as :func:`looptrace.online.generate.decode_tokens` (module docstring for the
    differences: masking instead of compaction; ``row_loops`` counts the speculative loops too).

    Args:
        dec: the model's decoder (policy ``share`` or ``recompute``, or a ``compact`` native one).
        prompts: [batch, prompt_len ≥ 1] int64 token ids.
        new_tokens: tokens to emit per row.
        rule: the online exit rule (reset at every position; fires after loop t), or None for full depth.
        force: [batch, new_tokens] tokens to feed back instead of the emitted ones (teacher forcing).
        device_rules: decide on the device where the rule has a device form
            (:func:`looptrace.online.device_rules.device_rule`: the host's decisions, certified; a position with an
            uncertain row is redone with ``rule``, counted in ``GenRun.redone``); False: ``rule`` itself.

    Returns:
        :class:`~looptrace.online.generate.GenRun` (numpy arrays).
    """
    B, S0 = prompts.shape
    if S0 < 1 or new_tokens < 1:
        raise ValueError("decoding needs a prompt of at least one token and at least one new token")
    T = dec.n_loops
    policy = dec.policy
    if policy == "native" and dec.native != "compact":
        raise DecodeUnsupported(f"lookahead decoding: native mode {dec.native!r} of {dec.native_name} "
                                "(use the per-loop path, generate.lookahead false)")
    dev = prompts.device
    tokens = torch.zeros((B, new_tokens), dtype=torch.int64, device=dev)
    depth = torch.zeros((B, new_tokens), dtype=torch.int64, device=dev)
    logprob = torch.zeros((B, new_tokens), dtype=torch.float64, device=dev)
    host = rule.host if isinstance(rule, DeviceRule) else rule  # (a device rule given: its host rule for redoes)
    needs_z = host is not None and host.needs_logits
    dec.reset(prompts, S0 + new_tokens - 1)
    t0 = time.perf_counter()
    dec.prefill(prompts[:, :-1])
    t1 = time.perf_counter()
    cur = prompts[:, -1]
    work = redone = 0
    flags = _StopFlags(T, dev) if rule is not None else None  # (each loop's flag is put before it is read)
    drule = device_rule(rule) if device_rules else None  # (a DeviceRule given: itself)
    for n in range(new_tokens):
        inj, h0 = dec.start(cur)
        if drule is not None:  # the decision on the device; a row it cannot certify: the position again, on the host
            h, d, h_exit, z_exit, pending, w = _position(dec, drule, inj, h0, flags, B, T, needs_z)
            both = torch.cat([d, pending.to(torch.int64)]).tolist()  # the position's one host read
            work += w
            d_host = both[:B]
            if any(both[B:]):
                redone += 1
                h, d, h_exit, z_exit, _, w = _position(dec, host, inj, h0, flags, B, T, needs_z)
                work += w
                d_host = d.tolist()
        else:
            h, d, h_exit, z_exit, _, w = _position(dec, host, inj, h0, flags, B, T, needs_z)
            work += w
            # One host read per position: rows grouped by exit depth (the KV policy and the token readouts need them).
            d_host = d.tolist()
        if rule is None:  # full depth: every row exits at T with the last loop's readout
            z_exit = dec.readout(h, T - 1, None)
        groups: dict[int, list[int]] = {}
        for i, di in enumerate(d_host):
            groups.setdefault(di, []).append(i)
        fed_all = force[:, n] if force is not None else None
        for dd in sorted(groups):
            r, sub = _rows(groups[dd], B, dev)
            if dd < T and policy != "recompute":  # share (the masking path of decode_tokens: share, then the coda)
                # the rows as a host tensor: the cache's share loops over them on the host (no device read)
                dec.share(None if sub is None else torch.tensor(groups[dd], dtype=torch.int64), dd - 1)
            if dd < T and (not needs_z or policy != "recompute"):
                zr = dec.readout(h_exit[r], dd - 1, sub)  # the exit's readout; share: restores the coda slot
                zf = zr if not needs_z or z_exit is None else z_exit[r]
            else:
                assert z_exit is not None  # read out at loop T (and at every loop for a logit rule)
                zf = z_exit[r]
            logp = torch.log_softmax(zf[:, 0].double(), dim=-1)
            emitted = logp.argmax(dim=-1)
            fed = emitted if fed_all is None else fed_all[r]
            tokens[r, n], depth[r, n] = emitted, dd
            logprob[r, n] = logp.gather(1, fed[:, None]).squeeze(1)
        if policy == "recompute" and min(d_host) < T:  # the skipped loops, for the KV only; then the coda at T
            for t in range(min(d_host), T):
                r, sub = _rows([i for i, di in enumerate(d_host) if di <= t], B, dev)
                h_exit[r] = dec.step(t, h_exit[r], None if inj is None else inj[r], sub)
                work += r.numel()
            r, sub = _rows([i for i, di in enumerate(d_host) if di < T], B, dev)
            dec.readout(h_exit[r], T - 1, sub)
        dec.advance()
        cur = tokens[:, n] if force is None else force[:, n]
    if dev.type == "cuda":  # the last position's work may still be queued (no per-loop read waited for it)
        torch.cuda.synchronize(dev)
    t2 = time.perf_counter()
    return GenRun(tokens=tokens.cpu().numpy(), exit_depth=depth.cpu().numpy(), logprob=logprob.cpu().numpy(),
                  row_loops=work, seconds=t2 - t1, prefill_seconds=t1 - t0, redone=redone)


__all__ = ["decode_tokens_lookahead"]
