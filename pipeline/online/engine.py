"""Real early exit in the looped model: the loops really stop (the engine of the ``latency`` stage).

Each loop runs only on the sequences that still have an undecided scored token; exited sequences leave
the batch (compaction: ``index_select`` of the active rows every loop). Exit semantics, exactness and the
online signals are described in :mod:`looptrace.online.latency`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from looptrace.models.looped import LoopedTransformer
from looptrace.rules.builtin import THRESHOLD_RULES
from looptrace.signals.logits import kl_div

ONLINE_RULES = ("top1", "entropy", "margin", "kl_prev", "kl_prev_rev", "logit_change", "accel_two_hit",
                "q_exit", "gate")



# ----------------------------------------------------------------------------------------------
# Online rules: the per-loop signal of SPEC §4 computed on the live batch
# ----------------------------------------------------------------------------------------------


class OnlineRule:
    """An exit rule evaluated loop by loop on the active batch.

    A rule sees, after loop t, the state h_t [batch, seq, d_model] and the readout z_t
    [batch, seq, vocab] of the active rows/prefix, keeps whatever history its signal needs as
    tensors with leading [batch, seq] dims (so :meth:`compact` can follow the batch), and returns
    which positions fire. Semantics are those of ``pipeline.readouts.exit_depths``: fire at the first
    t ≥ ``min_loop`` where ``signal op threshold`` holds (and held at t − 1 for two-hit rules); NaN
    never fires; the engine forces the exit at T.

    Args:
        name: rule name (``top1``, ``entropy``, ...).
        threshold: the chosen point's threshold (float64 comparison, as offline).
        op: ``"ge"`` or ``"le"``.
        min_loop: first loop (1-based) the rule may fire at.
        two_hit: condition at t and t − 1 ([TS] acceleration exit).
    """

    #: Whether the rule reads the readout z_t (otherwise the engine skips it until the exit).
    needs_logits = True

    def __init__(self, name: str, threshold: float, op: str, min_loop: int = 1, two_hit: bool = False):
        if op not in ("le", "ge"):
            raise ValueError(f"rule {name}: op must be 'le' or 'ge', got {op!r}")
        self.name, self.threshold, self.op = name, float(threshold), op
        self.min_loop, self.two_hit = int(min_loop), bool(two_hit)
        self._thr32 = float32_threshold(self.threshold, op)
        self.state: dict[str, torch.Tensor] = {}

    def reset(self, model: LoopedTransformer, h0: torch.Tensor) -> None:
        """Start a new batch (h0: [batch, seq, d_model])."""
        self.state = {}

    def signal(self, t: int, h: torch.Tensor, z: torch.Tensor | None, model: LoopedTransformer) -> torch.Tensor:
        """Signal after loop t (1-based): [batch, seq] float32 (values the store holds as float32) or
        float64, NaN where undefined."""
        raise NotImplementedError

    def fires(self, t: int, h: torch.Tensor, z: torch.Tensor | None, model: LoopedTransformer) -> torch.Tensor:
        """[batch, seq] bool: the rule's condition at loop t (before the engine's undecided mask)."""
        s = self.signal(t, h, z, model)
        # A float32 signal is compared with the float32 threshold that gives the same answer as the
        # offline float64 comparison (one op fewer per loop, identical result).
        thr = self._thr32 if s.dtype == torch.float32 else self.threshold
        hit = (s >= thr) if self.op == "ge" else (s <= thr)  # NaN compares False
        if self.two_hit:
            prev = self.state.get("hit_prev")
            self.state["hit_prev"] = hit
            hit = hit & prev if prev is not None else torch.zeros_like(hit)
        if t < self.min_loop:
            hit = torch.zeros_like(hit)
        return hit

    def compact(self, rows: torch.Tensor | None, seq: int) -> None:
        """Follow the engine's compaction: keep batch rows ``rows`` (None = all) and positions < ``seq``."""
        for k, v in self.state.items():
            if rows is not None:
                v = v.index_select(0, rows)
            self.state[k] = v[:, :seq]


def float32_threshold(threshold: float, op: str) -> float:
    """The float32 threshold τ32 with ``s op τ32`` ⇔ ``float64(s) op threshold`` for every float32 s.

    ``ge``: the smallest float32 ≥ threshold; ``le``: the largest float32 ≤ threshold.
    """
    thr = float(threshold)
    if not math.isfinite(thr):
        return thr
    t32 = np.float32(thr)
    if op == "ge" and float(t32) < thr:
        t32 = np.nextafter(t32, np.float32(np.inf))
    elif op == "le" and float(t32) > thr:
        t32 = np.nextafter(t32, np.float32(-np.inf))
    return float(t32)


def _logp(z: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(z.float(), dim=-1)


class MaxProbRule(OnlineRule):
    """top1 (CALM softmax_max, [AD]): C_t = max p_t, as ``LoopStats`` (float32)."""

    def signal(self, t, h, z, model):
        return _logp(z).max(dim=-1).values.exp()


class EntropyRule(OnlineRule):
    """entropy ([AD]): H_t = −Σ p log p, terms with p = 0 exactly 0 (as ``LoopStats``)."""

    def signal(self, t, h, z, model):
        logp = _logp(z)
        p = logp.exp()
        return -torch.where(p > 0, p * logp, torch.zeros((), dtype=logp.dtype, device=logp.device)).sum(-1)


class MarginRule(OnlineRule):
    """margin ([AD]): z_(1) − z_(2)."""

    def signal(self, t, h, z, model):
        zf = z.float()
        if zf.shape[-1] < 2:
            return torch.full(zf.shape[:-1], math.nan, dtype=torch.float32, device=zf.device)
        top2 = zf.topk(2, dim=-1).values
        return top2[..., 0] - top2[..., 1]


class KLPrevRule(OnlineRule):
    """kl_prev = KL(p_t ‖ p_{t−1}) ([AD]) or kl_prev_rev = KL(p_{t−1} ‖ p_t) (Huginn); NaN at t = 1."""

    def __init__(self, *args, reverse: bool = False, **kw):
        super().__init__(*args, **kw)
        self.reverse = reverse

    def signal(self, t, h, z, model):
        logp = _logp(z)
        prev = self.state.get("logp_prev")
        self.state["logp_prev"] = logp
        if prev is None:
            return torch.full(logp.shape[:-1], math.nan, dtype=torch.float32, device=logp.device)
        return kl_div(prev, logp) if self.reverse else kl_div(logp, prev)


class LogitChangeRule(OnlineRule):
    """logit_change = ‖z_t − z_{t−1}‖₂; NaN at t = 1."""

    def signal(self, t, h, z, model):
        zf = z.float()
        prev = self.state.get("z_prev")
        self.state["z_prev"] = zf
        if prev is None:
            return torch.full(zf.shape[:-1], math.nan, dtype=torch.float32, device=zf.device)
        return torch.linalg.vector_norm(zf - prev, dim=-1)


class AccelRule(OnlineRule):
    """accel_two_hit ([TS]): a_t = ‖Δ_t − Δ_{t−1}‖₂ ≤ τ at t and t − 1, t ≥ 3.

    The states are rounded to the store's ``hidden`` dtype and the norms computed in float64 and
    stored as float32, exactly as ``pipeline.geometry.step_metrics`` computed the calibrated signal.

    Args:
        state_dtype: the store's hidden dtype (``float16`` or ``float32``).
    """

    needs_logits = False

    def __init__(self, *args, state_dtype: str = "float16", **kw):
        super().__init__(*args, **kw)
        self.state_dtype = torch.float16 if state_dtype == "float16" else torch.float32

    def _round(self, h: torch.Tensor) -> torch.Tensor:
        return h.to(self.state_dtype).double()

    def reset(self, model, h0):
        self.state = {"h_prev": self._round(h0)}

    def signal(self, t, h, z, model):
        hr = self._round(h)
        d = hr - self.state["h_prev"]
        prev = self.state.get("d_prev")
        self.state["h_prev"], self.state["d_prev"] = hr, d
        if prev is None:
            return torch.full(h.shape[:-1], math.nan, dtype=torch.float32, device=h.device)
        x = d - prev
        return torch.sqrt(torch.einsum("bsd,bsd->bs", x, x)).float()  # float32 as in token_loop.parquet


class QExitRule(OnlineRule):
    """Native Q-exit (Ouro): 1 − Π_{j≤t}(1 − σ(gate_j)) ≥ q, in log space as ``readouts.halting_cdf``."""

    needs_logits = False

    def reset(self, model, h0):
        self.state = {"log_not": torch.zeros(h0.shape[:-1], dtype=torch.float64, device=h0.device)}

    def signal(self, t, h, z, model):
        g = model.gate_logit(h).float().double()  # float32 logits as stored, then float64 as offline
        self.state["log_not"] = self.state["log_not"] - torch.logaddexp(torch.zeros((), dtype=g.dtype), g)
        return -torch.expm1(self.state["log_not"])


class CallableRule(OnlineRule):
    """A rule whose per-position probability is produced by a callable on (h_t, z_t, history).

    Used for refit offline gates: ``stop_prob(t, h, z, state) -> [batch, seq] float64`` (state is the
    rule's compactable history dict), fired when ≥ the threshold (SPEC §4 "offline gate").
    """

    def __init__(self, name: str, threshold: float, stop_prob: Callable, needs_logits: bool = True,
                 reset_fn: Callable | None = None):
        super().__init__(name, threshold, "ge", 1, False)
        self._stop_prob, self.needs_logits, self._reset = stop_prob, needs_logits, reset_fn

    def reset(self, model, h0):
        self.state = self._reset(model, h0) if self._reset is not None else {}

    def signal(self, t, h, z, model):
        return self._stop_prob(t, h, z, self.state)


def make_rule(rule: str, threshold: float, state_dtype: str = "float16") -> OnlineRule:
    """The online version of a readouts rule at ``threshold`` (columns and ops of ``THRESHOLD_RULES``).

    Args:
        rule: a rule of ``ONLINE_RULES`` except ``gate`` (gates come from :func:`load_gate_rule`).
        threshold: the chosen point's threshold.
        state_dtype: the store's hidden dtype (geometry rules read rounded states).
    """
    if rule == "q_exit":
        return QExitRule(rule, threshold, "ge", 1, False)
    if rule not in THRESHOLD_RULES:
        raise ValueError(f"rule '{rule}' cannot run online; allowed: {', '.join(r for r in ONLINE_RULES if r != 'gate')}")
    _, op, min_loop, two_hit = THRESHOLD_RULES[rule]
    cls = {"top1": MaxProbRule, "entropy": EntropyRule, "margin": MarginRule, "kl_prev": KLPrevRule,
           "kl_prev_rev": KLPrevRule, "logit_change": LogitChangeRule, "accel_two_hit": AccelRule}.get(rule)
    if cls is None:
        raise ValueError(f"rule '{rule}' has no online implementation; allowed: "
                         f"{', '.join(r for r in ONLINE_RULES if r != 'gate')}")
    kw: dict = {}
    if rule == "kl_prev_rev":
        kw["reverse"] = True
    if cls is AccelRule:
        kw["state_dtype"] = state_dtype
    return cls(rule, threshold, op, min_loop, two_hit, **kw)


# ----------------------------------------------------------------------------------------------
# The engine: real early exit with compaction
# ----------------------------------------------------------------------------------------------


@dataclass
class ExitRun:
    """What one early-exit run produced for a batch of sequences.

    Attributes:
        exit_depth: [batch, seq] int64, 1-based exit loop of each scored position (0 unscored).
        pred: [batch, seq] int64 prediction (argmax of the readout at the exit loop; −1 unscored).
        loops_run: number of loop steps executed (the batch's depth).
        work: Σ over executed loops of active rows × active positions (position-loops computed).
    """

    exit_depth: torch.Tensor
    pred: torch.Tensor
    loops_run: int
    work: int


@torch.inference_mode()
def early_exit(model: LoopedTransformer, tokens: torch.Tensor, scored: torch.Tensor,
               rule: OnlineRule | None) -> ExitRun:
    """Run the looped model with real early exit and batch compaction (module docstring semantics).

    Args:
        model: the looped transformer (eval mode).
        tokens: [batch, seq] int64 token ids.
        scored: [batch, seq] bool, positions whose prediction is wanted (targets ≠ IGNORE).
        rule: the online exit rule, or None for full depth (all T loops, readout only at T).

    Returns:
        :class:`ExitRun` (tensors on the model's device).
    """
    cfg = model.cfg
    T = cfg.n_loops
    groups = cfg.loop_group
    B, S = tokens.shape
    dev = tokens.device
    exit_depth = torch.zeros((B, S), dtype=torch.int64, device=dev)
    pred = torch.full((B, S), -1, dtype=torch.int64, device=dev)
    undecided = scored.clone()
    if not bool(undecided.any()):
        return ExitRun(exit_depth, pred, 0, 0)
    rows = torch.arange(B, device=dev)
    pos = torch.arange(S, device=dev)
    seq = S
    if cfg.causal:  # positions after the last scored one cannot influence it
        seq = int(torch.where(undecided, pos, -1).max()) + 1
    h0 = model.embed(tokens)  # embedding sees the full sequence (prelude attention), then truncates
    h0, undecided = h0[:, :seq], undecided[:, :seq]
    if rule is not None:  # the rule starts on the batch it was made for, then follows the compaction
        rule.reset(model, h0)
    any_scored = undecided.any(dim=1)
    if not bool(any_scored.all()):  # rows with nothing to predict never run
        keep = any_scored.nonzero().squeeze(1)
        rows, h0, undecided = rows[keep], h0.index_select(0, keep), undecided.index_select(0, keep)
        if rule is not None:
            rule.compact(keep, seq)
    h = h0
    work = 0
    t = 0
    for t in range(1, T + 1):
        h = model.step(h, h0, groups[t - 1])  # [b, seq, D]
        work += h.shape[0] * h.shape[1]
        last = t == T
        if rule is None and not last:
            continue
        z = model.readout(h) if (last or rule.needs_logits) else None  # [b, seq, V]
        fire = undecided if last else (rule.fires(t, h, z, model) & undecided)
        b, s = fire.nonzero(as_tuple=True)
        if b.numel():
            if z is None:
                z = model.readout(h)
            r = rows[b]
            exit_depth[r, s] = t
            pred[r, s] = z[b, s].argmax(dim=-1)
            undecided = undecided & ~fire
        if last:
            break
        # Compaction: drop finished sequences; causal models also drop positions after the last
        # undecided one (every kept state stays the exact full-depth state, see module docstring).
        last_pos = torch.where(undecided, pos[:seq], -1).amax(dim=1).tolist()  # [b], −1 = finished
        kept = [i for i, v in enumerate(last_pos) if v >= 0]
        if not kept:
            break
        keep = None
        if len(kept) < len(last_pos):
            keep = torch.tensor(kept, dtype=torch.int64, device=dev)
            rows = rows[keep]
            h, h0, undecided = h.index_select(0, keep), h0.index_select(0, keep), undecided.index_select(0, keep)
        new_seq = max(last_pos) + 1 if cfg.causal else seq
        if new_seq < seq:
            h, h0, undecided = h[:, :new_seq], h0[:, :new_seq], undecided[:, :new_seq]
        if rule is not None and (keep is not None or new_seq < seq):
            rule.compact(keep, new_seq)
        seq = new_seq
    return ExitRun(exit_depth, pred, t, work)


def minimal_work(exit_depth: np.ndarray, scored: np.ndarray, causal: bool) -> int:
    """Position-loops an *exact* early exit must compute for given per-token exit depths.

    Causal: position j runs max_{i ≥ j, i scored} d_i loops (0 after the last scored position);
    bidirectional: every position of a sequence runs max_i d_i loops (module docstring).

    Args:
        exit_depth: [batch, seq] int, 1-based exit loop of scored positions.
        scored: [batch, seq] bool.
        causal: attention mask of the model.

    Returns:
        The total number of (position, loop) states computed.
    """
    d = np.where(scored, exit_depth, 0).astype(np.int64)
    if causal:
        suffix = np.maximum.accumulate(d[:, ::-1], axis=1)[:, ::-1]  # max_{i ≥ j} d_i
        return int(suffix.sum())
    return int((d.max(axis=1) * d.shape[1]).sum())


def full_work(scored: np.ndarray, n_loops: int, causal: bool) -> int:
    """Position-loops of the full-depth run (T loops over every position up to the last scored one)."""
    s = np.asarray(scored, dtype=bool)
    if causal:
        last = np.where(s.any(axis=1), s.shape[1] - np.argmax(s[:, ::-1], axis=1), 0)
        return int(last.sum() * n_loops)
    return int(s.any(axis=1).sum() * s.shape[1] * n_loops)
