"""The ``loopmap`` section (:class:`LoopmapConfig`: the stage's sample, the loop-map measures, the interventions
and the diagnoses' thresholds and bootstrap) and one intervention (:class:`InterventionConfig`); torch-free."""

from __future__ import annotations

from dataclasses import dataclass, field

from looptrace.config import OMIT_DEFAULT, ConfigError
from looptrace.tasks import SPLITS

#: Intervention kinds.
INTERVENTION_KINDS = ("noise", "patch")


@dataclass(frozen=True)
class InterventionConfig:
    """One intervention.

    Attributes:
        loop: k, the loop whose output is perturbed (0 = h_0, the state entering loop 1; at most T − 1).
        kind: ``noise`` or ``patch``.
        scale: relative size s of the noise (``noise``); 0 changes nothing.
        threshold: the state effect below which the perturbation counts as gone (the window).
        seed: seed of the noise / the patching permutation.
    """

    loop: int = 1
    kind: str = "noise"
    scale: float = 0.1
    threshold: float = 0.1
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in INTERVENTION_KINDS:
            raise ConfigError(f"intervention.kind must be one of {', '.join(INTERVENTION_KINDS)}, got {self.kind!r}")
        if self.loop < 0:
            raise ConfigError(f"intervention.loop must be >= 0, got {self.loop}")
        if self.scale < 0:
            raise ConfigError(f"intervention.scale must be >= 0, got {self.scale}")


@dataclass(frozen=True)
class LoopmapConfig:
    """``loopmap`` section of params.yaml (SPEC §2b; docs/loopmap.md).

    Attributes:
        split: the split the fixed sample is drawn from (the checkpoint's data seed for it).
        sequences: sequences in the sample (the first ones of the split): the stage's cost is linear in it.
        batch_size: sequences per forward / JVP batch (bounds memory; the outputs do not depend on it: every
            random draw is per sequence and a patch donor is drawn over the whole sample).
        power_iters: power-method iterations for ρ_t per loop (warm-started from the previous loop's vector), for a
            model wider than ``exact_width``.
        position_chunk: one-position tangents (one-hot cotangents) per vmapped JVP (VJP).
        exact_width: the widest d_model whose Jacobian blocks are read whole: exact ρ_t and its upper bound, the
            *certified* fixed-point exit; a wider model gets the power-method estimate and the *estimated* exit
            (SPEC §2b).
        loops: intervention loops k (0 = perturb h_0); those ≥ T of a model are skipped (and listed in metrics).
        scales: relative noise scales s of the noise interventions (‖δ_i‖ = s·‖h_k[i]‖).
        patch: also patch each token's state with another sequence's at the same position and loop.
        window_threshold: the state effect (and its linearised prediction) below which a perturbation is gone.
        kl_threshold: the readout KL (nats) below which it is gone.
        flip_threshold: the share of flipped argmaxes below which it is gone.
        eps: thresholds ε of the certified exit, also those of the post-hoc ``rel_step`` rule.
        entropy_quantiles: thresholds of the post-hoc ``entropy`` rule: this many quantiles of the sample's entropy.
        delta: |median final FTLE| below this (interval included) reads as marginal.
        n_boot: bootstrap resamples over sequences (regime, AUC, flip share; 0 = no intervals).
        level: interval coverage (also of the central interval over tokens).
        min_class: fewest failures (and non-failures) on the sample for a failure AUC (else NaN; one failure
            gives a falsely narrow interval).
        dpi: figure resolution (figures are ≤ 1400 px wide at any dpi).
        trace: cross-loop causal tracing on the sample (SPEC §2b "causal tracing across loops"): per sequence one
            answer-changing token substitution (the task's), the clean run's state patched into the corrupted run
            at every (loop, position), and, on a model with a native gate, exit-gate patching. Off: no
            ``trace.parquet`` / ``gate_patch.parquet`` rows (the answer-flip table is computed either way).
        gate_q: the Q-exit threshold q at which a ``joint`` (Ouro / PonderNet) gate's exit depth is read in
            exit-gate patching and the answer-flip table (0.5: the halting distribution's median); the other
            gated regimes exit at their heads' own thresholds (SPEC §4).
    """

    split: str = "test"
    sequences: int = 128
    batch_size: int = 64
    power_iters: int = 2
    position_chunk: int = 16
    exact_width: int = 256
    loops: tuple[int, ...] = (1, 3)
    scales: tuple[float, ...] = (0.01, 0.1)
    patch: bool = True
    window_threshold: float = 0.1
    kl_threshold: float = 0.01
    flip_threshold: float = 0.01
    eps: tuple[float, ...] = (0.3, 0.1, 0.03, 0.01, 0.003, 0.001)
    entropy_quantiles: int = 9
    delta: float = 0.02
    n_boot: int = 200
    level: float = 0.95
    min_class: int = 5
    dpi: int = 100
    # added after the stage's first outputs: left out of metrics.json while at their defaults (same bytes)
    trace: bool = field(default=True, metadata=OMIT_DEFAULT)
    gate_q: float = field(default=0.5, metadata=OMIT_DEFAULT)

    def __post_init__(self) -> None:
        if self.split not in SPLITS:
            raise ConfigError(f"loopmap.split must be one of {', '.join(SPLITS)}, got {self.split!r}")
        for key in ("sequences", "batch_size", "power_iters", "position_chunk", "exact_width", "min_class", "dpi"):
            if getattr(self, key) < 1:
                raise ConfigError(f"loopmap.{key} must be >= 1, got {getattr(self, key)}")
        if self.patch and self.sequences < 2:
            raise ConfigError("loopmap.patch needs sequences >= 2 (a token is patched with another sequence's); "
                              "set patch: false or raise it")
        if any(k < 0 for k in self.loops):
            raise ConfigError(f"loopmap.loops must be >= 0, got {list(self.loops)}")
        if any(not s >= 0 for s in self.scales):
            raise ConfigError(f"loopmap.scales must be >= 0, got {list(self.scales)}")
        for key in ("window_threshold", "kl_threshold", "flip_threshold"):
            if not getattr(self, key) >= 0:
                raise ConfigError(f"loopmap.{key} must be >= 0, got {getattr(self, key)}")
        if self.entropy_quantiles < 1:
            raise ConfigError(f"loopmap.entropy_quantiles must be >= 1, got {self.entropy_quantiles}")
        if not 0 < self.level < 1:
            raise ConfigError(f"loopmap.level must be in (0, 1), got {self.level}")
        if self.n_boot < 0:
            raise ConfigError(f"loopmap.n_boot must be >= 0, got {self.n_boot}")
        if not self.eps or any(not e > 0 for e in self.eps):
            raise ConfigError(f"loopmap.eps: give thresholds > 0, got {list(self.eps)}")
        if self.delta < 0:
            raise ConfigError(f"loopmap.delta must be >= 0, got {self.delta}")
        if not 0 < self.gate_q < 1:
            raise ConfigError(f"loopmap.gate_q must be in (0, 1), got {self.gate_q}")

    def interventions(self, n_loops: int, seed: int) -> list[InterventionConfig]:
        """The interventions run on a model with T = ``n_loops`` (loops k ≥ T skipped), in table order."""
        out = []
        for k in self.loops:
            if k >= n_loops:
                continue
            out += [InterventionConfig(loop=k, kind="noise", scale=float(s), threshold=self.window_threshold,
                                       seed=seed) for s in self.scales]
            if self.patch:
                out.append(InterventionConfig(loop=k, kind="patch", scale=float("nan"),
                                              threshold=self.window_threshold, seed=seed))
        return out
