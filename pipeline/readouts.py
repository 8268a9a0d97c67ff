"""Exit rules and their calibrated operating points (the ``readouts`` stage, SPEC §4).

An exit rule turns a token's per-loop signal ``[token, loop]`` into an exit depth d ∈ {1..T}
(1-based; T when the threshold is never met). Calibration follows [AD]: the thresholds of a rule
are 51 empirical quantiles (0.5th … 99.5th percentile) of the signal's finite values on the
validation split; that grid is frozen and applied unchanged to the test split. Each threshold is
one operating point (mean exit depth, accuracy, mean loss). The chosen point of a rule is the
lowest-depth threshold whose *validation* accuracy is within δ points of full-depth accuracy.

The operating-point functions (``quantile_grid`` … ``choose_point``, ``evaluate_rule``,
``evaluate_depths``, ``result_frames``) are shared with ``pipeline/gates.py``, so gates and post-hoc
readouts are scored by exactly the same code.

Units: accuracy is a fraction in [0, 1]; ``x`` of D@X and ``delta`` of the chosen point are in
percentage points (X = 95 means accuracy ≥ 0.95; δ = 0.5 means 0.005), as in SPEC §4.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl

from .artifacts import atomic_dir, jsonable

# Comparisons of k/N fractions against x/100: a tiny tolerance so that e.g. 57/100 ≥ 0.57 holds.
_EPS = 1e-12
# Upper bound on the elements of one [K, chunk, T] boolean block in exit_depths (memory guard).
_MAX_BLOCK = 1 << 24


# ----------------------------------------------------------------------------------------------
# Shared operating-point functions (also used by pipeline/gates.py)
# ----------------------------------------------------------------------------------------------


def quantile_grid(values: np.ndarray, n: int = 51) -> np.ndarray:
    """Threshold grid of [AD]: ``n`` evenly spaced empirical percentiles, 0.5th … 99.5th.

    Args:
        values: any-shape array of the signal on the validation split (e.g. [token, loop]); NaN and
            ±inf (undefined loops such as kl_prev at t = 1) are ignored.
        n: number of quantiles (51 in [AD]); n = 1 gives the median.

    Returns:
        np.ndarray [n] float64, non-decreasing (``np.percentile``, linear interpolation).

    Raises:
        ValueError: when ``values`` has no finite entry (the rule cannot be calibrated).
    """
    v = np.asarray(values, dtype=np.float64).ravel()
    v = v[np.isfinite(v)]
    if v.size == 0:
        raise ValueError("quantile_grid: the signal has no finite value on the calibration split")
    if n < 1:
        raise ValueError(f"quantile_grid: n must be ≥ 1, got {n}")
    q = np.linspace(0.5, 99.5, n) if n > 1 else np.array([50.0])
    return np.percentile(v, q)


def exit_depths(signal: np.ndarray, thresholds: np.ndarray, op: str, min_loop: int = 1,
                two_hit: bool = False) -> np.ndarray:
    """Exit depth of every (threshold, token): d = min{t ≥ min_loop : signal_t op threshold}, else T.

    Args:
        signal: [token, loop] float; NaN never satisfies a threshold (undefined loops).
        thresholds: [K] float.
        op: ``"le"`` (exit when signal ≤ threshold: entropy, KL, steps) or ``"ge"`` (exit when
            signal ≥ threshold: max_prob, margin, halting probability).
        min_loop: first loop (1-based) at which the rule may fire: 2 for rules on t − 1 differences
            (kl_prev, rel_step, ...), 3 for accel_two_hit (SPEC §4).
        two_hit: require the condition at t *and* t − 1 ([TS] acceleration exit, a_t ≤ τ and
            a_{t−1} ≤ τ).

    Returns:
        np.ndarray [K, token] int64 of 1-based exit depths; T where the condition is never met.
    """
    sig = np.asarray(signal, dtype=np.float64)
    if sig.ndim != 2:
        raise ValueError(f"exit_depths: signal must be [token, loop], got shape {sig.shape}")
    thr = np.asarray(thresholds, dtype=np.float64).ravel()
    if op not in ("le", "ge"):
        raise ValueError(f"exit_depths: op must be 'le' or 'ge', got {op!r}")
    n_tok, n_loop = sig.shape
    out = np.empty((thr.size, n_tok), dtype=np.int64)
    allowed = np.arange(1, n_loop + 1) >= min_loop  # [loop]
    chunk = max(1, _MAX_BLOCK // max(1, thr.size * n_loop))
    for lo in range(0, n_tok, chunk):
        s = sig[None, lo:lo + chunk, :]  # [1, n, T]
        t = thr[:, None, None]  # [K, 1, 1]
        hit = (s <= t) if op == "le" else (s >= t)  # NaN compares False
        if two_hit:
            prev = np.zeros_like(hit)
            prev[..., 1:] = hit[..., :-1]
            hit &= prev
        hit &= allowed
        first = hit.argmax(axis=-1)  # first True (0 when none)
        out[:, lo:lo + chunk] = np.where(hit.any(axis=-1), first + 1, n_loop)
    return out


def evaluate_points(depths: np.ndarray, correct: np.ndarray, loss: np.ndarray
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mean exit depth, accuracy and mean loss of each operating point.

    Args:
        depths: [K, token] 1-based exit depths.
        correct: [token, loop] bool, argmax_t == y.
        loss: [token, loop] float, ℓ_t = −log p_t(y) (nats).

    Returns:
        (mean_depth [K] in loops, accuracy [K] fraction, mean_loss [K] nats), float64.
    """
    d = np.asarray(depths)
    if d.ndim == 1:
        d = d[None]
    idx = d - 1  # [K, token] 0-based loop
    rows = np.arange(d.shape[1])[None, :]
    corr = np.asarray(correct, dtype=bool)[rows, idx]
    los = np.asarray(loss, dtype=np.float64)[rows, idx]
    return d.mean(axis=1, dtype=np.float64), corr.mean(axis=1, dtype=np.float64), los.mean(axis=1)


def pareto_mask(depth: np.ndarray, acc: np.ndarray) -> np.ndarray:
    """Non-dominated operating points (lower depth and higher accuracy are better).

    Point i is dominated when some j has depth_j ≤ depth_i and acc_j ≥ acc_i with at least one
    strict; exact duplicates do not dominate each other (both stay on the front).

    Args:
        depth: [K] mean exit depths.
        acc: [K] accuracies.

    Returns:
        bool [K]; NaN points are never on the front.
    """
    d = np.asarray(depth, dtype=np.float64).ravel()
    a = np.asarray(acc, dtype=np.float64).ravel()
    ok = np.isfinite(d) & np.isfinite(a)
    dj, aj = d[None, :], a[None, :]
    di, ai = d[:, None], a[:, None]
    dom = (dj <= di) & (aj >= ai) & ((dj < di) | (aj > ai)) & ok[None, :]
    return ok & ~dom.any(axis=1)


def d_at(depth: np.ndarray, acc: np.ndarray, x: float) -> float:
    """D@X: the smallest mean depth among operating points whose accuracy ≥ X % (SPEC §4).

    Args:
        depth: [K] mean exit depths (test split).
        acc: [K] accuracies as fractions (test split).
        x: the accuracy target in percent (95, 98, 99).

    Returns:
        The depth in loops, or NaN when no point reaches X (unreachable — never clipped to T).
    """
    d = np.asarray(depth, dtype=np.float64).ravel()
    a = np.asarray(acc, dtype=np.float64).ravel()
    ok = np.isfinite(d) & (a + _EPS >= x / 100.0)
    return float(d[ok].min()) if ok.any() else math.nan


def choose_point(val_depth: np.ndarray, val_acc: np.ndarray, full_acc: float, delta: float = 0.5) -> int:
    """Index of a rule's chosen operating point, picked on validation only ([AD], SPEC §4).

    The lowest-depth threshold whose validation accuracy is within ``delta`` points of full-depth
    validation accuracy (ties: higher accuracy, then lower index). When no point qualifies, the
    highest-accuracy point (ties: lower depth) — the closest the rule can get.

    Args:
        val_depth: [K] mean exit depth on val.
        val_acc: [K] accuracy on val (fraction).
        full_acc: full-depth (t = T) accuracy on val (fraction).
        delta: tolerance in percentage points (0.5 = half a point).

    Returns:
        int index into the K points.
    """
    d = np.asarray(val_depth, dtype=np.float64).ravel()
    a = np.asarray(val_acc, dtype=np.float64).ravel()
    if d.size == 0:
        raise ValueError("choose_point: no operating points")
    ok = a + _EPS >= full_acc - delta / 100.0
    if ok.any():
        cand = np.flatnonzero(ok)
        order = np.lexsort((cand, -a[cand], d[cand]))  # depth asc, acc desc, index asc
        return int(cand[order[0]])
    idx = np.arange(d.size)
    return int(np.lexsort((idx, d, -a))[0])


@dataclass(frozen=True)
class Points:
    """Operating points of one rule on one split: each array [K]."""

    mean_depth: np.ndarray
    accuracy: np.ndarray
    mean_loss: np.ndarray


@dataclass(frozen=True)
class SplitData:
    """What a rule is scored against on one split.

    Attributes:
        correct: [token, loop] bool, argmax_t == y.
        loss: [token, loop] float, ℓ_t = −target_logprob (nats).
        token: [token] int, the store row ids (written to chosen_exits).
    """

    correct: np.ndarray
    loss: np.ndarray
    token: np.ndarray | None = None

    @property
    def full_accuracy(self) -> float:
        """Accuracy at full depth t = T (fraction)."""
        return float(np.asarray(self.correct, dtype=bool)[:, -1].mean())


@dataclass(frozen=True)
class RuleResult:
    """One rule evaluated end to end: frozen val grid, points on val and test, the chosen point.

    Attributes:
        rule: rule name (``entropy``, ``fixed``, ``gate:<model>-<labels>`` ...).
        thresholds: [K] the frozen grid (for fixed / argmax_stable: the depth / k).
        val, test: operating points on each split.
        chosen: index of the chosen point (picked on val).
        test_exits: [token] exit depths on test at the chosen point.
        test_correct: [token] bool, correctness at those exits.
        test_token: [token] store row ids of the test tokens.
        kind: ``fixed`` | ``posthoc`` | ``native`` | ``oracle`` | ``gate`` (for summaries).
        full_val_accuracy: full-depth val accuracy the choice was measured against.
        delta: the chosen-point tolerance used (points).
    """

    rule: str
    thresholds: np.ndarray
    val: Points
    test: Points
    chosen: int
    test_exits: np.ndarray
    test_correct: np.ndarray
    test_token: np.ndarray
    kind: str = "posthoc"
    full_val_accuracy: float = math.nan
    delta: float = 0.5


def evaluate_depths(rule: str, thresholds: np.ndarray, val_depths: np.ndarray, test_depths: np.ndarray,
                    val: SplitData, test: SplitData, delta: float = 0.5, kind: str = "posthoc") -> RuleResult:
    """Score precomputed exit depths of one rule on val and test and pick its chosen point.

    Args:
        rule: rule name.
        thresholds: [K] threshold of each point (recorded in the outputs).
        val_depths: [K, token_val] 1-based exit depths on val.
        test_depths: [K, token_test] 1-based exit depths on test (same thresholds).
        val, test: correctness / loss of each split.
        delta: chosen-point tolerance in accuracy points.
        kind: rule family label.

    Returns:
        RuleResult.
    """
    vp = Points(*evaluate_points(val_depths, val.correct, val.loss))
    tp = Points(*evaluate_points(test_depths, test.correct, test.loss))
    full = val.full_accuracy
    k = choose_point(vp.mean_depth, vp.accuracy, full, delta)
    exits = np.asarray(test_depths)[k].astype(np.int64)
    corr = np.asarray(test.correct, dtype=bool)[np.arange(exits.size), exits - 1]
    tok = np.arange(exits.size) if test.token is None else np.asarray(test.token)
    return RuleResult(rule=rule, thresholds=np.asarray(thresholds, dtype=np.float64).ravel(), val=vp, test=tp,
                      chosen=k, test_exits=exits, test_correct=corr, test_token=tok, kind=kind,
                      full_val_accuracy=full, delta=delta)


def evaluate_rule(rule: str, val_signal: np.ndarray, test_signal: np.ndarray, val: SplitData, test: SplitData,
                  op: str, min_loop: int = 1, two_hit: bool = False, n_quantiles: int = 51,
                  delta: float = 0.5, kind: str = "posthoc") -> RuleResult:
    """Evaluate one threshold rule end to end ([AD] protocol).

    The grid is ``quantile_grid`` of the val signal (finite values, all loops), frozen and applied
    to both splits; the chosen point is picked on val; test exits are reported at that point.

    Args:
        rule: rule name.
        val_signal: [token_val, loop] signal on val.
        test_signal: [token_test, loop] signal on test.
        val, test: correctness / loss per split.
        op: ``"le"`` or ``"ge"`` (see ``exit_depths``).
        min_loop: first loop the rule may fire at (1, 2 or 3).
        two_hit: condition must hold at t and t − 1 (accel_two_hit).
        n_quantiles: grid size (51).
        delta: chosen-point tolerance in points.
        kind: rule family label.

    Returns:
        RuleResult.
    """
    grid = quantile_grid(val_signal, n_quantiles)
    vd = exit_depths(val_signal, grid, op, min_loop, two_hit)
    td = exit_depths(test_signal, grid, op, min_loop, two_hit)
    return evaluate_depths(rule, grid, vd, td, val, test, delta, kind)


def result_frames(results: Sequence[RuleResult], dx: Sequence[float] = (95, 98, 99)) -> dict[str, pl.DataFrame]:
    """The readouts/gates output tables for a list of evaluated rules (one model).

    Returns:
        dict with polars DataFrames
        ``operating_points`` (rule, kind, threshold, split, mean_depth, accuracy, mean_loss),
        ``pareto`` (the test points on their rule's own front, plus ``on_model_front``: non-dominated
        among all non-oracle points of the model),
        ``dx`` (rule, kind, x, d_at — NaN when unreachable),
        ``chosen`` (rule, kind, threshold, index, val_depth, val_accuracy, test_depth, test_accuracy,
        test_loss, full_val_accuracy, within_delta),
        ``chosen_exits`` (rule, token, exit_depth, correct) on test.
    """
    op_rows, dx_rows, ch_rows, ex = [], [], [], []
    for r in results:
        for split, p in (("val", r.val), ("test", r.test)):
            op_rows.append(pl.DataFrame({
                "rule": [r.rule] * r.thresholds.size, "kind": [r.kind] * r.thresholds.size,
                "threshold": r.thresholds, "split": [split] * r.thresholds.size,
                "mean_depth": p.mean_depth, "accuracy": p.accuracy, "mean_loss": p.mean_loss}))
        for x in dx:
            dx_rows.append({"rule": r.rule, "kind": r.kind, "x": float(x),
                            "d_at": d_at(r.test.mean_depth, r.test.accuracy, x)})
        if r.kind == "oracle":  # a ceiling, not a rule: no chosen point
            continue
        k = r.chosen
        ch_rows.append({"rule": r.rule, "kind": r.kind, "threshold": float(r.thresholds[k]), "index": k,
                        "val_depth": float(r.val.mean_depth[k]), "val_accuracy": float(r.val.accuracy[k]),
                        "test_depth": float(r.test.mean_depth[k]), "test_accuracy": float(r.test.accuracy[k]),
                        "test_loss": float(r.test.mean_loss[k]), "full_val_accuracy": r.full_val_accuracy,
                        "within_delta": bool(r.val.accuracy[k] + _EPS >= r.full_val_accuracy - r.delta / 100.0)})
        ex.append(pl.DataFrame({"rule": [r.rule] * r.test_exits.size, "token": r.test_token.astype(np.int64),
                                "exit_depth": r.test_exits.astype(np.int64), "correct": r.test_correct}))
    op_schema = {"rule": pl.String, "kind": pl.String, "threshold": pl.Float64, "split": pl.String,
                 "mean_depth": pl.Float64, "accuracy": pl.Float64, "mean_loss": pl.Float64}
    ops = pl.concat(op_rows) if op_rows else pl.DataFrame(schema=op_schema)
    test = ops.filter(pl.col("split") == "test")
    depth, acc = test["mean_depth"].to_numpy(), test["accuracy"].to_numpy()
    rules, kinds = test["rule"].to_numpy(), test["kind"].to_numpy()
    own = np.zeros(len(test), dtype=bool)
    for rule in np.unique(rules):
        sel = rules == rule
        own[sel] = pareto_mask(depth[sel], acc[sel])
    model = np.zeros(len(test), dtype=bool)
    sel = kinds != "oracle"
    model[sel] = pareto_mask(depth[sel], acc[sel])
    pareto = test.with_columns(on_model_front=pl.Series(model, dtype=pl.Boolean)).filter(
        pl.Series(own, dtype=pl.Boolean))
    ex_schema = {"rule": pl.String, "token": pl.Int64, "exit_depth": pl.Int64, "correct": pl.Boolean}
    return {
        "operating_points": ops,
        "pareto": pareto,
        "dx": pl.DataFrame(dx_rows, schema={"rule": pl.String, "kind": pl.String, "x": pl.Float64,
                                            "d_at": pl.Float64}),
        "chosen": pl.DataFrame(ch_rows) if ch_rows else pl.DataFrame(),
        "chosen_exits": pl.concat(ex) if ex else pl.DataFrame(schema=ex_schema),
    }


def write_outputs(out_dir: Path | str, frames: dict[str, pl.DataFrame], metrics: dict,
                  extra_text: dict[str, str] | None = None) -> None:
    """Write ``<name>.parquet`` for each frame and ``metrics.json`` atomically into ``out_dir``.

    Everything goes to a temporary sibling directory first, which then replaces ``out_dir``, so an
    interrupted run never leaves a mix of old and new files.

    Args:
        out_dir: the model's (or stage's) output directory.
        frames: file stem -> frame.
        metrics: JSON-able dict (NaN written as null).
        extra_text: file name -> text written beside them (``summary.md``).
    """
    with atomic_dir(out_dir) as tmp:
        for name, df in frames.items():
            df.write_parquet(tmp / f"{name}.parquet")
        for name, text in (extra_text or {}).items():
            (tmp / name).write_text(text)
        (tmp / "metrics.json").write_text(json.dumps(_jsonable(metrics), indent=2, allow_nan=True) + "\n")


# Kept under its old name: gates, latency and report import it from here.
_jsonable = jsonable


# ----------------------------------------------------------------------------------------------
# The readouts stage: every exit rule of SPEC §4 on one model's token_loop.parquet
# ----------------------------------------------------------------------------------------------

#: Threshold rules of SPEC §4: rule -> (token_loop column, op, min_loop, two_hit).
THRESHOLD_RULES: dict[str, tuple[str, str, int, bool]] = {
    "entropy": ("entropy", "le", 1, False),          # [AD]
    "top1": ("max_prob", "ge", 1, False),            # [AD], CALM softmax_max
    "margin": ("margin", "ge", 1, False),            # [AD] logit gap
    "kl_prev": ("kl_prev", "le", 2, False),          # [AD] KL(p_t ‖ p_{t−1})
    "kl_prev_rev": ("kl_prev_rev", "le", 2, False),  # Huginn KL(p_{t−1} ‖ p_t)
    "logit_change": ("logit_change", "le", 2, False),
    "hidden_change": ("hidden_change", "le", 2, False),
    "rel_step": ("rel_step", "le", 2, False),        # Huginn latent-diff
    "state_cosine": ("state_cos_dist", "le", 2, False),  # Huginn cosine, CALM state
    "accel_two_hit": ("accel", "le", 3, True),       # [TS]: a_t ≤ τ and a_{t−1} ≤ τ
}
#: Confidence readouts of [AD] (claim (a) of the diagnosis).
CONFIDENCE_RULES = ("entropy", "top1", "margin")
#: Every rule the stage knows, in output order (``oracle`` is a ceiling, not a rule).
ALL_RULES = ("fixed", *THRESHOLD_RULES, "argmax_stable", "q_exit", "oracle")
#: Per-token columns read from token_loop.parquet besides the signals.
TOKEN_COLUMNS = ("token", "difficulty", "token_type", "target")
#: Per-(token, loop) columns read from token_loop.parquet.
LOOP_COLUMNS = ("loop", "argmax", "correct", "target_logprob", "gate_logit",
                *sorted({c for c, *_ in THRESHOLD_RULES.values()}))


@dataclass(frozen=True)
class ReadoutsConfig:
    """``readouts`` section of ``params.yaml``.

    Attributes:
        n_quantiles: size of the validation quantile grid (51 in [AD]: 0.5th … 99.5th percentile).
        delta: chosen-point tolerance, accuracy points below full-depth val accuracy ([AD]: 0.5).
        argmax_stable_k: the k values of ``argmax_stable`` (each is one operating point).
        dx: accuracy targets X (percent) of D@X.
        rules: the rules to evaluate (subset of ``ALL_RULES``; ``q_exit`` is skipped for models
            without a native gate).
    """

    n_quantiles: int = 51
    delta: float = 0.5
    argmax_stable_k: tuple[int, ...] = (2, 3)
    dx: tuple[float, ...] = (95.0, 98.0, 99.0)
    rules: tuple[str, ...] = ALL_RULES

    def __post_init__(self) -> None:
        from .config import ConfigError

        if self.n_quantiles < 1:
            raise ConfigError(f"readouts.n_quantiles must be ≥ 1, got {self.n_quantiles}")
        if not 0.0 <= self.delta <= 100.0:
            raise ConfigError(f"readouts.delta must be in [0, 100] accuracy points, got {self.delta}")
        if not self.argmax_stable_k or min(self.argmax_stable_k) < 1:
            raise ConfigError(f"readouts.argmax_stable_k must be a non-empty list of k ≥ 1, got "
                              f"{list(self.argmax_stable_k)}")
        bad = [x for x in self.dx if not 0.0 < x <= 100.0]
        if bad:
            raise ConfigError(f"readouts.dx values are accuracy percentages in (0, 100], got {bad[0]}")
        unknown = [r for r in self.rules if r not in ALL_RULES]
        if unknown:
            raise ConfigError(f"readouts.rules: unknown rule '{unknown[0]}'; allowed: {', '.join(ALL_RULES)}")


@dataclass(frozen=True)
class SplitFrame:
    """One split of ``token_loop.parquet`` as [token] and [token, loop] arrays (tokens sorted by id).

    Attributes:
        token, difficulty, token_type, target: [token] int64.
        loop: dict column -> [token, loop] array (``correct`` bool, ``argmax`` int64, signals float64;
            ``gate_logit`` only when the model has a gate).
    """

    token: np.ndarray
    difficulty: np.ndarray
    token_type: np.ndarray
    target: np.ndarray
    loop: dict[str, np.ndarray]

    @property
    def n_loops(self) -> int:
        """T."""
        return self.loop["correct"].shape[1]

    @property
    def data(self) -> SplitData:
        """Correctness and per-depth loss ℓ_t = −target_logprob for scoring rules."""
        return SplitData(correct=self.loop["correct"], loss=-self.loop["target_logprob"], token=self.token)

    @property
    def has_gate(self) -> bool:
        """True when ``gate_logit`` is present (a natively gated model)."""
        return "gate_logit" in self.loop


def load_token_loop(path: Path | str, splits: Sequence[str] = ("val", "test"),
                    columns: Sequence[str] = LOOP_COLUMNS) -> dict[str, SplitFrame]:
    """Read splits of ``artifacts/geometry/<model>/token_loop.parquet`` into per-token arrays.

    Args:
        path: the parquet file (DESIGN.md: Geometry columns).
        splits: split names to read.
        columns: per-(token, loop) columns wanted (``loop`` and ``correct`` are always read).

    Returns:
        split -> SplitFrame. ``gate_logit`` is dropped when it is all null (model without a gate).

    Raises:
        FileNotFoundError: the file is missing (names the stage to run).
        ValueError: a column or split is missing, or a token does not have exactly loops 1..T.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; run the geometry stage first (dvc repro geometry)")
    schema = pl.read_parquet_schema(path)
    want = list(dict.fromkeys(["split", *TOKEN_COLUMNS, "loop", "correct", *columns]))
    missing = [c for c in want if c not in schema]
    if missing:
        raise ValueError(f"{path}: column '{missing[0]}' is missing; re-run the geometry stage "
                         f"(DESIGN.md lists the token_loop columns)")
    df = (pl.scan_parquet(path).filter(pl.col("split").is_in(list(splits))).select(want)
          .sort("split", "token", "loop").collect())
    out: dict[str, SplitFrame] = {}
    for split in splits:
        sub = df.filter(pl.col("split") == split)
        if sub.height == 0:
            raise ValueError(f"{path}: no rows for split '{split}'; the geometry stage must cover it "
                             f"(geometry.splits in params.yaml)")
        loops = sub["loop"].to_numpy()
        T = int(loops.max())
        n = sub.height // T
        if sub.height % T or not np.array_equal(loops.reshape(n, T), np.broadcast_to(np.arange(1, T + 1), (n, T))):
            raise ValueError(f"{path}: split '{split}' does not have exactly loops 1..{T} for every token; "
                             f"re-run the geometry stage")
        tok = sub["token"].to_numpy().reshape(n, T)
        if not (tok == tok[:, :1]).all() or np.unique(tok[:, 0]).size != n:
            raise ValueError(f"{path}: split '{split}' has inconsistent token ids; re-run the geometry stage")
        per_loop: dict[str, np.ndarray] = {}
        for c in dict.fromkeys(["correct", *columns]):
            if c == "loop":
                continue
            col = sub[c]
            if c == "gate_logit" and col.null_count() == col.len():
                continue  # no native gate
            if c == "correct":
                per_loop[c] = col.to_numpy().astype(bool).reshape(n, T)
            elif c == "argmax":
                per_loop[c] = col.to_numpy().astype(np.int64).reshape(n, T)
            else:
                per_loop[c] = col.cast(pl.Float64).fill_null(np.nan).to_numpy().reshape(n, T)
        if "target_logprob" in per_loop and not np.isfinite(per_loop["target_logprob"]).all():
            raise ValueError(f"{path}: split '{split}' has non-finite target_logprob; re-run dump/geometry")
        first = {c: sub[c].to_numpy().reshape(n, T)[:, 0].astype(np.int64) for c in TOKEN_COLUMNS}
        out[split] = SplitFrame(token=first["token"], difficulty=first["difficulty"],
                                token_type=first["token_type"], target=first["target"], loop=per_loop)
    Ts = {s: f.n_loops for s, f in out.items()}
    if len(set(Ts.values())) > 1:
        raise ValueError(f"{path}: splits have different numbers of loops {Ts}; re-run the geometry stage")
    return out


def oracle_depths(correct: np.ndarray) -> np.ndarray:
    """Oracle earliest-correct depth ([AD] ceiling): min{t : argmax_t = y}, else T.

    Args:
        correct: [token, loop] bool.

    Returns:
        [token] int64, 1-based.
    """
    c = np.asarray(correct, dtype=bool)
    return np.where(c.any(axis=1), c.argmax(axis=1) + 1, c.shape[1]).astype(np.int64)


def argmax_stable_depths(argmax: np.ndarray, ks: Sequence[int]) -> np.ndarray:
    """``argmax_stable k``: min{t ≥ k : argmax_t = argmax_{t−1} = … = argmax_{t−k+1}}, else T.

    Convention (Huginn's argmax-stability counts consecutive loops with the same argmax): the last k
    loops, t included, share one argmax, so the earliest possible exit is t = k; k = 1 exits at 1.

    Args:
        argmax: [token, loop] int.
        ks: the k values.

    Returns:
        [len(ks), token] int64 1-based exit depths.
    """
    a = np.asarray(argmax)
    n, T = a.shape
    same = np.zeros((n, T), dtype=bool)
    same[:, 1:] = a[:, 1:] == a[:, :-1]  # same[t] : argmax_t == argmax_{t-1}
    # run[t] = number of consecutive loops ending at t that share argmax_t.
    run = np.ones((n, T), dtype=np.int64)
    for t in range(1, T):
        run[:, t] = np.where(same[:, t], run[:, t - 1] + 1, 1)
    out = np.empty((len(ks), n), dtype=np.int64)
    for i, k in enumerate(ks):
        hit = run >= k
        out[i] = np.where(hit.any(axis=1), hit.argmax(axis=1) + 1, T)
    return out


def halting_cdf(gate_logit: np.ndarray) -> np.ndarray:
    """Native Q-exit signal (Ouro): 1 − Π_{j≤t}(1 − σ(gate_j)), per token and loop.

    Computed in log space: log(1 − σ(g)) = −softplus(g), so large gate logits do not round to 1 − 1.

    Args:
        gate_logit: [token, loop] float.

    Returns:
        [token, loop] float64 cumulative halting probability, non-decreasing in t.
    """
    g = np.asarray(gate_logit, dtype=np.float64)
    log_not = -np.logaddexp(0.0, g)  # log(1 − σ(g))
    return -np.expm1(np.cumsum(log_not, axis=1))


def _grid_window(signal: np.ndarray, min_loop: int, two_hit: bool) -> np.ndarray:
    """The loops a rule reads (t ≥ min_loop, and t − 1 for two-hit rules): the calibration values."""
    return signal[:, max(0, min_loop - 1 - int(two_hit)):]


def evaluate_model_rules(val: SplitFrame, test: SplitFrame, cfg: ReadoutsConfig,
                         progress: bool = True) -> list[RuleResult]:
    """Every configured exit rule of SPEC §4 on one model (grid on val, frozen, applied to test).

    Threshold rules calibrate on the finite val values of the loops they can read (t ≥ min_loop; for
    accel_two_hit also t − 1), so that e.g. hidden_change at t = 1 (where the rule may not fire) does
    not shift its grid. ``fixed`` has thresholds 1..T, ``argmax_stable`` the k values, ``oracle`` a
    single NaN threshold (kind ``oracle``).

    Args:
        val, test: the model's splits (same T).
        cfg: the ``readouts`` section.
        progress: show a progress bar.

    Returns:
        list of RuleResult in ``ALL_RULES`` order (``q_exit`` only when the model has a gate).
    """
    from tqdm.auto import tqdm

    T = val.n_loops
    vdat, tdat = val.data, test.data
    nv, nt = val.token.size, test.token.size
    results: list[RuleResult] = []
    for rule in tqdm(cfg.rules, desc="readouts", disable=None if progress else True, leave=False):
        if rule == "fixed":
            k = np.arange(1, T + 1)
            results.append(evaluate_depths(rule, k, np.repeat(k[:, None], nv, 1), np.repeat(k[:, None], nt, 1),
                                           vdat, tdat, cfg.delta, kind="fixed"))
        elif rule in THRESHOLD_RULES:
            col, op, min_loop, two_hit = THRESHOLD_RULES[rule]
            vs, ts = val.loop[col], test.loop[col]
            grid = quantile_grid(_grid_window(vs, min_loop, two_hit), cfg.n_quantiles)
            results.append(evaluate_depths(rule, grid, exit_depths(vs, grid, op, min_loop, two_hit),
                                           exit_depths(ts, grid, op, min_loop, two_hit), vdat, tdat, cfg.delta))
        elif rule == "argmax_stable":
            ks = list(cfg.argmax_stable_k)
            results.append(evaluate_depths(rule, np.array(ks, dtype=np.float64),
                                           argmax_stable_depths(val.loop["argmax"], ks),
                                           argmax_stable_depths(test.loop["argmax"], ks), vdat, tdat, cfg.delta))
        elif rule == "q_exit":
            if not (val.has_gate and test.has_gate):
                continue
            vs, ts = halting_cdf(val.loop["gate_logit"]), halting_cdf(test.loop["gate_logit"])
            results.append(evaluate_rule(rule, vs, ts, vdat, tdat, "ge", n_quantiles=cfg.n_quantiles,
                                         delta=cfg.delta, kind="native"))
        elif rule == "oracle":
            results.append(evaluate_depths(rule, np.array([np.nan]), oracle_depths(vdat.correct)[None],
                                           oracle_depths(tdat.correct)[None], vdat, tdat, cfg.delta, kind="oracle"))
    return results


def readouts_metrics(results: Sequence[RuleResult], frames: dict[str, pl.DataFrame], val: SplitFrame,
                     test: SplitFrame, cfg: ReadoutsConfig, meta: dict) -> dict:
    """``metrics.json``: full-depth and oracle accuracy, and per rule its chosen point and D@X."""
    dx = frames["dx"]
    rules = {}
    for r in results:
        entry = {"kind": r.kind,
                 "d_at": {str(int(x) if float(x).is_integer() else x): d_at(r.test.mean_depth, r.test.accuracy, x)
                          for x in cfg.dx}}
        if r.kind != "oracle":
            k = r.chosen
            entry["chosen"] = {"threshold": float(r.thresholds[k]), "val_depth": float(r.val.mean_depth[k]),
                               "val_accuracy": float(r.val.accuracy[k]), "test_depth": float(r.test.mean_depth[k]),
                               "test_accuracy": float(r.test.accuracy[k])}
        else:
            entry["test_depth"] = float(r.test.mean_depth[0])
            entry["test_accuracy"] = float(r.test.accuracy[0])
        rules[r.rule] = entry
    x0 = cfg.dx[0]
    posthoc = dx.filter((pl.col("kind") == "posthoc") & (pl.col("x") == float(x0)) & pl.col("d_at").is_not_nan())
    best = posthoc.sort("d_at", "rule").row(0, named=True) if posthoc.height else None
    return {**meta, "n_loops": val.n_loops, "has_gate": val.has_gate,
            "n_tokens": {"val": int(val.token.size), "test": int(test.token.size)},
            "full_depth_accuracy": {"val": val.data.full_accuracy, "test": test.data.full_accuracy},
            "test_accuracy_per_loop": test.loop["correct"].mean(axis=0).tolist(),
            "best_posthoc": {"x": x0, "rule": best["rule"] if best else None,
                             "d_at": best["d_at"] if best else math.nan},
            "rules": rules}


def readouts_model(geometry_dir: Path | str, cfg: ReadoutsConfig, out_dir: Path | str, meta: dict | None = None,
                   progress: bool = True) -> dict:
    """The ``readouts`` stage for one model: read token_loop.parquet, evaluate every rule, write outputs.

    Args:
        geometry_dir: ``artifacts/geometry/<model>``.
        cfg: the ``readouts`` section.
        out_dir: ``artifacts/readouts/<model>``.
        meta: extra ``metrics.json`` entries (model, task, regime, regime_kind, versions, params).
        progress: progress bars.

    Returns:
        The metrics dict (also written to ``metrics.json``).
    """
    splits = load_token_loop(Path(geometry_dir) / "token_loop.parquet")
    val, test = splits["val"], splits["test"]
    results = evaluate_model_rules(val, test, cfg, progress)
    frames = result_frames(results, cfg.dx)
    metrics = readouts_metrics(results, frames, val, test, cfg, meta or {})
    write_outputs(out_dir, frames, metrics)
    return metrics


def light_versions() -> dict:
    """The keys of ``pipeline.train.versions()`` read from package metadata, plus scipy.

    Importing torch, scikit-learn and zarr only to read their version strings costs ~5 s per process
    on this machine — more than the whole readouts computation — so the offline stages read the
    installed distributions' metadata instead (same values for installed packages).
    """
    import platform
    from importlib.metadata import PackageNotFoundError, version

    from . import __version__

    def v(dist: str) -> str | None:
        try:
            return version(dist)
        except PackageNotFoundError:
            return None

    return {"looptrace": __version__, "torch": v("torch"), "numpy": np.__version__, "zarr": v("zarr"),
            "polars": pl.__version__, "sklearn": v("scikit-learn"), "scipy": v("scipy"),
            "python": platform.python_version()}


def resolve_model(model: str, task_defs: dict, regime_defs: dict) -> dict:
    """Task, regime and regime definition of a ``<task>-<regime>`` model name (SPEC §10).

    Args:
        model: the model name.
        task_defs: ``train.task_defs`` (name -> TaskConfig or its params mapping).
        regime_defs: ``train.regime_defs`` (name -> RegimeConfig or its params mapping).

    Returns:
        dict with ``model``, ``task``, ``regime``, ``regime_kind`` and ``regime_def`` (all None except
        ``model`` when the name is not a known task × regime, e.g. an adapter's run name).
    """
    from .config import to_dict

    for t in task_defs:
        for r, rdef in regime_defs.items():
            if model == f"{t}-{r}":
                d = to_dict(rdef)
                return {"model": model, "task": t, "regime": r, "regime_kind": d.get("kind"), "regime_def": d}
    return {"model": model, "task": None, "regime": None, "regime_kind": None, "regime_def": None}
