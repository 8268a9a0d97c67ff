"""A sample through the model (torch): ρ_t, ρ̄_t and the FTLE per token and loop, the signals the diagnoses read, and
every intervention's per-token effects (:func:`measure`); the trained checkpoint and its fixed sample
(:func:`load_sample`)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from looptrace.config import InputError, MissingInputError
from looptrace.loopmap.config import LoopmapConfig
from looptrace.loopmap.contraction import ContractionConfig, contraction_stats
from looptrace.loopmap.interventions import intervene, patch_donors
from looptrace.loopmap.tabulate import (
    MEASURES,
)
from looptrace.models.interface import LoopedModelAdapter, LoopedTransformerAdapter
from looptrace.signals.steps import step_metrics
from looptrace.tasks import make_task
from looptrace.tasks.base import IGNORE, Task


def no_loop_step(adapter: LoopedModelAdapter) -> str | None:
    """Why the adapter's loop map cannot be differentiated here (None = it can): no loop step, or loop memory
    (the step then reads the earlier loops' outputs: the map is not h_{t−1} ↦ h_t alone)."""
    if type(adapter).loop_step is LoopedModelAdapter.loop_step:
        return f"adapter {type(adapter).__name__} exposes no loop step"
    cfg = getattr(getattr(adapter, "model", None), "cfg", None)
    if getattr(cfg, "loop_memory", False):
        return "the model has loop memory ([RT]): its step reads earlier loops' outputs, not a map h_{t-1} -> h_t"
    return None


def measure(adapter: LoopedModelAdapter, tokens: np.ndarray, targets: np.ndarray, cfg: LoopmapConfig, seed: int,
            progress: bool = True) -> dict:
    """Run the sample through the model: per-(token, loop) arrays and every intervention's per-token effects.

    Every random draw is keyed by the sequence's index in the sample (the contraction's start vectors, the noise) or
    drawn once over the whole sample (the patch donors, :func:`~looptrace.loopmap.interventions.patch_donors`), so
    the result does not depend on ``cfg.batch_size`` beyond the rounding of batched kernels. A batch's states are
    computed in one forward together with its patch donors' (a donor with the token's own prefix then gives δ = 0
    exactly, as within one batch).

    Args:
        adapter: a model with a loop step (:func:`no_loop_step` is None).
        tokens: [sequence, seq] input ids.
        targets: [sequence, seq] target ids, :data:`~looptrace.tasks.base.IGNORE` where not scored.
        cfg: the section.
        seed: ``base.seed`` (tangents, noise, patching permutation).
        progress: show a progress bar.

    Returns:
        ``rho`` (ρ_t: exact up to ``cfg.exact_width``, else the power-method estimate), ``rho_bound`` (its upper
        bound ρ̄_t; NaN beyond ``exact_width``), ``ftle``, ``rel_step``, ``entropy``, ``argmax``, ``correct`` and,
        for a model with a native gate, ``gate_logit`` [token, loop];
        ``sequence`` [token]; ``exact`` (bool: d_model ≤ ``exact_width``); ``interventions``: list of
        (:class:`InterventionConfig`, measure -> [token, T − k], and ``delta_norm`` [token] ‖δ‖) in
        :meth:`LoopmapConfig.interventions` order. Tokens are the scored positions, sequence-major.
    """
    n = tokens.shape[0]
    T = adapter.info.n_loops
    ccfg = ContractionConfig(power_iters=cfg.power_iters, position_chunk=cfg.position_chunk, seed=seed,
                             exact_width=cfg.exact_width)
    icfgs = cfg.interventions(T, seed)
    # each patch's donors, drawn once over the whole sample (not per batch: the batching changes nothing)
    donors = {i: patch_donors(np.arange(n), c.seed, c.loop) for i, c in enumerate(icfgs) if c.kind == "patch"}
    parts: defaultdict[str, list[np.ndarray]] = defaultdict(list)  # the Returns' [token, loop] / [token] arrays
    effects: list[dict[str, list[np.ndarray]]] = [{m: [] for m in (*MEASURES, "delta_norm")} for _ in icfgs]
    bounds = np.array_split(np.arange(n), max(1, -(-n // cfg.batch_size)))  # near-equal batches
    for rows in tqdm(bounds, desc="loop map", disable=None if progress else True, leave=False):
        B = len(rows)
        extra = np.setdiff1d(np.concatenate([d[rows] for d in donors.values()]), rows) if donors else rows[:0]
        run = np.concatenate([rows, extra])  # the batch, then the donors it lacks: one forward
        at = {int(r): j for j, r in enumerate(run)}
        tgt = targets[rows]
        mask = tgt != IGNORE  # [B, S]
        st = adapter.states(torch.from_numpy(tokens[run]).to(adapter.device))
        h0_all, hid_all = st.hidden_init, st.hidden
        h0, hidden = h0_all[:B], hid_all[:B]

        def step(h: torch.Tensor, t: int, h0: torch.Tensor = h0) -> torch.Tensor:
            return adapter.loop_step(h, h0, t)

        # exact blocks only at the positions some sequence of the batch scores (the others are dropped below)
        stats = contraction_stats(step, h0, hidden, ccfg, rows=rows, positions=np.flatnonzero(mask.any(axis=0)))
        sel = torch.from_numpy(mask).to(h0.device)
        parts["rho"].append(stats["contraction"][sel].cpu().numpy())
        parts["rho_bound"].append(stats["contraction_bound"][sel].cpu().numpy())
        parts["ftle"].append(stats["ftle"][sel].cpu().numpy())
        hid = hidden[sel].double().cpu().numpy()  # [token, loop, d]
        parts["rel_step"].append(step_metrics(hid, h0[sel].double().cpu().numpy())["rel_step"])
        ent, arg = [], []
        for t in range(T):
            logp = torch.log_softmax(adapter.readout(hidden[:, :, t], t).double(), -1)[sel]
            ent.append(-(logp.exp() * logp).sum(-1).cpu().numpy())
            arg.append(logp.argmax(-1).cpu().numpy())
        parts["entropy"].append(np.stack(ent, 1))
        parts["argmax"].append(np.stack(arg, 1))
        parts["correct"].append(np.stack(arg, 1) == tgt[mask][:, None])
        if st.gate_logits is not None:  # the native gate's logits (exit-gate patching, the flip table's native exit)
            parts["gate_logit"].append(st.gate_logits[:B][sel].double().cpu().numpy())
        parts["sequence"].append(np.broadcast_to(rows[:, None], mask.shape)[mask])
        for i, (icfg, acc) in enumerate(zip(icfgs, effects, strict=True)):
            donor = None
            if i in donors:  # the donors' states after loop k, from the same forward
                idx = torch.as_tensor([at[int(d)] for d in donors[i][rows]], device=h0.device)
                donor = (h0_all if icfg.loop == 0 else hid_all[:, :, icfg.loop - 1])[idx]
            out = intervene(step, h0, hidden, icfg, readout=lambda h, t: adapter.readout(h, t), rows=rows,
                            donor=donor)
            for m in (*MEASURES, "delta_norm"):
                acc[m].append(out[m][sel].cpu().numpy())
    res: dict = {k: np.concatenate(v) for k, v in parts.items()}
    res["exact"] = ccfg.exact(int(hid_all.shape[-1]))
    res["interventions"] = [(icfg, {m: np.concatenate(acc[m]).astype(np.float64) for m in (*MEASURES, "delta_norm")})
                            for icfg, acc in zip(icfgs, effects, strict=True)]
    return res


def checkpoint_task(adapter: LoopedModelAdapter) -> Task:
    """The task a checkpoint records (``info.extra["task"]``, as the train stage saves it)."""
    spec = dict(adapter.info.extra["task"])
    return make_task(spec.pop("name"), spec)


def load_sample(train_dir: Path | str, cfg: LoopmapConfig, device: str, name: str
                ) -> tuple[LoopedTransformerAdapter, np.ndarray, np.ndarray]:
    """The trained checkpoint and the first ``cfg.sequences`` sequences of its ``cfg.split`` (its data seed).

    Raises:
        MissingInputError: no ``model.pt`` (names the stage that writes it).
        InputError: the checkpoint records no task or data seed for the split.
    """
    ckpt = Path(train_dir) / "model.pt"
    if not ckpt.is_file():
        raise MissingInputError(f"checkpoint '{ckpt}' not found; run `dvc repro train` first")
    adapter = LoopedTransformerAdapter.from_checkpoint(ckpt, device=device, name=name)
    extra = adapter.info.extra
    seeds = extra.get("data_seeds") or {}
    if "task" not in extra or cfg.split not in seeds:
        raise InputError(f"checkpoint '{ckpt}' records no task or data seed for split '{cfg.split}'; retrain with "
                         "the current train stage")
    data = checkpoint_task(adapter).dataset(cfg.split, cfg.sequences, int(seeds[cfg.split]))
    return adapter, np.asarray(data.tokens, dtype=np.int64), np.asarray(data.targets)
