"""Halting gates fit on frozen trajectories (the ``gates`` stage, SPEC §6, [AD]).

Backbone and readout head stay frozen. A new gate maps the features of a token at loop t to
P(stop | features_t); the exit rule is SPEC §4's "offline gate", d = min{t : P(stop) ≥ γ} (d = T when
never met). Fit on the ``fit`` split, calibrate γ on ``val`` (the 51-quantile grid of readouts),
report on ``test`` — scored by exactly the operating-point code of ``pipeline.readouts``.

Features per (token, loop), all from the trajectory store (read block by block):

- h_t (``hidden``), optionally PCA-reduced (scikit-learn ``PCA`` fit on fit-split states only);
- optional scalar statistics (``gates.stats``): the store's logit statistics (entropy, max_prob,
  margin, kl_prev, kl_prev_rev, logit_change, gate_logit) and the step geometry of SPEC §2 (step_norm,
  rel_step, step_cos, state_cos_dist, accel, accel_norm, step_d2, hidden_change) computed with
  ``pipeline.geometry.step_metrics`` — the function the geometry stage uses, so the values are those of
  ``token_loop.parquet``. Non-negative statistics enter as log(max(x, 1e-10)) (``gates.log_stats``:
  they span decades, e.g. KL 1e-6…1); statistics that need t − 1 are NaN at t = 1 and, after
  standardising, set to 0 (= the fit mean) — the loop encoding tells the gate which loop it is at;
- the loop index, one-hot over the T loops by default (``gates.loop_feature``): a linear gate then
  has one bias per loop, i.e. it can learn a depth prior as the PonderNet objective needs; ``scalar``
  (t / T) and ``none`` are the alternatives.

The continuous part (h or its PCA components, statistics, scalar loop) is standardised with a
scikit-learn ``StandardScaler`` fit on the fit split only. Statistics that use the target
(``target_logprob``) or loop T's readout (``kl_final``) are refused: the gate must be computable at
loop t.

Gates (``gates.gates``, names ``<gate>-<labels>``; rule ``gate:<gate>-<labels>``):

- ``logreg-*``: ``sklearn.linear_model.LogisticRegression``; ``mlp-*``:
  ``sklearn.neural_network.MLPClassifier``, on the label schemes of SPEC §6:
  ``oracle`` (RecurTrace): continue_t = 1[min_{t'>t} ℓ_{t'} < ℓ_t − δ];
  ``consistent`` (CALM): stop_t = 1[argmax_t = argmax_T];
  ``utility`` (Ouro stage II): I_t = max(0, ℓ_{t−1} − ℓ_t), soft continue target
  c_t = σ(k(I_t − γ)), k = 50, γ = 0.005. Soft targets are fit with the classifiers by a
  sample-weighted binary fit: each row appears once as "stop" with weight 1 − c_t and once as
  "continue" with weight c_t, whose weighted log-loss is exactly the soft-target cross-entropy.
  Ouro pairs the decision at loop t with I_t (the improvement loop t itself brought; defined for
  t ≥ 2): ``gates.utility_align: ouro``; ``next`` pairs it with I_{t+1}, the improvement the next
  loop would bring (defined for t ≤ T − 1).
  P(stop) = 1 − P(continue) for utility and oracle, P(stop) for consistent.
- ``ponder-linear`` / ``ponder-mlp``: a small torch module g (linear, or a 2-layer MLP) trained on the
  frozen per-depth losses ℓ_t = −target_logprob to minimise Σ_t q_t ℓ_t + β KL(q ‖ π) with
  λ_t = σ(g(x_t)) and q = ``pipeline.regimes.halting_distribution`` (SPEC §5, [AD]'s "same objective");
  P(stop) = λ_t.

Training rows are loops 1..T − 1 (the exit at T is forced whatever the gate says; the PonderNet
objective uses all T loops, q_T taking the remaining mass), and the threshold grid is the quantiles of
val P(stop) at loops 1..T − 1 — the values that can move an exit. Training tokens are a seeded
subsample of the fit split (``gates.max_fit_tokens``). Every random choice derives from ``base.seed``
(and the model and gate names), so the same params give the same numbers.

Cross-regime transfer (``cross_regime.parquet``): for every task, each gate of ``gates.cross_gates``
fit on one model's trajectories is applied to every model of the same task (itself included):
``transfer`` = the fitted gate (features, scaler, classifier) applied as is to the eval model's
trajectories; ``refit`` = the same gate spec refit on the eval model's own fit split (that is, the eval
model's own gate, repeated on each row so every (fit, eval) pair carries its baseline). Both are
calibrated on the eval model's val split and reported on its test split.
"""

from __future__ import annotations

import json
import math
import pickle
import time
import warnings
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from .artifacts import atomic_dir, jsonable
from .config import ConfigError, to_dict
from .readouts import (
    RuleResult,
    SplitData,
    d_at,
    evaluate_depths,
    exit_depths,
    quantile_grid,
    result_frames,
    write_outputs,
)

SPLITS = ("fit", "val", "test")
#: Label schemes of SPEC §6.
LABELS = ("ponder", "utility", "oracle", "consistent")
#: scikit-learn classifiers for the utility / oracle / consistent labels.
CLASSIFIERS = ("logreg", "mlp")
#: torch gate architectures for the PonderNet objective.
PONDER_ARCHS = ("linear", "mlp")
#: Statistics read from the store (SPEC §3) that a gate may use at loop t.
STORE_FEATURES = ("entropy", "max_prob", "margin", "kl_prev", "kl_prev_rev", "logit_change", "gate_logit")
#: Step geometry (SPEC §2) from ``pipeline.geometry.step_metrics``; ``hidden_change`` = step_norm.
GEOMETRY_FEATURES = ("step_norm", "rel_step", "step_cos", "state_cos_dist", "accel", "accel_norm", "step_d2",
                     "hidden_change")
FEATURE_STATS = STORE_FEATURES + GEOMETRY_FEATURES
#: Statistics a gate must not see, and why.
FORBIDDEN_STATS = {"target_logprob": "it uses the target", "kl_final": "it needs loop T's readout",
                   "argmax": "it is a class id, not a scalar", "correct": "it uses the target"}
#: Statistics that can be negative (entered as is, not logged).
SIGNED_STATS = ("step_cos", "step_d2", "gate_logit")
LOOP_FEATURES = ("onehot", "scalar", "none")
UTILITY_ALIGN = ("ouro", "next")
#: Floor of the log transform of non-negative statistics (exact zeros, e.g. entropy 0 in float32).
LOG_FLOOR = 1e-10
#: Floor of q inside log q of KL(q ‖ π) (as ``pipeline.regimes.regime_loss``).
Q_FLOOR = 1e-12


# ----------------------------------------------------------------------------------------------
# Configuration
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GateSpec:
    """One gate × label combination.

    Attributes:
        gate: ``logreg`` | ``mlp`` (scikit-learn, labels utility/oracle/consistent) or ``linear`` |
            ``mlp`` (torch, labels ponder).
        labels: ``ponder`` | ``utility`` | ``oracle`` | ``consistent``.
    """

    gate: str
    labels: str

    @property
    def name(self) -> str:
        """``<gate>-<labels>`` for scikit-learn gates, ``ponder-<arch>`` for the PonderNet objective."""
        return f"ponder-{self.gate}" if self.labels == "ponder" else f"{self.gate}-{self.labels}"

    @property
    def rule(self) -> str:
        """Rule name in the outputs: ``gate:<name>`` (e.g. ``gate:logreg-oracle``, ``gate:ponder-linear``)."""
        return f"gate:{self.name}"

    @classmethod
    def parse(cls, text: str, where: str = "gates.gates") -> GateSpec:
        """``logreg-oracle`` / ``mlp-utility`` / ``ponder-linear`` ... -> GateSpec (ConfigError otherwise)."""
        head, _, tail = str(text).partition("-")
        if head == "ponder" and tail in PONDER_ARCHS:
            return cls(tail, "ponder")
        if head in CLASSIFIERS and tail in LABELS and tail != "ponder":
            return cls(head, tail)
        allowed = [f"{c}-{lab}" for c in CLASSIFIERS for lab in LABELS if lab != "ponder"]
        allowed += [f"ponder-{a}" for a in PONDER_ARCHS]
        raise ConfigError(f"{where}: unknown gate '{text}'; allowed: {', '.join(allowed)}")


@dataclass(frozen=True)
class PonderConfig:
    """``gates.ponder``: the PonderNet objective on frozen per-depth losses (SPEC §5/§6).

    Attributes:
        beta: weight of KL(q ‖ π) ([AD] sweeps 0.001 … 0.5).
        prior: π: ``uniform`` or ``geometric``.
        lam: λ of the geometric prior.
        hidden: width of the 2-layer MLP gate.
        epochs: passes over the fit tokens.
        batch_tokens: tokens per Adam step.
        lr: Adam learning rate.
        weight_decay: Adam (L2) weight decay.
    """

    beta: float = 0.01
    prior: str = "uniform"
    lam: float = 0.3
    hidden: int = 32
    epochs: int = 40
    batch_tokens: int = 1024
    lr: float = 0.03
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        if self.beta < 0:
            raise ConfigError(f"gates.ponder.beta must be ≥ 0, got {self.beta}")
        if self.prior not in ("uniform", "geometric"):
            raise ConfigError(f"gates.ponder.prior must be uniform or geometric, got {self.prior!r}")
        if not 0.0 < self.lam < 1.0:
            raise ConfigError(f"gates.ponder.lam must be in (0, 1), got {self.lam}")
        if min(self.hidden, self.epochs, self.batch_tokens) < 1 or self.lr <= 0:
            raise ConfigError("gates.ponder: hidden, epochs and batch_tokens must be ≥ 1 and lr > 0")


@dataclass(frozen=True)
class GatesConfig:
    """``gates`` section of ``params.yaml``.

    Attributes:
        gates: gate × label combinations fit per model (:meth:`GateSpec.parse` names).
        pca_components: PCA components of h_t (fit on the fit split only); 0 = raw h_t.
        stats: scalar statistics concatenated to the state features (:data:`FEATURE_STATS`).
        log_stats: enter non-negative statistics as log(max(x, 1e-10)).
        loop_feature: ``onehot`` (T columns) | ``scalar`` (t / T) | ``none``.
        max_fit_tokens: fit tokens used for fitting (seeded subsample); null = all.
        oracle_delta: δ of the oracle labels (nats).
        utility_k, utility_gamma: k and γ of the utility target σ(k(I_t − γ)) (Ouro: 50, 0.005).
        utility_align: ``ouro`` (loop t ↔ I_t) or ``next`` (loop t ↔ I_{t+1}).
        logreg_c, logreg_max_iter: ``LogisticRegression`` C and max_iter.
        mlp_hidden, mlp_alpha, mlp_lr, mlp_batch_size, mlp_max_iter: ``MLPClassifier`` settings
            (a fixed budget of epochs; no early stopping).
        ponder: the PonderNet gate (:class:`PonderConfig`).
        n_quantiles, delta, dx: calibration grid size, chosen-point tolerance (accuracy points) and D@X
            targets — keep them equal to ``readouts``' so gates and readouts are comparable.
        cross_gates: gates evaluated across the models of a task (must be in ``gates``); [] = none.
        cross_budget: depth budget (loops) of ``acc_at_budget`` in cross_regime.parquet.
        block_tokens: tokens per block read from a store (null = the store's chunk size).
        threads: BLAS (threadpoolctl) and torch threads while fitting and predicting; null =
            ``base.threads``. One by default: the matrices are small, and on a shared machine a
            multi-threaded OpenBLAS SVD of a 10k × 64 matrix was measured 25× slower than one thread.
    """

    gates: tuple[str, ...] = ("logreg-oracle", "logreg-consistent", "logreg-utility", "mlp-oracle",
                              "mlp-consistent", "ponder-linear", "ponder-mlp")
    pca_components: int = 16
    stats: tuple[str, ...] = ("entropy", "max_prob", "margin", "kl_prev", "rel_step")
    log_stats: bool = True
    loop_feature: str = "onehot"
    max_fit_tokens: int | None = 4096
    oracle_delta: float = 0.01
    utility_k: float = 50.0
    utility_gamma: float = 0.005
    utility_align: str = "ouro"
    logreg_c: float = 1.0
    logreg_max_iter: int = 500
    mlp_hidden: tuple[int, ...] = (32,)
    mlp_alpha: float = 1e-4
    mlp_lr: float = 2e-3
    mlp_batch_size: int = 512
    mlp_max_iter: int = 20
    ponder: PonderConfig = field(default_factory=PonderConfig)
    n_quantiles: int = 51
    delta: float = 0.5
    dx: tuple[float, ...] = (95.0, 98.0, 99.0)
    cross_gates: tuple[str, ...] = ("logreg-oracle", "ponder-linear")
    cross_budget: float = 2.0
    block_tokens: int | None = None
    threads: int | None = 1

    def __post_init__(self) -> None:
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"gates.threads must be ≥ 1 or null, got {self.threads}")
        if not self.gates:
            raise ConfigError("gates.gates must list at least one gate (e.g. logreg-oracle)")
        specs = [GateSpec.parse(g) for g in self.gates]
        if len({s.name for s in specs}) != len(specs):
            raise ConfigError(f"gates.gates lists a gate twice: {list(self.gates)}")
        names = {s.name for s in specs}
        for g in self.cross_gates:
            s = GateSpec.parse(g, "gates.cross_gates")
            if s.name not in names:
                raise ConfigError(f"gates.cross_gates: '{g}' is not in gates.gates; add it there or drop it")
        if self.pca_components < 0:
            raise ConfigError(f"gates.pca_components must be ≥ 0 (0 = off), got {self.pca_components}")
        for s in self.stats:
            if s in FORBIDDEN_STATS:
                raise ConfigError(f"gates.stats: '{s}' cannot be a gate feature ({FORBIDDEN_STATS[s]})")
            if s not in FEATURE_STATS:
                raise ConfigError(f"gates.stats: unknown statistic '{s}'; allowed: {', '.join(FEATURE_STATS)}")
        if len(set(self.stats)) != len(self.stats):
            raise ConfigError(f"gates.stats lists a statistic twice: {list(self.stats)}")
        if self.loop_feature not in LOOP_FEATURES:
            raise ConfigError(f"gates.loop_feature must be one of {', '.join(LOOP_FEATURES)}, got {self.loop_feature!r}")
        if self.utility_align not in UTILITY_ALIGN:
            raise ConfigError(f"gates.utility_align must be one of {', '.join(UTILITY_ALIGN)}, "
                              f"got {self.utility_align!r}")
        if self.max_fit_tokens is not None and self.max_fit_tokens < 1:
            raise ConfigError(f"gates.max_fit_tokens must be ≥ 1 or null, got {self.max_fit_tokens}")
        if self.oracle_delta < 0:
            raise ConfigError(f"gates.oracle_delta must be ≥ 0 nats, got {self.oracle_delta}")
        if self.n_quantiles < 1:
            raise ConfigError(f"gates.n_quantiles must be ≥ 1, got {self.n_quantiles}")
        if not 0.0 <= self.delta <= 100.0:
            raise ConfigError(f"gates.delta must be in [0, 100] accuracy points, got {self.delta}")
        if not self.dx or any(not 0.0 < x <= 100.0 for x in self.dx):
            raise ConfigError(f"gates.dx: accuracy percentages in (0, 100], got {list(self.dx)}")
        if self.cross_budget <= 0:
            raise ConfigError(f"gates.cross_budget must be > 0 loops, got {self.cross_budget}")
        if not self.mlp_hidden or min(self.mlp_hidden) < 1 or min(self.mlp_batch_size, self.mlp_max_iter,
                                                                  self.logreg_max_iter) < 1:
            raise ConfigError("gates: mlp_hidden sizes, mlp_batch_size, mlp_max_iter and logreg_max_iter must be ≥ 1")
        if self.logreg_c <= 0 or self.mlp_lr <= 0 or self.mlp_alpha < 0:
            raise ConfigError("gates: logreg_c and mlp_lr must be > 0, mlp_alpha ≥ 0")
        if self.block_tokens is not None and self.block_tokens < 1:
            raise ConfigError(f"gates.block_tokens must be ≥ 1 or null, got {self.block_tokens}")

    @property
    def specs(self) -> list[GateSpec]:
        """The fitted gates, in config order."""
        return [GateSpec.parse(g) for g in self.gates]

    @property
    def cross_specs(self) -> list[GateSpec]:
        """The gates evaluated across models."""
        return [GateSpec.parse(g, "gates.cross_gates") for g in self.cross_gates]


def derive_seed(base_seed: int, *keys: str) -> int:
    """A 32-bit seed from ``base.seed`` and names (model, gate): stable across runs and platforms."""
    ss = np.random.SeedSequence([int(base_seed) & 0xFFFFFFFF, *[zlib.crc32(k.encode()) for k in keys]])
    return int(ss.generate_state(1)[0])


# ----------------------------------------------------------------------------------------------
# Labels (SPEC §6), numpy on [token, loop]
# ----------------------------------------------------------------------------------------------


def oracle_continue(loss: np.ndarray, delta: float) -> np.ndarray:
    """RecurTrace oracle labels: continue_t = 1[min_{t'>t} ℓ_{t'} < ℓ_t − δ].

    Args:
        loss: [token, loop] ℓ_t (nats).
        delta: required improvement δ (nats).

    Returns:
        [token, loop] bool; False at t = T (no later loop).
    """
    ell = np.asarray(loss, dtype=np.float64)
    future = np.full_like(ell, np.inf)
    # suffix minimum over t' > t: reverse cumulative min, shifted one loop left
    future[:, :-1] = np.minimum.accumulate(ell[:, ::-1], axis=1)[:, ::-1][:, 1:]
    return future < ell - delta


def consistent_stop(argmax: np.ndarray) -> np.ndarray:
    """CALM consistency labels: stop_t = 1[argmax_t = argmax_T]; [token, loop] bool (True at T)."""
    a = np.asarray(argmax)
    return a == a[:, -1:]


def utility_continue(loss: np.ndarray, k: float = 50.0, gamma: float = 0.005, align: str = "ouro") -> np.ndarray:
    """Ouro stage II soft continue targets c = σ(k(I − γ)) with I_t = max(0, ℓ_{t−1} − ℓ_t).

    Args:
        loss: [token, loop] ℓ_t (nats).
        k, gamma: slope and offset (Ouro: 50, 0.005).
        align: ``ouro``: loop t gets c(I_t) (t ≥ 2; NaN at t = 1); ``next``: loop t gets c(I_{t+1})
            (t ≤ T − 1; NaN at T).

    Returns:
        [token, loop] float64 continue probabilities in (0, 1), NaN where undefined.
    """
    ell = np.asarray(loss, dtype=np.float64)
    imp = np.maximum(0.0, ell[:, :-1] - ell[:, 1:])  # imp[:, j] = I_{j+2} (1-based loop j + 2)
    c = 1.0 / (1.0 + np.exp(-k * (imp - gamma)))
    out = np.full(ell.shape, np.nan)
    if align == "ouro":
        out[:, 1:] = c
    elif align == "next":
        out[:, :-1] = c
    else:
        raise ValueError(f"utility_continue: align must be one of {UTILITY_ALIGN}, got {align!r}")
    return out


def stop_targets(spec: GateSpec, loss: np.ndarray, argmax: np.ndarray, cfg: GatesConfig) -> np.ndarray:
    """The stop target of a scikit-learn gate per (token, loop): 1 − continue, or stop.

    Returns:
        [token, loop] float64 in [0, 1] (hard labels are 0/1), NaN where the scheme is undefined.
    """
    if spec.labels == "oracle":
        return 1.0 - oracle_continue(loss, cfg.oracle_delta).astype(np.float64)
    if spec.labels == "consistent":
        return consistent_stop(argmax).astype(np.float64)
    if spec.labels == "utility":
        return 1.0 - utility_continue(loss, cfg.utility_k, cfg.utility_gamma, cfg.utility_align)
    raise ValueError(f"stop_targets: labels '{spec.labels}' have no targets (ponder is an objective)")


# ----------------------------------------------------------------------------------------------
# The PonderNet objective on frozen losses (torch)
# ----------------------------------------------------------------------------------------------


def ponder_prior(T: int, prior: str = "uniform", lam: float = 0.3):
    """π over depths [T] (torch float32), via ``pipeline.regimes.prior_weights`` (joint regime's prior)."""
    from .regimes import RegimeConfig, prior_weights

    return prior_weights(T, RegimeConfig(kind="joint", prior=prior, lam=lam))


def ponder_loss(gate_logits, loss, beta: float, prior):
    """Mean over tokens of Σ_t q_t ℓ_t + β KL(q ‖ π) (SPEC §5), q from ``regimes.halting_distribution``.

    Args:
        gate_logits: [token, loop] torch tensor g_t (λ_t = σ(g_t)).
        loss: [token, loop] frozen ℓ_t (nats), same dtype.
        beta: KL weight.
        prior: [loop] π.

    Returns:
        Scalar tensor (nats).
    """
    import torch

    from .regimes import halting_distribution

    q = halting_distribution(gate_logits)
    pi = prior.to(q)
    kl = (q * (torch.log(q.clamp_min(Q_FLOOR)) - torch.log(pi))).sum(-1)
    return ((q * loss).sum(-1) + beta * kl).mean()


def _ponder_module(n_features: int, arch: str, hidden: int):
    """The gate g: features [..., F] -> logit [...] (linear, or Linear-ReLU-Linear)."""
    from torch import nn

    class PonderGate(nn.Module):
        """g(x_t): linear or 2-layer MLP halting-logit head on per-loop features."""

        def __init__(self) -> None:
            super().__init__()
            self.n_features, self.arch, self.hidden = n_features, arch, hidden
            if arch == "linear":
                self.net = nn.Linear(n_features, 1)
            else:
                self.net = nn.Sequential(nn.Linear(n_features, hidden), nn.ReLU(), nn.Linear(hidden, 1))

        def forward(self, x):  # x [..., F] -> [...]
            return self.net(x).squeeze(-1)

    return PonderGate()


def fit_ponder(X: np.ndarray, loss: np.ndarray, arch: str, cfg: PonderConfig, seed: int):
    """Train a PonderNet gate on frozen per-depth losses.

    Args:
        X: [token, loop, feature] standardised features (all T loops).
        loss: [token, loop] ℓ_t (nats).
        arch: ``linear`` | ``mlp``.
        cfg: objective and optimiser settings.
        seed: initialisation and batch-order seed (the global torch RNG is left untouched).

    Returns:
        (module in eval mode, dict with the final fit objective and mean halting depth Σ t q_t).
    """
    import torch

    from .regimes import halting_distribution

    n, T, F = X.shape
    xt = torch.as_tensor(np.ascontiguousarray(X), dtype=torch.float32)
    lt = torch.as_tensor(np.ascontiguousarray(loss), dtype=torch.float32)
    prior = ponder_prior(T, cfg.prior, cfg.lam)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = _ponder_module(F, arch, cfg.hidden)
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    bs = min(cfg.batch_tokens, n)
    for _ in range(cfg.epochs):
        perm = torch.randperm(n, generator=gen)
        for lo in range(0, n, bs):
            idx = perm[lo:lo + bs]
            obj = ponder_loss(model(xt[idx]), lt[idx], cfg.beta, prior)
            opt.zero_grad(set_to_none=True)
            obj.backward()
            opt.step()
    model.eval()
    with torch.no_grad():
        g = model(xt)
        obj = float(ponder_loss(g, lt, cfg.beta, prior))
        depth = float((halting_distribution(g) * torch.arange(1, T + 1, dtype=g.dtype)).sum(-1).mean())
    return model, {"objective": obj, "mean_halting_depth": depth}


# ----------------------------------------------------------------------------------------------
# Features
# ----------------------------------------------------------------------------------------------


def transform_stats(stats: np.ndarray, names: Sequence[str], log_stats: bool) -> np.ndarray:
    """Raw statistics [..., k] -> model inputs: log(max(x, 1e-10)) for non-negative ones (float64)."""
    s = np.array(stats, dtype=np.float64, copy=True)
    if log_stats:
        for j, name in enumerate(names):
            if name not in SIGNED_STATS:
                with np.errstate(invalid="ignore"):
                    s[..., j] = np.log(np.maximum(s[..., j], LOG_FLOOR))  # NaN stays NaN
    return s


class FeaturePipeline:
    """Per-(token, loop) gate features: [PCA(h_t) | stats_t | loop], standardised on the fit split.

    Args:
        n_loops: T.
        d_model: width of h_t.
        pca_components: PCA components (0 = raw h_t).
        stats: statistic names (columns of the ``stats`` argument of :meth:`fit` / :meth:`transform`).
        log_stats: log non-negative statistics.
        loop_feature: ``onehot`` | ``scalar`` | ``none``.
    """

    def __init__(self, n_loops: int, d_model: int, pca_components: int = 0, stats: Sequence[str] = (),
                 log_stats: bool = True, loop_feature: str = "onehot"):
        if pca_components > d_model:
            raise ValueError(f"gates.pca_components = {pca_components} exceeds d_model = {d_model}; "
                             f"set it ≤ {d_model} (or 0 = off)")
        self.n_loops, self.d_model = int(n_loops), int(d_model)
        self.pca_components, self.stats = int(pca_components), tuple(stats)
        self.log_stats, self.loop_feature = bool(log_stats), loop_feature
        self.pca = None
        self.scaler = None

    @property
    def n_features(self) -> int:
        """F: columns of :meth:`transform`'s output."""
        n = (self.pca_components or self.d_model) + len(self.stats)
        return n + {"onehot": self.n_loops, "scalar": 1, "none": 0}[self.loop_feature]

    @property
    def feature_names(self) -> list[str]:
        """Column names, in order."""
        h = ([f"pc{i + 1}" for i in range(self.pca_components)] if self.pca_components
             else [f"h{i}" for i in range(self.d_model)])
        loop = {"onehot": [f"loop{t}" for t in range(1, self.n_loops + 1)], "scalar": ["loop_frac"],
                "none": []}[self.loop_feature]
        return h + list(self.stats) + loop

    def _continuous(self, h: np.ndarray, stats: np.ndarray | None, loops: np.ndarray, fit: bool) -> np.ndarray:
        n, L, D = h.shape
        H = np.asarray(h, dtype=np.float64).reshape(n * L, D)
        if self.pca_components:
            if fit:
                from sklearn.decomposition import PCA

                # "full" SVD: exact and deterministic (no randomised solver, no random_state involved).
                self.pca = PCA(n_components=self.pca_components, svd_solver="full").fit(H)
            H = self.pca.transform(H)
        parts = [H]
        if self.stats:
            parts.append(transform_stats(stats, self.stats, self.log_stats).reshape(n * L, len(self.stats)))
        if self.loop_feature == "scalar":
            parts.append(np.broadcast_to(((loops + 1) / self.n_loops)[None, :], (n, L)).reshape(n * L, 1))
        return np.concatenate(parts, axis=1)

    def fit(self, h: np.ndarray, stats: np.ndarray | None, loops: np.ndarray | None = None) -> FeaturePipeline:
        """Fit PCA and scaler on fit-split rows.

        Args:
            h: [token, L, d_model] states at loops ``loops``.
            stats: [token, L, k] raw statistics (NaN where undefined), or None when ``stats`` is empty.
            loops: [L] 0-based loop indices of the second axis (default 0..L − 1).

        Returns:
            self.
        """
        from sklearn.preprocessing import StandardScaler

        loops = np.arange(h.shape[1]) if loops is None else np.asarray(loops)
        C = self._continuous(h, stats, loops, fit=True)
        k0 = self.pca_components or self.d_model
        for j, name in enumerate(self.stats):
            if not np.isfinite(C[:, k0 + j]).any():
                raise ValueError(f"gates.stats: '{name}' has no finite value on the fit rows (loops "
                                 f"{int(loops.min()) + 1}..{int(loops.max()) + 1}; it is undefined there); drop it")
        # StandardScaler ignores NaN when fitting (undefined t = 1 statistics) and keeps them on transform.
        self.scaler = StandardScaler().fit(C)
        return self

    def transform(self, h: np.ndarray, stats: np.ndarray | None, loops: np.ndarray | None = None) -> np.ndarray:
        """Features [token, L, F] float64 of states h [token, L, d_model] at 0-based ``loops`` [L]."""
        if self.scaler is None:
            raise ValueError("FeaturePipeline.transform called before fit")
        n, L, D = h.shape
        if D != self.d_model:
            raise ValueError(f"gate features were fit on d_model {self.d_model}, got states of width {D}")
        loops = np.arange(L) if loops is None else np.asarray(loops)
        C = self.scaler.transform(self._continuous(h, stats, loops, fit=False))
        C = np.nan_to_num(C, nan=0.0)  # undefined statistic (t = 1) -> the fit mean
        parts = [C]
        if self.loop_feature == "onehot":
            oh = np.zeros((n, L, self.n_loops))
            oh[:, np.arange(L), loops] = 1.0
            parts.append(oh.reshape(n * L, self.n_loops))
        return np.concatenate(parts, axis=1).reshape(n, L, -1)


# ----------------------------------------------------------------------------------------------
# Fitted gates
# ----------------------------------------------------------------------------------------------


class FittedGate:
    """A fitted gate: P(stop | features) per (token, loop).

    Attributes:
        spec: gate × labels.
        model: the scikit-learn estimator, the torch module (ponder), or None (constant gate).
        constant: P(stop) of a degenerate gate whose fit labels had a single class (else None).
        info: fit diagnostics (label balance, seconds, objective ...).
    """

    def __init__(self, spec: GateSpec, model: Any, constant: float | None = None, info: dict | None = None):
        self.spec, self.model, self.constant, self.info = spec, model, constant, dict(info or {})

    # A ponder gate's torch module is a class built on demand (torch is imported lazily), so it is
    # pickled as its architecture and numpy weights and rebuilt on load.
    def __getstate__(self) -> dict:
        d = self.__dict__.copy()
        if self.spec.labels == "ponder" and self.model is not None:
            m = self.model
            d["model"] = {"n_features": m.n_features, "arch": m.arch, "hidden": m.hidden,
                          "state": {k: v.detach().cpu().numpy().copy() for k, v in m.state_dict().items()}}
        return d

    def __setstate__(self, d: dict) -> None:
        m = d.get("model")
        if d["spec"].labels == "ponder" and isinstance(m, dict):
            import torch

            mod = _ponder_module(m["n_features"], m["arch"], m["hidden"])
            mod.load_state_dict({k: torch.as_tensor(v) for k, v in m["state"].items()})
            d["model"] = mod.eval()
        self.__dict__.update(d)

    def stop_prob(self, X: np.ndarray) -> np.ndarray:
        """P(stop) [token, L] float64 from features X [token, L, F]."""
        n, L, F = X.shape
        if self.constant is not None:
            return np.full((n, L), float(self.constant))
        if self.spec.labels == "ponder":
            import torch

            with torch.no_grad():
                g = self.model(torch.as_tensor(X, dtype=torch.float32)).double()
            return torch.sigmoid(g).numpy()  # λ_t
        proba = self.model.predict_proba(X.reshape(n * L, F))
        col = int(np.flatnonzero(self.model.classes_ == 1)[0])  # class 1 = stop
        return proba[:, col].reshape(n, L)


def _sklearn_estimator(gate: str, cfg: GatesConfig, seed: int, n_rows: int):
    from sklearn.linear_model import LogisticRegression
    from sklearn.neural_network import MLPClassifier

    if gate == "logreg":
        return LogisticRegression(C=cfg.logreg_c, max_iter=cfg.logreg_max_iter)
    return MLPClassifier(hidden_layer_sizes=tuple(cfg.mlp_hidden), alpha=cfg.mlp_alpha,
                         learning_rate_init=cfg.mlp_lr, batch_size=min(cfg.mlp_batch_size, n_rows),
                         max_iter=cfg.mlp_max_iter, random_state=seed, shuffle=True, early_stopping=False)


def fit_sklearn_gate(spec: GateSpec, X: np.ndarray, target: np.ndarray, cfg: GatesConfig, seed: int) -> FittedGate:
    """Fit a scikit-learn gate on stop targets.

    Args:
        spec: the gate (``logreg`` | ``mlp``) and labels.
        X: [token, loop, F] features.
        target: [token, loop] stop targets in [0, 1] (soft for utility), NaN = not a training row.
            Only loops 1..T − 1 are used (the exit at T is forced).
        cfg: the section (classifier settings).
        seed: ``MLPClassifier`` random_state.

    Returns:
        FittedGate (constant when the training labels have one class only).
    """
    from sklearn.exceptions import ConvergenceWarning

    t0 = time.perf_counter()
    F = X.shape[-1]
    Xr = X[:, :-1].reshape(-1, F)
    y = target[:, :-1].reshape(-1)
    ok = np.isfinite(y)
    Xr, y = Xr[ok], y[ok]
    if y.size == 0:
        raise ValueError(f"gate {spec.name}: no training rows (T too small for the '{spec.labels}' labels)")
    soft = spec.labels == "utility"
    if soft:
        # Soft-target cross-entropy as a weighted binary fit: (x, stop) weight y and (x, continue) weight 1 − y.
        Xf = np.concatenate([Xr, Xr])
        yf = np.concatenate([np.ones(y.size, np.int64), np.zeros(y.size, np.int64)])
        wf = np.concatenate([y, 1.0 - y])
        keep = wf > 0
        Xf, yf, wf = Xf[keep], yf[keep], wf[keep]
    else:
        Xf, yf, wf = Xr, (y > 0.5).astype(np.int64), None
    info = {"train_rows": int(y.size), "stop_target_mean": float(y.mean())}
    classes = np.unique(yf)
    if classes.size < 2:
        info.update(degenerate=True, fit_seconds=time.perf_counter() - t0)
        return FittedGate(spec, None, constant=float(classes[0]), info=info)
    est = _sklearn_estimator(spec.gate, cfg, seed, yf.size)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)  # a fixed iteration budget, by design
        est.fit(Xf, yf, sample_weight=wf)
    info.update(degenerate=False, n_iter=int(np.max(est.n_iter_)), fit_seconds=time.perf_counter() - t0)
    return FittedGate(spec, est, info=info)


def fit_gate(spec: GateSpec, X: np.ndarray, loss: np.ndarray, argmax: np.ndarray, cfg: GatesConfig,
             seed: int) -> FittedGate:
    """Fit one gate on fit-split features and frozen per-depth quantities.

    Args:
        spec: gate × labels.
        X: [token, loop, F] features (all T loops).
        loss: [token, loop] ℓ_t = −target_logprob.
        argmax: [token, loop] readout argmax.
        cfg: the section.
        seed: the gate's seed.

    Returns:
        FittedGate.
    """
    if spec.labels == "ponder":
        t0 = time.perf_counter()
        module, info = fit_ponder(X, loss, spec.gate, cfg.ponder, seed)
        info.update(train_rows=int(X.shape[0] * X.shape[1]), degenerate=False, fit_seconds=time.perf_counter() - t0)
        return FittedGate(spec, module, info=info)
    return fit_sklearn_gate(spec, X, stop_targets(spec, loss, argmax, cfg), cfg, seed)


# ----------------------------------------------------------------------------------------------
# Reading the store
# ----------------------------------------------------------------------------------------------


@dataclass
class SplitTargets:
    """Per-(token, loop) quantities of one split that gates are trained or scored on.

    Attributes:
        loss: [token, loop] ℓ_t = −target_logprob (float64, nats).
        argmax: [token, loop] int64.
        correct: [token, loop] bool (argmax_t == y).
    """

    loss: np.ndarray
    argmax: np.ndarray
    correct: np.ndarray

    @property
    def data(self) -> SplitData:
        """For ``pipeline.readouts.evaluate_depths`` (token = store row)."""
        return SplitData(correct=self.correct, loss=self.loss, token=np.arange(self.loss.shape[0], dtype=np.int64))


def read_targets(st) -> SplitTargets:
    """ℓ, argmax and correctness of every token of a store ([token, loop] arrays are small)."""
    lp = st.read("target_logprob").astype(np.float64)
    if not np.isfinite(lp).all():
        raise ValueError(f"store {st.label}: array 'target_logprob' has non-finite values; re-run the dump")
    am = st.read("argmax").astype(np.int64)
    tgt = st.read("target").astype(np.int64)
    return SplitTargets(loss=-lp, argmax=am, correct=am == tgt[:, None])


def check_stats_available(st, stats: Sequence[str]) -> None:
    """Raise a one-line ValueError when a configured statistic cannot be computed from this store."""
    if "gate_logit" in stats and not st.has_gate:
        raise ValueError(f"store {st.label}: gates.stats lists 'gate_logit' but the model has no native gate; "
                         "drop it from gates.stats")


def block_stats(st, tokens: slice, stats: Sequence[str], hidden: np.ndarray | None = None,
                hidden_init: np.ndarray | None = None) -> np.ndarray | None:
    """Raw statistics [token, loop, k] (float32 values as stored / as ``step_metrics`` returns) of one block.

    Store statistics are read as stored; geometry statistics come from
    ``pipeline.geometry.step_metrics(hidden, hidden_init)`` (the geometry stage's function), so they
    equal the ``token_loop.parquet`` columns.
    """
    if not stats:
        return None
    geo = [s for s in stats if s in GEOMETRY_FEATURES]
    metrics = {}
    if geo:
        from .geometry import step_metrics

        if hidden is None:
            hidden = st.read("hidden", tokens)
        if hidden_init is None:
            hidden_init = st.read("hidden_init", tokens)
        metrics = step_metrics(hidden, hidden_init)
        metrics["hidden_change"] = metrics["step_norm"]
    cols = [metrics[s] if s in metrics else st.read(s, tokens) for s in stats]
    return np.stack(cols, axis=-1)


def iter_blocks(st, stats: Sequence[str], block_tokens: int | None = None
                ) -> Iterator[tuple[slice, np.ndarray, np.ndarray | None]]:
    """(token slice, hidden [n, T, D] float32, raw stats [n, T, k] | None) per chunk-aligned block."""
    need_init = any(s in GEOMETRY_FEATURES for s in stats)
    for sl in st.blocks(block_tokens):
        h = st.read("hidden", sl)
        h0 = st.read("hidden_init", sl) if need_init else None
        yield sl, h, block_stats(st, sl, stats, h, h0)


def gather_fit_rows(st, tokens: np.ndarray, stats: Sequence[str], block_tokens: int | None = None
                    ) -> tuple[np.ndarray, np.ndarray | None]:
    """States and statistics of the selected fit tokens, read block by block.

    Args:
        st: the fit-split store.
        tokens: [n] sorted store rows.
        stats: statistic names.
        block_tokens: block size (None = chunk size).

    Returns:
        (hidden [n, T, D] float32, stats [n, T, k] | None), rows in ``tokens`` order.
    """
    hs, ss = [], []
    for sl, h, s in iter_blocks(st, stats, block_tokens):
        sel = tokens[(tokens >= sl.start) & (tokens < sl.stop)] - sl.start
        if sel.size:
            hs.append(h[sel])
            if s is not None:
                ss.append(s[sel])
    return np.concatenate(hs), (np.concatenate(ss) if ss else None)


# ----------------------------------------------------------------------------------------------
# One model: fit, then apply to any compatible model's val/test
# ----------------------------------------------------------------------------------------------


@dataclass
class ModelGates:
    """Everything fitted on one model's fit split.

    Attributes:
        model: model name.
        features: the fitted :class:`FeaturePipeline`.
        gates: spec name -> :class:`FittedGate`.
        n_loops, d_model: trajectory shape (compatibility for transfer).
        fit_tokens: [n] store rows of the fit subsample.
        info: diagnostics for metrics.json.
    """

    model: str
    features: FeaturePipeline
    gates: dict[str, FittedGate]
    n_loops: int
    d_model: int
    fit_tokens: np.ndarray
    info: dict


def fit_model_gates(fit_store, cfg: GatesConfig, specs: Sequence[GateSpec], base_seed: int, model: str,
                    progress: bool = True) -> ModelGates:
    """Fit the feature pipeline and every gate on one model's fit split.

    Args:
        fit_store: the model's fit-split :class:`pipeline.store.TrajectoryStore`.
        cfg: the section.
        specs: the gates to fit.
        base_seed: ``base.seed``.
        model: model name (seeds are derived from it and the gate names).
        progress: progress bar.

    Returns:
        ModelGates.
    """
    from tqdm.auto import tqdm

    st = fit_store
    T, D = st.n_loops, st.d_model
    if T < 2:
        raise ValueError(f"store {st.label}: gates need at least 2 loops, the model has {T}")
    check_stats_available(st, cfg.stats)
    n = st.n_tokens
    rng = np.random.default_rng(derive_seed(base_seed, model, "fit_subsample"))
    m = n if cfg.max_fit_tokens is None else min(n, cfg.max_fit_tokens)
    tokens = np.sort(rng.choice(n, size=m, replace=False)) if m < n else np.arange(n)
    t0 = time.perf_counter()
    h, s = gather_fit_rows(st, tokens, cfg.stats, cfg.block_tokens)
    tgt = read_targets(st)
    loss, argmax = tgt.loss[tokens], tgt.argmax[tokens]
    feats = FeaturePipeline(T, D, cfg.pca_components, cfg.stats, cfg.log_stats, cfg.loop_feature)
    # PCA and scaler see fit rows of loops 1..T − 1 only: the rows the classifiers are trained on.
    feats.fit(h[:, :-1], None if s is None else s[:, :-1], np.arange(T - 1))
    X = feats.transform(h, s)
    info = {"fit_tokens": int(m), "fit_tokens_available": int(n), "n_features": feats.n_features,
            "read_and_features_seconds": time.perf_counter() - t0}
    if feats.pca is not None:
        info["pca_explained_variance"] = float(np.sum(feats.pca.explained_variance_ratio_))
    gates = {}
    for spec in tqdm(specs, desc=f"gates {model}", disable=None if progress else True, leave=False):
        gates[spec.name] = fit_gate(spec, X, loss, argmax, cfg, derive_seed(base_seed, model, spec.name))
    return ModelGates(model=model, features=feats, gates=gates, n_loops=T, d_model=D, fit_tokens=tokens, info=info)


def compatible(fitted: ModelGates, st, stats: Sequence[str]) -> str | None:
    """None when ``fitted``'s gates can run on store ``st``, else the reason."""
    if st.n_loops != fitted.n_loops:
        return f"n_loops {st.n_loops} ≠ {fitted.n_loops}"
    if st.d_model != fitted.d_model:
        return f"d_model {st.d_model} ≠ {fitted.d_model}"
    if "gate_logit" in stats and not st.has_gate:
        return "no native gate_logit"
    return None


def predict_split(st, appliers: Sequence[tuple[ModelGates, Sequence[str]]], cfg: GatesConfig
                  ) -> dict[tuple[str, str], np.ndarray]:
    """P(stop) of several models' gates on one store, streaming its blocks once.

    Args:
        st: the store (val or test split of the eval model).
        appliers: (fitted model gates, gate names to apply) pairs.
        cfg: the section (statistics, block size).

    Returns:
        (fit model, gate name) -> P(stop) [token, loop] float64.
    """
    T = st.n_loops
    out = {(mg.model, g): np.empty((st.n_tokens, T)) for mg, names in appliers for g in names}
    for sl, h, s in iter_blocks(st, cfg.stats, cfg.block_tokens):
        for mg, names in appliers:
            X = mg.features.transform(h, s)
            for g in names:
                out[(mg.model, g)][sl] = mg.gates[g].stop_prob(X)
    return out


def evaluate_gate(rule: str, p_val: np.ndarray, p_test: np.ndarray, val: SplitTargets, test: SplitTargets,
                  cfg: GatesConfig) -> RuleResult:
    """Calibrate a gate on val and score it on test with the readouts operating-point code.

    The grid is ``quantile_grid`` of val P(stop) at loops 1..T − 1 (the loops where the gate can move
    an exit), frozen and applied to both splits with d = min{t : P(stop)_t ≥ γ} (T when never met).

    Args:
        rule: ``gate:<name>``.
        p_val, p_test: [token, loop] P(stop).
        val, test: the splits' targets.
        cfg: grid size and δ.

    Returns:
        RuleResult of kind ``gate``.
    """
    grid = quantile_grid(p_val[:, :-1], cfg.n_quantiles)
    return evaluate_depths(rule, grid, exit_depths(p_val, grid, "ge"), exit_depths(p_test, grid, "ge"),
                           val.data, test.data, cfg.delta, kind="gate")


def acc_at_budget(r: RuleResult, budget: float) -> float:
    """Best test accuracy among a rule's operating points with mean depth ≤ budget (NaN if none)."""
    ok = r.test.mean_depth <= budget + 1e-12
    return float(r.test.accuracy[ok].max()) if ok.any() else math.nan


# ----------------------------------------------------------------------------------------------
# The stage
# ----------------------------------------------------------------------------------------------

CROSS_SCHEMA = {"task": pl.String, "fit_model": pl.String, "eval_model": pl.String, "gate": pl.String,
                "labels": pl.String, "rule": pl.String, "mode": pl.String, "x": pl.Float64, "d_at": pl.Float64,
                "chosen_test_accuracy": pl.Float64, "chosen_test_depth": pl.Float64, "budget": pl.Float64,
                "acc_at_budget": pl.Float64, "full_depth_accuracy": pl.Float64}


def _model_metrics(mg: ModelGates, results: Sequence[RuleResult], val: SplitTargets, test: SplitTargets,
                   cfg: GatesConfig, meta: dict) -> dict:
    x0 = cfg.dx[0]
    rules = {}
    for r in results:
        g = mg.gates[r.rule.removeprefix("gate:")]
        k = r.chosen
        rules[r.rule] = {
            "gate": g.spec.gate, "labels": g.spec.labels, "kind": r.kind, "fit": g.info,
            "d_at": {f"{x:g}": d_at(r.test.mean_depth, r.test.accuracy, x) for x in cfg.dx},
            "chosen": {"threshold": float(r.thresholds[k]), "val_depth": float(r.val.mean_depth[k]),
                       "val_accuracy": float(r.val.accuracy[k]), "test_depth": float(r.test.mean_depth[k]),
                       "test_accuracy": float(r.test.accuracy[k])}}
    reach = [(rules[r.rule]["d_at"][f"{x0:g}"], r.rule) for r in results
             if not math.isnan(rules[r.rule]["d_at"][f"{x0:g}"])]
    best = min(reach) if reach else (math.nan, None)
    return {**meta, "n_loops": mg.n_loops, "d_model": mg.d_model,
            "n_tokens": {"fit_used": mg.info["fit_tokens"], "fit": mg.info["fit_tokens_available"],
                         "val": int(val.loss.shape[0]), "test": int(test.loss.shape[0])},
            "features": {"names": mg.features.feature_names, **{k: v for k, v in mg.info.items()
                                                                 if k.startswith(("n_features", "pca"))}},
            "full_depth_accuracy": {"val": float(val.correct[:, -1].mean()), "test": float(test.correct[:, -1].mean())},
            "best_gate": {"x": x0, "rule": best[1], "d_at": best[0]}, "rules": rules}


def gates_stage(stores: dict[str, dict[str, Any]], cfg: GatesConfig, out_root: Path | str, base_seed: int = 0,
                meta: dict[str, dict] | None = None, tasks: dict[str, str | None] | None = None,
                progress: bool = True, threads: int | None = None) -> dict:
    """The ``gates`` stage over several models: fit, calibrate, report, cross-regime transfer.

    Writes, atomically (a temporary sibling directory replaces ``out_root`` at the end):
    ``<model>/{operating_points,pareto,dx,chosen,chosen_exits}.parquet``, ``<model>/metrics.json``,
    ``<model>/gates.pkl`` (the fitted feature pipeline and gates, for :func:`load_online_gate`),
    ``cross_regime.parquet`` and ``metrics.json``.

    Args:
        stores: model -> split (fit/val/test) -> opened TrajectoryStore.
        cfg: the ``gates`` section.
        out_root: ``artifacts/gates``.
        base_seed: ``base.seed``.
        meta: model -> extra metrics.json entries (task, regime, params, versions ...).
        tasks: model -> task name (models of one task are crossed); None/missing = the model alone.
        progress: progress bars.
        threads: BLAS and torch threads for the duration of the call (None = leave as they are).

    Returns:
        The stage metrics dict (also ``metrics.json``).
    """
    if threads is None:
        return _gates_stage(stores, cfg, out_root, base_seed, meta, tasks, progress)
    import torch
    from threadpoolctl import threadpool_limits

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with threadpool_limits(limits=threads):
            return _gates_stage(stores, cfg, out_root, base_seed, meta, tasks, progress)
    finally:
        torch.set_num_threads(before)


def _gates_stage(stores, cfg, out_root, base_seed, meta, tasks, progress) -> dict:
    t_start = time.perf_counter()
    out_root = Path(out_root)
    meta = meta or {}
    tasks = {m: (tasks or {}).get(m) or f"<{m}>" for m in stores}
    specs, cross = cfg.specs, [s.name for s in cfg.cross_specs]
    for m, sp in stores.items():
        missing = [s for s in SPLITS if s not in sp]
        if missing:
            raise ValueError(f"model {m}: no '{missing[0]}' store; the gates stage needs fit, val and test")
    fitted = {m: fit_model_gates(sp["fit"], cfg, specs, base_seed, m, progress) for m, sp in stores.items()}
    with atomic_dir(out_root) as tmp:
        tmp.chmod(0o755)  # mkdtemp makes 0700; the artifacts are meant to be readable
        cross_rows, skipped, summary = [], [], {}
        for b, sp in stores.items():
            check_stats_available(sp["val"], cfg.stats)
            appliers = [(fitted[b], [s.name for s in specs])]
            for a in stores:
                if a == b or tasks[a] != tasks[b] or not cross:
                    continue
                why = compatible(fitted[a], sp["val"], cfg.stats)
                if why:
                    skipped.append({"fit_model": a, "eval_model": b, "reason": why})
                    continue
                appliers.append((fitted[a], cross))
            val, test = read_targets(sp["val"]), read_targets(sp["test"])
            pv, pt = predict_split(sp["val"], appliers, cfg), predict_split(sp["test"], appliers, cfg)
            own = {s.name: evaluate_gate(s.rule, pv[(b, s.name)], pt[(b, s.name)], val, test, cfg) for s in specs}
            results = list(own.values())
            frames = result_frames(results, cfg.dx)
            metrics = _model_metrics(fitted[b], results, val, test, cfg, meta.get(b, {}))
            write_outputs(tmp / b, frames, metrics)
            (tmp / b).chmod(0o755)
            with open(tmp / b / "gates.pkl", "wb") as fh:
                pickle.dump({"model": b, "features": fitted[b].features, "gates": fitted[b].gates,
                             "stats": tuple(cfg.stats),
                             "hidden_dtype": (sp["test"].attrs.get("dtypes") or {}).get("hidden", "float16")}, fh)
            summary[b] = metrics["best_gate"]
            full = float(test.correct[:, -1].mean())
            for a, names in appliers:
                for g in names:
                    if g not in cross:
                        continue
                    spec = fitted[a.model].gates[g].spec
                    tr = (own[g] if a.model == b else
                          evaluate_gate(spec.rule, pv[(a.model, g)], pt[(a.model, g)], val, test, cfg))
                    for mode, r in (("transfer", tr), ("refit", own[g])):
                        k = r.chosen
                        cross_rows.append({
                            "task": tasks[b], "fit_model": a.model, "eval_model": b, "gate": spec.gate,
                            "labels": spec.labels, "rule": spec.rule, "mode": mode, "x": float(cfg.dx[0]),
                            "d_at": d_at(r.test.mean_depth, r.test.accuracy, cfg.dx[0]),
                            "chosen_test_accuracy": float(r.test.accuracy[k]),
                            "chosen_test_depth": float(r.test.mean_depth[k]), "budget": float(cfg.cross_budget),
                            "acc_at_budget": acc_at_budget(r, cfg.cross_budget), "full_depth_accuracy": full})
        cross_df = pl.DataFrame(cross_rows, schema=CROSS_SCHEMA).sort("task", "rule", "fit_model", "eval_model", "mode")
        cross_df.write_parquet(tmp / "cross_regime.parquet")
        stage = {"models": list(stores), "gates": [s.name for s in specs], "cross_gates": cross,
                 "seed": base_seed, "params": to_dict(cfg), "best_gate": summary, "cross_skipped": skipped,
                 "seconds": time.perf_counter() - t_start}
        (tmp / "metrics.json").write_text(json.dumps(jsonable(stage), indent=2) + "\n")
    return stage


# ----------------------------------------------------------------------------------------------
# Fitted gates online (the latency stage's real early exit)
# ----------------------------------------------------------------------------------------------


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

        from .stats import kl_div

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
            from .geometry import step_metrics

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
