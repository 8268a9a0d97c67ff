"""Fitted gates run loop by loop on a live batch (the latency stage's real early exit)."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
from looptrace.gates.config import GEOMETRY_FEATURES, STORE_FEATURES


def load_fitted(gates_dir: Path | str) -> dict:
    """The pickled fit of one model (``<gates_dir>/gates.pkl``): features, gates, stats, hidden dtype.

    Raises:
        FileNotFoundError: the file is missing (names the stage to run).
    """
    path = Path(gates_dir) / "gates.pkl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; run the gates stage (dvc repro gates)")
    with open(path, "rb") as fh:
        return pickle.load(fh)  # our own artifact, written by gates_stage


class OnlineGate:
    """A fitted gate evaluated loop by loop on a live batch (``pipeline.latency.CallableRule``).

    The features are recomputed exactly as the offline path computed them from the store: the state is
    rounded to the store's ``hidden`` dtype, the step geometry comes from
    ``pipeline.geometry.step_metrics`` on the rounded history, and the logit statistics are the float32
    formulas of ``pipeline.stats.LoopStats``.

    Args:
        fit: the dict of :func:`load_fitted`.
        name: gate name (``logreg-oracle`` ...).
    """

    def __init__(self, fit: dict, name: str):
        if name not in fit["gates"]:
            raise KeyError(f"gate '{name}' is not in the fitted gates ({', '.join(fit['gates'])})")
        self.name, self.gate, self.features = name, fit["gates"][name], fit["features"]
        self.stats = tuple(fit["stats"])
        self.hidden_dtype = str(fit.get("hidden_dtype") or "float16")
        self.needs_logits = any(s in STORE_FEATURES and s != "gate_logit" for s in self.stats)
        self._model = None

    def _round(self, h):
        import torch

        dt = {"float16": torch.float16, "bfloat16": torch.bfloat16}.get(self.hidden_dtype)
        return (h.to(dt) if dt is not None else h).float()

    def reset(self, model, h0) -> dict:
        """State for a new batch: the rounded h_0 as history [b, s, 1, D]."""
        self._model = model
        return {"hist": self._round(h0).unsqueeze(2)}

    def _logit_stats(self, z, state: dict) -> dict:
        import torch
        from looptrace.signals.logits import kl_div

        zf = z.float()
        logp = torch.log_softmax(zf, dim=-1)
        p = logp.exp()
        out = {"entropy": -torch.where(p > 0, p * logp, torch.zeros((), dtype=torch.float32, device=z.device)).sum(-1),
               "max_prob": logp.max(dim=-1).values.exp()}
        if zf.shape[-1] >= 2:
            top2 = zf.topk(2, dim=-1).values
            out["margin"] = top2[..., 0] - top2[..., 1]
        else:
            out["margin"] = torch.full(zf.shape[:-1], float("nan"), device=z.device)
        prev_logp, prev_z = state.get("logp_prev"), state.get("z_prev")
        if prev_logp is None:
            nan = torch.full(zf.shape[:-1], float("nan"), dtype=torch.float32, device=z.device)
            out.update(kl_prev=nan, kl_prev_rev=nan, logit_change=nan)
        else:
            out["kl_prev"] = kl_div(logp, prev_logp)
            out["kl_prev_rev"] = kl_div(prev_logp, logp)
            out["logit_change"] = torch.linalg.vector_norm(zf - prev_z, dim=-1)
        state["logp_prev"], state["z_prev"] = logp, zf
        return out

    def stop_prob(self, t: int, h, z, state: dict):
        """P(stop) after loop t (1-based) from h_t [b, s, D] and z_t [b, s, V]: [b, s] float64 tensor."""
        import torch

        b, s, D = h.shape
        hr = self._round(h)
        hist = torch.cat([state["hist"], hr.unsqueeze(2)], dim=2)  # [b, s, t + 1, D]
        state["hist"] = hist
        cols: dict[str, np.ndarray] = {}
        if any(n in GEOMETRY_FEATURES for n in self.stats):
            from looptrace.signals.steps import step_metrics

            hn = hist.reshape(b * s, t + 1, D).cpu().numpy()
            m = step_metrics(hn[:, 1:], hn[:, 0])
            m["hidden_change"] = m["step_norm"]
            cols.update({k: v[:, -1] for k, v in m.items()})
        if self.needs_logits:
            cols.update({k: v.reshape(-1).cpu().numpy() for k, v in self._logit_stats(z, state).items()})
        if "gate_logit" in self.stats:
            cols["gate_logit"] = self._model.gate_logit(h).float().reshape(-1).cpu().numpy()
        stats = np.stack([cols[n] for n in self.stats], axis=-1)[:, None, :] if self.stats else None
        X = self.features.transform(hr.reshape(b * s, 1, D).cpu().numpy(), stats, np.array([t - 1]))
        p = self.gate.stop_prob(X)[:, 0]
        return torch.as_tensor(p, dtype=torch.float64, device=h.device).reshape(b, s)


def load_online_gate(gates_dir: Path | str, rule: str) -> OnlineGate:
    """The fitted gate ``rule`` (``gate:<name>``) of one model as an online rule (DESIGN.md latency contract).

    Args:
        gates_dir: ``artifacts/gates/<model>``.
        rule: the rule name as in chosen.parquet.

    Returns:
        :class:`OnlineGate` with ``stop_prob(t, h, z, state)``, ``needs_logits`` and ``reset(model, h0)``.

    Raises:
        FileNotFoundError: no ``gates.pkl``; KeyError: the gate was not fitted.
    """
    return OnlineGate(load_fitted(gates_dir), str(rule).removeprefix("gate:"))
