"""Fitting gates on one model's fit split (scikit-learn classifiers and PonderNet) and applying them."""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from looptrace.config import InputError
from looptrace.gates.config import GatesConfig, GateSpec, derive_seed
from looptrace.gates.features import (
    FeaturePipeline,
    check_stats_available,
    convergence_signal,
    gather_fit_rows,
    read_block,
    read_targets,
)
from looptrace.gates.labels import stop_targets
from looptrace.gates.ponder import _ponder_module, fit_ponder
from looptrace.io.bounds import check_block_tokens
from looptrace.io.parallel import DaskRunner, map_chunks
from looptrace.signals.halting import halting_cdf


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

    def gate_logit(self, X: np.ndarray) -> np.ndarray:
        """A PonderNet gate's logits g_t [token, L] float64 (λ_t = σ(g_t)) from features X [token, L, F]."""
        import torch

        if self.spec.labels != "ponder":
            raise ValueError(f"gate {self.spec.name}: only PonderNet gates have halting logits")
        from looptrace.models.invariant import BatchInvariant

        # row-wise kernels: a token's logit is the same in a whole split's block and in a live batch
        with torch.no_grad(), BatchInvariant():
            return self.model(torch.as_tensor(X, dtype=torch.float32)).double().numpy()

    def stop_prob(self, X: np.ndarray, form: str = "stop") -> np.ndarray:
        """The gate's exit score [token, L] float64 from features X [token, L, F] (all loops 1..L in order).

        ``form`` (:attr:`GateSpec.forms`): ``stop`` P(stop) of a scikit-learn gate; for a PonderNet gate
        ``q_exit`` (also what ``stop`` means for it) the Q-exit CDF 1 − Π_{j≤t}(1 − λ_j) — the native gate's rule,
        by the same function (:func:`looptrace.signals.halting.halting_cdf`) — or ``lambda``, λ_t = σ(g_t).
        """
        n, L, F = X.shape
        if self.constant is not None:
            return np.full((n, L), float(self.constant))
        if self.spec.labels == "ponder":
            g = self.gate_logit(X)
            if form == "lambda":
                # lazy: torch, only for a PonderNet gate's λ (importing looptrace.gates loads no torch)
                import torch

                from looptrace.signals.halting_torch import halting_lambda

                return halting_lambda(torch.as_tensor(g)).numpy()  # λ_t
            return halting_cdf(g)
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
        raise InputError(f"gate {spec.name}: no training rows (T too small for the '{spec.labels}' labels)")
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
             seed: int, conv: np.ndarray | None = None) -> FittedGate:
    """Fit one gate on fit-split features and frozen per-depth quantities.

    Args:
        spec: gate × labels.
        X: [token, loop, F] features (all T loops).
        loss: [token, loop] ℓ_t = −target_logprob.
        argmax: [token, loop] readout argmax.
        cfg: the section.
        seed: the gate's seed.
        conv: [token, loop] the ``converged`` labels' signal (:func:`~looptrace.gates.features.convergence_signal`).

    Returns:
        FittedGate.
    """
    if spec.labels == "ponder":
        t0 = time.perf_counter()
        module, info = fit_ponder(X, loss, spec.gate, cfg.ponder, seed)
        info.update(train_rows=int(X.shape[0] * X.shape[1]), degenerate=False, fit_seconds=time.perf_counter() - t0)
        return FittedGate(spec, module, info=info)
    return fit_sklearn_gate(spec, X, stop_targets(spec, loss, argmax, cfg, conv), cfg, seed)



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
                    progress: bool = True, runner: DaskRunner | None = None) -> ModelGates:
    """Fit the feature pipeline and every gate on one model's fit split.

    Args:
        fit_store: the model's fit-split :class:`looptrace.io.store.reader.TrajectoryStore`.
        cfg: the section.
        specs: the gates to fit.
        base_seed: ``base.seed``.
        model: model name (seeds are derived from it and the gate names).
        progress: progress bar.
        runner: read the fit subsample's blocks as Dask tasks (None = in this process). The subsample is
            seeded and bounded (``max_fit_tokens``), gathered to this process in block order, and the PCA,
            scaler and gates are fit on it here exactly as in-process: the fit is the same either way.

    Returns:
        ModelGates.
    """
    from tqdm.auto import tqdm

    st = fit_store
    T, D = st.n_loops, st.d_model
    if T < 2:
        raise InputError(f"store {st.label}: gates need at least 2 loops, the model has {T}")
    check_stats_available(st, cfg.stats)
    n = st.n_tokens
    rng = np.random.default_rng(derive_seed(base_seed, model, "fit_subsample"))
    m = n if cfg.max_fit_tokens is None else min(n, cfg.max_fit_tokens)
    tokens = np.sort(rng.choice(n, size=m, replace=False)) if m < n else np.arange(n)
    t0 = time.perf_counter()
    check_block_tokens(cfg.block_tokens, st.chunk_tokens, "gates.block_tokens", st.label)
    h, s = gather_fit_rows(st, tokens, cfg.stats, cfg.block_tokens, runner)
    tgt = read_targets(st)
    loss, argmax = tgt.loss[tokens], tgt.loop["argmax"][tokens]
    feats = FeaturePipeline(T, D, cfg.pca_components, cfg.stats, cfg.log_stats, cfg.loop_feature)
    # PCA and scaler see fit rows of loops 1..T − 1 only: the rows the classifiers are trained on.
    feats.fit(h[:, :-1], None if s is None else s[:, :-1], np.arange(T - 1))
    X = feats.transform(h, s)
    info = {"fit_tokens": int(m), "fit_tokens_available": int(n), "n_features": feats.n_features,
            "read_and_features_seconds": time.perf_counter() - t0}
    if feats.pca is not None:
        info["pca_explained_variance"] = float(np.sum(feats.pca.explained_variance_ratio_))
    # [FP] convergence labels: geometry's settled depths of the fit tokens (read only when a gate uses them)
    conv = (convergence_signal(st, tokens, cfg.converged_signal, h, argmax)
            if any(sp.labels == "converged" for sp in specs) else None)
    gates = {}
    for spec in tqdm(specs, desc=f"gates {model}", disable=None if progress else True, leave=False):
        gates[spec.name] = fit_gate(spec, X, loss, argmax, cfg, derive_seed(base_seed, model, spec.name), conv)
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


@contextmanager
def analysis_threads(threads: int | None) -> Iterator[None]:
    """BLAS and torch intra-op threads limited to ``threads`` inside the block (None: left as they are).

    ``base.analysis_threads`` of the gates stage, in the stage's process and, for a Dask task, in the worker
    (the same thread count, so that results do not depend on where a block ran).
    """
    if threads is None:
        yield
        return
    import torch
    from threadpoolctl import threadpool_limits

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with threadpool_limits(limits=threads):
            yield
    finally:
        torch.set_num_threads(before)


def predict_chunk(st, tokens: slice, appliers: Sequence[tuple[ModelGates, Sequence[str]]], stats: Sequence[str],
                  threads: int | None = None) -> dict[tuple[str, str], np.ndarray]:
    """Exit score [n, T] of every (fit model, rule) of ``appliers``' gates on one block (in-process or as a Dask
    task): P(stop), or a PonderNet gate's Q-exit CDF and its λ_t (:attr:`GateSpec.forms`)."""
    with analysis_threads(threads):
        h, s = read_block(st, tokens, stats)
        out = {}
        for mg, names in appliers:
            X = mg.features.transform(h, s)
            for g in names:
                for rule, form in mg.gates[g].spec.forms:
                    out[(mg.model, rule)] = mg.gates[g].stop_prob(X, form)
        return out


def predict_split(st, appliers: Sequence[tuple[ModelGates, Sequence[str]]], cfg: GatesConfig,
                  runner: DaskRunner | None = None, threads: int | None = None) -> dict[tuple[str, str], np.ndarray]:
    """P(stop) of several models' gates on one store, streaming its blocks once.

    Args:
        st: the store (val or test split of the eval model).
        appliers: (fitted model gates, gate names to apply) pairs.
        cfg: the section (statistics, block size).
        runner: score each block as a Dask task (the fitted pipelines are sent once); None = in this process.
        threads: BLAS/torch threads of a Dask task (``base.analysis_threads``; the stage's own process is
            limited by :func:`gates_stage`).

    Returns:
        (fit model, rule name) -> exit score [token, loop] float64 for every rule of each gate
        (:attr:`GateSpec.forms`: P(stop), or a PonderNet gate's Q-exit CDF and its λ_t).
    """
    T = st.n_loops
    out = {(mg.model, rule): np.empty((st.n_tokens, T)) for mg, names in appliers for g in names
           for rule, _ in mg.gates[g].spec.forms}
    blocks = list(st.blocks(cfg.block_tokens))
    args = (tuple(appliers), tuple(cfg.stats), threads if runner is not None else None)
    for sl, probs in zip(blocks, map_chunks(predict_chunk, st, blocks, args, runner), strict=True):
        for key, p in probs.items():
            out[key][sl] = p
    return out
