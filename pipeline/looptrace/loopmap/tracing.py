"""Cross-loop causal tracing and exit-gate patching (SPEC §2b "causal tracing across loops"; a capture-side
computation: it runs the model).

Causal tracing [ROME] asks where in a network the information that decides an answer sits: run a *clean* input and a
*corrupted* one (here one token substituted so that the answer changes), copy one hidden state of the clean run into
the corrupted run, and see how much of the clean answer comes back. Across the loops of a looped model the state is
h_k[p], the output of loop k at position p (k = 0: h_0 = e, the embedding / prelude output, which every loop also
re-injects — patching it patches the state entering loop 1 *and* the injection at p; for k ≥ 1 the injection stays
the corrupted run's). With the answer's logit difference at full depth,

    LD = z_T[a, y_clean] − z_T[a, y_corrupt]      (z_T the readout of h_T at the answer position a)

the restored fraction of a patch at (k, p) is (LD_patched − LD_corrupt) / (LD_clean − LD_corrupt): 1 = the clean
answer's margin fully back, 0 = no effect. Loops k + 1..T of the patched run are re-run through the model's own loop
step with the corrupted injection. A cell whose clean and corrupted states are equal (under causal attention every
position before the substitution, and at k = 0 every position but the substituted one when there is no prelude) is
no intervention and has restored fraction 0 by definition, without a run; under causal attention a position after
a cannot reach it and is not run either.

Exit-gate patching (models with a native halting gate): the same patched runs also give the gate's logits at the
answer position at every loop after the patch (the gate reads the patched trajectory), and the gate's *input* alone
can be patched — the corrupted run's gate at loop k reading the clean run's state, everything else corrupted —
which changes nothing but that one logit; the tables turn both into the change of the halting distribution's
expected depth and of the native exit depth (:mod:`looptrace.loopmap.trace_tables`).

The corruption of a sequence of the loopmap sample (:func:`answer_pairs`): its last scored position a is the answer;
one substitution of the task's :meth:`~looptrace.tasks.base.Task.answer_flips` (a token at f < a replaced so that the
task's answer at a changes), drawn uniformly from (seed, the sequence's index in the sample), so the pairs do not
depend on the batching. :func:`causal_trace` itself takes any clean / corrupted pair (an LM's token substitution with
the model's own answers: :func:`adapter_causal_trace`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from tqdm.auto import tqdm

from looptrace.loopmap.config import LoopmapConfig
from looptrace.models.interface import LoopedModelAdapter
from looptrace.tasks.base import IGNORE, Task

#: The last word of the corruption draw's seed, (seed, sequence, TRACE_STREAM): a stream no other draw of the
#: loopmap stage uses (the contraction draws from (seed, sequence), the noise from (seed, loop, sequence)).
TRACE_STREAM = 2**32 - 1

#: A loop step with its injection: (h_{t−1} [batch, seq, d], e [batch, seq, d], loop t 0-based) -> h_t.
InjectedStep = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]
#: A readout or a gate: (h_t [batch, seq, d], loop t 0-based) -> [batch, seq, vocab] logits / [batch, seq] logits.
LoopFn = Callable[[torch.Tensor, int], torch.Tensor]


@dataclass(frozen=True)
class TracePairs:
    """The clean / corrupted pairs of a sample.

    Attributes:
        rows: [n] each traced sequence's index in the sample.
        answer: [n] the answer position a (the sequence's last scored position).
        flipped: [n] the substituted position f < a.
        clean, corrupt: [n, seq] token ids (they differ at f only).
        y_clean, y_corrupt: [n] the answer at a of each (the task's labels; they differ).
        untraced: sequences of the sample with no answer-changing substitution (or no scored position).
    """

    rows: np.ndarray
    answer: np.ndarray
    flipped: np.ndarray
    clean: np.ndarray
    corrupt: np.ndarray
    y_clean: np.ndarray
    y_corrupt: np.ndarray
    untraced: int


def answer_pairs(task: Task, tokens: np.ndarray, targets: np.ndarray, seed: int) -> TracePairs:
    """One answer-changing substitution per sequence (module docstring).

    Args:
        task: the sample's task (its :meth:`~looptrace.tasks.base.Task.answer_flips`).
        tokens: [sequence, seq] input ids.
        targets: [sequence, seq] target ids, ``IGNORE`` where not scored.
        seed: ``base.seed``.
    """
    keep: list[tuple[int, int, int, int, int]] = []  # (row, a, f, new token, new answer)
    for r in range(tokens.shape[0]):
        scored = np.flatnonzero(targets[r] != IGNORE)
        if not scored.size:
            continue
        a = int(scored[-1])
        y = int(targets[r, a])
        flips = [fl for fl in task.answer_flips(tokens[r], a) if fl[2] != y]
        if not flips:
            continue
        f, v, y2 = flips[int(np.random.default_rng([int(seed), r, TRACE_STREAM]).integers(len(flips)))]
        keep.append((r, a, int(f), int(v), int(y2)))
    S = tokens.shape[1]
    rows = np.array([k[0] for k in keep], dtype=np.int64)
    clean = np.asarray(tokens, dtype=np.int64)[rows].reshape(-1, S)
    corrupt = clean.copy()
    for i, (_, _, f, v, _) in enumerate(keep):
        corrupt[i, f] = v
    return TracePairs(rows=rows, answer=np.array([k[1] for k in keep], dtype=np.int64),
                      flipped=np.array([k[2] for k in keep], dtype=np.int64), clean=clean, corrupt=corrupt,
                      y_clean=np.asarray(targets)[rows, [k[1] for k in keep]].astype(np.int64),
                      y_corrupt=np.array([k[4] for k in keep], dtype=np.int64),
                      untraced=int(tokens.shape[0] - len(keep)))


def causal_trace(step: InjectedStep, readout: LoopFn, clean: tuple[torch.Tensor, torch.Tensor],
                 corrupt: tuple[torch.Tensor, torch.Tensor], answer: np.ndarray, y_clean: np.ndarray,
                 y_corrupt: np.ndarray, positions: np.ndarray | None = None, gate: LoopFn | None = None,
                 chunk: int = 64) -> dict[str, np.ndarray]:
    """Patch the clean run's state into the corrupted run at every (loop k = 0..T, position p) (module docstring).

    Args:
        step: the loop step with its injection.
        readout: (h_t, t) -> logits [batch, seq, vocab].
        clean, corrupt: (h_0 [batch, seq, d], h_1..h_T [batch, seq, loop, d]) of the two runs.
        answer: [batch] the answer position a.
        y_clean, y_corrupt: [batch] the two answers.
        positions: [batch, seq] bool, the positions that may be patched (None = all; the loopmap stage passes
            p ≤ a under causal attention, where a later position cannot reach a).
        gate: (h_t, t) -> [batch, seq] native gate logits; None = no gate.
        chunk: patched sequences per forward (bounds memory).

    Returns:
        ``ld_clean``, ``ld_corrupt`` [batch] float64; ``ld_patched`` [batch, T + 1, seq] float64 (LD_corrupt where
        nothing was patched); ``patched`` [batch, T + 1, seq] bool (the cells run: states differ and the position
        may be patched); with ``gate``: ``gate_clean``, ``gate_corrupt`` [batch, T] and ``gate_patched``
        [batch, T + 1, seq, T] float64 — the gate logits at a at loops 1..T (the corrupted ones where nothing was
        patched).
    """
    h0c, hc = clean
    h0x, hx = corrupt
    B, S, T, _ = hc.shape
    a = torch.as_tensor(np.asarray(answer, dtype=np.int64), device=hc.device)
    yc = torch.as_tensor(np.asarray(y_clean, dtype=np.int64), device=hc.device)
    yx = torch.as_tensor(np.asarray(y_corrupt, dtype=np.int64), device=hc.device)

    def ld(h_T: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # [R, S, D] -> [R]
        r = torch.arange(h_T.shape[0], device=h_T.device)
        z = readout(h_T, T - 1)[r, a[b]].double()  # [R, vocab]
        return z[r, yc[b]] - z[r, yx[b]]

    def at_answer(g: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # [R, S] -> [R]
        return g[torch.arange(g.shape[0], device=g.device), a[b]].double()

    every = torch.arange(B, device=hc.device)
    with torch.inference_mode(False), torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        Hc = torch.cat([h0c[:, :, None], hc], 2)  # [B, S, T + 1, D]: h_0..h_T
        Hx = torch.cat([h0x[:, :, None], hx], 2)
        out: dict[str, np.ndarray] = {"ld_clean": ld(hc[:, :, -1], every).cpu().numpy(),
                                      "ld_corrupt": ld(hx[:, :, -1], every).cpu().numpy()}
        allowed = torch.ones((B, S), dtype=torch.bool) if positions is None else torch.as_tensor(positions)
        run = ((Hc != Hx).any(-1).cpu() & allowed[:, :, None]).permute(0, 2, 1)  # [B, T + 1, S]
        out["patched"] = run.numpy().copy()
        ld_p = np.broadcast_to(out["ld_corrupt"][:, None, None], (B, T + 1, S)).copy()
        if gate is not None:
            g_c = torch.stack([at_answer(gate(hc[:, :, t], t), every) for t in range(T)], 1).cpu().numpy()
            g_x = torch.stack([at_answer(gate(hx[:, :, t], t), every) for t in range(T)], 1).cpu().numpy()
            out["gate_clean"], out["gate_corrupt"] = g_c, g_x
            g_p = np.broadcast_to(g_x[:, None, None, :], (B, T + 1, S, T)).copy()
        for k in range(T + 1):
            cells = torch.nonzero(run[:, k])  # [(b, p)]
            for lo in range(0, cells.shape[0], chunk):
                b, p = cells[lo:lo + chunk, 0].to(hc.device), cells[lo:lo + chunk, 1].to(hc.device)
                r = torch.arange(b.shape[0], device=hc.device)
                h = Hx[b, :, k].clone()  # [R, S, D] the corrupted run's state after loop k
                h[r, p] = Hc[b, p, k]  # ... with the clean run's at (k, p)
                e = h0x[b].clone()
                if k == 0:  # h_0 is the injection itself
                    e[r, p] = h0c[b, p]
                gl = []
                if gate is not None and k >= 1:
                    gl.append(at_answer(gate(h, k - 1), b))  # the gate of loop k reads the patched state
                for t in range(k, T):
                    h = step(h, e, t)
                    if gate is not None:
                        gl.append(at_answer(gate(h, t), b))
                bn, pn = b.cpu().numpy(), p.cpu().numpy()
                ld_p[bn, k, pn] = ld(h, b).cpu().numpy()
                if gate is not None and gl:
                    g_p[bn, k, pn, max(k - 1, 0):] = torch.stack(gl, 1).cpu().numpy()
        out["ld_patched"] = ld_p
        if gate is not None:
            out["gate_patched"] = g_p
        return out


def gate_fn(adapter: LoopedModelAdapter) -> LoopFn | None:
    """The native gate's logit as a function of the state, (h_t, t) -> [batch, seq] (looptrace's own models with a
    gate: ``gate(ln_f(h_t))``); None for a model without one."""
    model = getattr(adapter, "model", None)
    logit = getattr(model, "gate_logit", None)
    if not adapter.info.has_gate or getattr(model, "gate", None) is None or logit is None:
        return None
    return lambda h, t: logit(h)


def is_causal(adapter: LoopedModelAdapter) -> bool:
    """Whether the model attends causally (looptrace's own models record it; anything else: assume not, so every
    position is patched)."""
    return bool(getattr(getattr(getattr(adapter, "model", None), "cfg", None), "causal", False))


def trace_sample(adapter: LoopedModelAdapter, task: Task, tokens: np.ndarray, targets: np.ndarray,
                 cfg: LoopmapConfig, seed: int, progress: bool = True) -> dict:
    """Causal tracing (and exit-gate patching, with a native gate) of the loopmap sample.

    Args:
        adapter: a model with a loop step.
        task: the sample's task (its answer-changing substitutions).
        tokens, targets: the sample, [sequence, seq].
        cfg: the section (``batch_size`` sequences per forward and per patched chunk).
        seed: ``base.seed`` (the substitution drawn per sequence).
        progress: show a progress bar.

    Returns:
        ``sequence``, ``answer``, ``flipped`` [n] and the arrays of :func:`causal_trace` over the traced sequences
        (n = those with a substitution), ``untraced`` (int) and ``gated`` (bool).
    """
    pairs = answer_pairs(task, tokens, targets, seed)
    gate = gate_fn(adapter)
    n, S = pairs.clean.shape
    parts: dict[str, list[np.ndarray]] = {}
    causal = is_causal(adapter)
    bounds = np.array_split(np.arange(n), max(1, -(-n // cfg.batch_size))) if n else []
    for idx in tqdm(bounds, desc="causal tracing", disable=None if progress else True, leave=False):
        B = len(idx)
        st = adapter.states(torch.from_numpy(np.concatenate([pairs.clean[idx], pairs.corrupt[idx]]))
                            .to(adapter.device))
        h0, hid = st.hidden_init, st.hidden
        ans = pairs.answer[idx]
        allowed = np.arange(S)[None, :] <= ans[:, None] if causal else np.ones((B, S), dtype=bool)
        out = causal_trace(lambda h, e, t: adapter.loop_step(h, e, t), lambda h, t: adapter.readout(h, t),
                           (h0[:B], hid[:B]), (h0[B:], hid[B:]), ans, pairs.y_clean[idx], pairs.y_corrupt[idx],
                           positions=allowed, gate=gate, chunk=cfg.batch_size)
        for key, v in out.items():
            parts.setdefault(key, []).append(v)
    res: dict = {key: np.concatenate(v) for key, v in parts.items()}
    res.update(sequence=pairs.rows, answer=pairs.answer, flipped=pairs.flipped, untraced=pairs.untraced,
               gated=gate is not None)
    return res


def adapter_causal_trace(adapter: LoopedModelAdapter, clean_ids: torch.Tensor, corrupt_ids: torch.Tensor,
                         answer: np.ndarray, y_clean: np.ndarray | None = None, y_corrupt: np.ndarray | None = None
                         ) -> dict[str, np.ndarray]:
    """:func:`causal_trace` of any clean / corrupted pair of [batch, seq] token ids through a model behind the dump's
    interface (e.g. an LM's token substitution); the answers default to each run's own full-depth argmax at
    ``answer``."""
    st = adapter.states(torch.cat([clean_ids, corrupt_ids]).to(adapter.device))
    B = clean_ids.shape[0]
    a = torch.as_tensor(np.asarray(answer, dtype=np.int64))
    if y_clean is None or y_corrupt is None:
        top = adapter.readout(st.hidden[:, :, -1], adapter.info.n_loops - 1).argmax(-1).cpu()  # [2B, S]
        y_clean = top[:B][torch.arange(B), a].numpy() if y_clean is None else y_clean
        y_corrupt = top[B:][torch.arange(B), a].numpy() if y_corrupt is None else y_corrupt
    S = clean_ids.shape[1]
    allowed = np.arange(S)[None, :] <= np.asarray(answer)[:, None] if is_causal(adapter) else None
    return causal_trace(lambda h, e, t: adapter.loop_step(h, e, t), lambda h, t: adapter.readout(h, t),
                        (st.hidden_init[:B], st.hidden[:B]), (st.hidden_init[B:], st.hidden[B:]), np.asarray(answer),
                        np.asarray(y_clean), np.asarray(y_corrupt), positions=allowed, gate=gate_fn(adapter))


__all__ = ["TRACE_STREAM", "TracePairs", "adapter_causal_trace", "answer_pairs", "causal_trace", "gate_fn",
           "is_causal", "trace_sample"]
