"""The ``gates`` params section: which gates × labels, features, classifier and PonderNet settings."""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import numpy as np

from looptrace.config import ConfigError
from looptrace.signals import names as signal_names

SPLITS = ("fit", "val", "test")
#: Label schemes of SPEC §6.
LABELS = ("ponder", "utility", "oracle", "consistent", "converged")
#: Signals of the ``converged`` labels: geometry's convergence signals (SPEC §2; ``argmax`` = argmax_t ≠ argmax_T).
CONVERGED_SIGNALS = signal_names.CONVERGENCE_SIGNALS
#: scikit-learn classifiers for the utility / oracle / consistent / converged labels.
CLASSIFIERS = ("logreg", "mlp")
#: torch gate architectures for the PonderNet objective.
PONDER_ARCHS = ("linear", "mlp")
#: Statistics read from the store (SPEC §3) that a gate may use at loop t.
STORE_FEATURES = signal_names.STORED_FEATURES
#: Step geometry (SPEC §2) from ``looptrace.signals.steps.step_metrics``; ``hidden_change`` = step_norm.
GEOMETRY_FEATURES = signal_names.STATE_FEATURES
FEATURE_STATS = STORE_FEATURES + GEOMETRY_FEATURES
#: Statistics a gate must not see, and why.
FORBIDDEN_STATS = signal_names.NOT_FEATURES
#: Statistics that can be negative (entered as is, not logged).
SIGNED_STATS = signal_names.SIGNED
LOOP_FEATURES = ("onehot", "scalar", "none")
UTILITY_ALIGN = ("ouro", "next")
#: Floor of the log transform of non-negative statistics (exact zeros, e.g. entropy 0 in float32).
LOG_FLOOR = 1e-10
#: Floor of q inside log q of KL(q ‖ π) (as ``looptrace.models.regimes.regime_loss``).
Q_FLOOR = 1e-12
#: Suffix of a PonderNet gate's second rule, the per-loop λ_t ≥ γ exit (:attr:`GateSpec.forms`).
LAMBDA_SUFFIX = "-lambda"


def gate_rule_form(rule: str) -> tuple[str, str]:
    """(gate name, exit form) of a gates rule name: ``gate:ponder-linear`` -> (``ponder-linear``, ``q_exit``),
    ``gate:ponder-linear-lambda`` -> (``ponder-linear``, ``lambda``), ``gate:logreg-oracle`` -> (``logreg-oracle``,
    ``stop``)."""
    name = str(rule).removeprefix("gate:")
    if name.startswith("ponder-"):
        if name.endswith(LAMBDA_SUFFIX):
            return name[: -len(LAMBDA_SUFFIX)], "lambda"
        return name, "q_exit"
    return name, "stop"


# ----------------------------------------------------------------------------------------------
# Configuration
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GateSpec:
    """One gate × label combination.

    Attributes:
        gate: ``logreg`` | ``mlp`` (scikit-learn, labels utility/oracle/consistent) or ``linear`` |
            ``mlp`` (torch, labels ponder).
        labels: ``ponder`` | ``utility`` | ``oracle`` | ``consistent`` | ``converged``.
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

    @property
    def forms(self) -> tuple[tuple[str, str], ...]:
        """(rule name, exit form) of every rule this gate is scored as.

        A scikit-learn gate: ``stop`` (d = min{t : P(stop)_t ≥ γ}). A PonderNet gate: ``q_exit`` first — the
        native gate's rule, d = min{t : 1 − Π_{j≤t}(1 − λ_j) ≥ q} (Ouro's Q-exit CDF,
        :func:`looptrace.signals.halting.halting_cdf`, the one implementation both use), rule ``gate:ponder-<arch>``
        — then ``lambda``, the per-loop d = min{t : λ_t ≥ γ}, rule ``gate:ponder-<arch>-lambda``.
        """
        if self.labels == "ponder":
            return ((self.rule, "q_exit"), (f"{self.rule}{LAMBDA_SUFFIX}", "lambda"))
        return ((self.rule, "stop"),)

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
        converged_signal, converged_eps: signal and ε of the ``converged`` labels ([FP]: stop_t = 1[t ≥ the
            token's settled convergence depth], SPEC §2); one of geometry.eps's pairs, so the labels are the
            settled depths geometry reports.
        logreg_c, logreg_max_iter: ``LogisticRegression`` C and max_iter.
        mlp_hidden, mlp_alpha, mlp_lr, mlp_batch_size, mlp_max_iter: ``MLPClassifier`` settings
            (a fixed budget of epochs; no early stopping).
        ponder: the PonderNet gate (:class:`PonderConfig`).
        cross_gates: gates evaluated across the models of a task (must be in ``gates``); [] = none.
        cross_budget: depth budget (loops) of ``acc_at_budget`` in cross_regime.parquet.
        block_tokens: tokens per block read from a store (null = the store's chunk size).
    """

    gates: tuple[str, ...] = ("logreg-oracle", "logreg-consistent", "logreg-utility", "mlp-oracle",
                              "mlp-consistent", "ponder-linear", "ponder-mlp", "logreg-converged")
    pca_components: int = 16
    stats: tuple[str, ...] = ("entropy", "max_prob", "margin", "kl_prev", "rel_step")
    log_stats: bool = True
    loop_feature: str = "onehot"
    max_fit_tokens: int | None = 4096
    oracle_delta: float = 0.01
    utility_k: float = 50.0
    utility_gamma: float = 0.005
    utility_align: str = "ouro"
    converged_signal: str = "kl_prev"
    converged_eps: float = 0.001
    logreg_c: float = 1.0
    logreg_max_iter: int = 500
    mlp_hidden: tuple[int, ...] = (32,)
    mlp_alpha: float = 1e-4
    mlp_lr: float = 2e-3
    mlp_batch_size: int = 512
    mlp_max_iter: int = 20
    ponder: PonderConfig = field(default_factory=PonderConfig)
    cross_gates: tuple[str, ...] = ("logreg-oracle", "ponder-linear")
    cross_budget: float = 2.0
    block_tokens: int | None = None

    def __post_init__(self) -> None:
        if not self.gates:
            raise ConfigError("gates.gates must list at least one gate (e.g. logreg-oracle)")
        specs = [GateSpec.parse(g) for g in self.gates]
        if len({s.name for s in specs}) != len(specs):
            raise ConfigError(f"gates.gates lists a gate twice: {list(self.gates)}")
        names = {s.name for s in specs}
        for g in self.cross_gates:
            spec = GateSpec.parse(g, "gates.cross_gates")
            if spec.name not in names:
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
        if self.converged_signal not in CONVERGED_SIGNALS:
            raise ConfigError(f"gates.converged_signal must be one of {', '.join(CONVERGED_SIGNALS)}, "
                              f"got {self.converged_signal!r}")
        if not self.converged_eps > 0:
            raise ConfigError(f"gates.converged_eps must be > 0, got {self.converged_eps}")
        if self.max_fit_tokens is not None and self.max_fit_tokens < 1:
            raise ConfigError(f"gates.max_fit_tokens must be ≥ 1 or null, got {self.max_fit_tokens}")
        if self.oracle_delta < 0:
            raise ConfigError(f"gates.oracle_delta must be ≥ 0 nats, got {self.oracle_delta}")
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
