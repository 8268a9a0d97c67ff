"""Gate features per (token, loop) read from a trajectory store: PCA(h_t), statistics, loop encoding."""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from looptrace.config import ConfigError, InputError
from looptrace.gates.config import GEOMETRY_FEATURES, LOG_FLOOR, SIGNED_STATS
from looptrace.io.parallel import DaskRunner, map_chunks
from looptrace.io.tables import SplitArrays
from looptrace.signals.names import add_aliases
from looptrace.signals.steps import step_metrics

if TYPE_CHECKING:
    from sklearn.decomposition import PCA


def transform_stats(stats: np.ndarray, names: Sequence[str], log_stats: bool) -> np.ndarray:
    """Raw statistics [..., k] -> model inputs: log(max(x, 1e-10)) for non-negative ones (float64)."""
    s = np.array(stats, dtype=np.float64, copy=True)
    if log_stats:
        for j, name in enumerate(names):
            if name not in SIGNED_STATS:
                with np.errstate(invalid="ignore"):
                    s[..., j] = np.log(np.maximum(s[..., j], LOG_FLOOR))  # NaN stays NaN
    return s


#: Widest d_model whose PCA takes the full SVD of the fit rows; wider states take the covariance's eigenvectors.
PCA_FULL_MAX_WIDTH = 1024


def pca_solver(d_model: int) -> str:
    """sklearn's PCA solver for states of width ``d_model``: both are exact and deterministic (no random_state).

    "full" (LAPACK SVD of the [rows, d_model] fit matrix) up to :data:`PCA_FULL_MAX_WIDTH`; above it
    "covariance_eigh" (eigenvectors of the d_model × d_model covariance): the fit rows are tokens × loops, far more
    than d_model, so the SVD's O(rows · d_model²) work with a rows × d_model workspace (5 GB at Huginn's
    d_model 5280, 4096 tokens × 31 loops) becomes one Gram product and a d_model² eigensolve. The covariance squares
    the condition number, which is harmless for the leading components a gate reads.
    """
    return "full" if d_model <= PCA_FULL_MAX_WIDTH else "covariance_eigh"


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
            raise ConfigError(f"gates.pca_components = {pca_components} exceeds d_model = {d_model}; "
                             f"set it ≤ {d_model} (or 0 = off)")
        self.n_loops, self.d_model = int(n_loops), int(d_model)
        self.pca_components, self.stats = int(pca_components), tuple(stats)
        self.log_stats, self.loop_feature = bool(log_stats), loop_feature
        self.pca: PCA | None = None
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
        # A NaN/±inf state (a store dumped with dump.allow_nan) would otherwise become 0 or ±1.8e308 below,
        # silently: refuse it with the count (nothing changed silently).
        bad = int(np.count_nonzero(~np.isfinite(H)))
        if bad:
            raise InputError(f"gate features: array 'hidden' has {bad} non-finite value(s) in a block of {n} token(s) "
                             f"× {L} loop(s); gates need finite states — re-dump without dump.allow_nan or drop "
                             "those tokens")
        if self.pca_components:
            if fit:
                from sklearn.decomposition import PCA

                self.pca = PCA(n_components=self.pca_components, svd_solver=pca_solver(D)).fit(H)
            assert self.pca is not None  # fitted by the fit=True call
            H = self.pca.transform(H)
        parts = [H]
        if self.stats:
            assert stats is not None  # the statistics named by gates.stats come with h
            S = transform_stats(stats, self.stats, self.log_stats).reshape(n * L, len(self.stats))
            inf = np.isinf(S).sum(axis=0)  # NaN is "undefined" (t = 1 of kl_prev, …) and allowed; ±inf is not
            if inf.any():
                j = int(np.argmax(inf > 0))
                raise InputError(f"gate features: statistic '{self.stats[j]}' has {int(inf[j])} infinite value(s); "
                                 "drop it from gates.stats or re-dump the store")
            parts.append(S)
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
                raise InputError(f"gates.stats: '{name}' has no finite value on the fit rows (loops "
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
        # Only undefined statistics (t = 1) are NaN here (states and ±inf were refused above) -> the fit mean.
        C = np.where(np.isnan(C), 0.0, C)
        parts = [C]
        if self.loop_feature == "onehot":
            oh = np.zeros((n, L, self.n_loops))
            oh[:, np.arange(L), loops] = 1.0
            parts.append(oh.reshape(n * L, self.n_loops))
        return np.concatenate(parts, axis=1).reshape(n, L, -1)



def read_targets(st) -> SplitArrays:
    """ℓ, argmax and correctness of every token of a store ([token, loop] arrays are small).

    Returns:
        :class:`~looptrace.io.tables.SplitArrays` with ``token`` = the store rows, ``loop`` holding
        ``target_logprob`` (float64; ``.loss`` = ℓ_t), ``argmax`` (int64) and ``correct`` (bool), and ``fields``
        ``target`` and ``sequence`` (the bootstrap's resampling unit).
    """
    lp = st.read("target_logprob").astype(np.float64)
    if not np.isfinite(lp).all():
        raise InputError(f"store {st.label}: array 'target_logprob' has non-finite values; re-run the dump")
    am = st.read("argmax").astype(np.int64)
    tgt = st.read("target").astype(np.int64)
    fields = {"target": tgt}
    if "sequence" in st:
        fields["sequence"] = st.read("sequence").astype(np.int64)  # the bootstrap's resampling unit
    return SplitArrays(token=np.arange(lp.shape[0], dtype=np.int64),
                       loop={"target_logprob": lp, "argmax": am, "correct": am == tgt[:, None]},
                       fields=fields)


def convergence_signal(st, tokens: np.ndarray, name: str, hidden: np.ndarray, argmax: np.ndarray) -> np.ndarray:
    """The convergence signal ``name`` (SPEC §2) of the selected tokens, exactly as the geometry stage computes
    it: ``argmax`` = 1[argmax_t ≠ argmax_T], ``kl_prev`` as stored, step metrics from
    ``looptrace.signals.steps.step_metrics(hidden, hidden_init)``.

    Args:
        st: the store; tokens: [n] store rows; hidden: [n, T, D] their states; argmax: [n, T] their argmax.

    Returns:
        [n, T] float (NaN where undefined).
    """
    if name == "argmax":  # geometry.argmax_differs
        return (argmax != argmax[:, -1:]).astype(np.float32)
    if name in GEOMETRY_FEATURES:
        return add_aliases(step_metrics(hidden, st.read("hidden_init", tokens)))[name]
    return np.asarray(st.read(name, tokens), dtype=np.float32)


def check_stats_available(st, stats: Sequence[str]) -> None:
    """Raise a one-line ValueError when a configured statistic cannot be computed from this store."""
    if "gate_logit" in stats and not st.has_gate:
        raise ConfigError(f"store {st.label}: gates.stats lists 'gate_logit' but the model has no native gate; "
                         "drop it from gates.stats")


def block_stats(st, tokens: slice, stats: Sequence[str], hidden: np.ndarray | None = None,
                hidden_init: np.ndarray | None = None) -> np.ndarray | None:
    """Raw statistics [token, loop, k] (float32 values as stored / as ``step_metrics`` returns) of one block.

    Store statistics are read as stored; geometry statistics come from
    ``looptrace.signals.steps.step_metrics(hidden, hidden_init)`` (the geometry stage's function), so they
    equal the ``token_loop.parquet`` columns.
    """
    if not stats:
        return None
    geo = [s for s in stats if s in GEOMETRY_FEATURES]
    metrics: MutableMapping = {}
    if geo:
        if hidden is None:
            hidden = st.read("hidden", tokens)
        if hidden_init is None:
            hidden_init = st.read("hidden_init", tokens)
        metrics = add_aliases(step_metrics(hidden, hidden_init))
    cols = [metrics[s] if s in metrics else st.read(s, tokens) for s in stats]
    return np.stack(cols, axis=-1)


def read_block(st, tokens: slice, stats: Sequence[str]) -> tuple[np.ndarray, np.ndarray | None]:
    """(hidden [n, T, D] float32, raw stats [n, T, k] | None) of one token slice."""
    need_init = any(s in GEOMETRY_FEATURES for s in stats)
    h = st.read("hidden", tokens)
    h0 = st.read("hidden_init", tokens) if need_init else None
    return h, block_stats(st, tokens, stats, h, h0)


def iter_blocks(st, stats: Sequence[str], block_tokens: int | None = None
                ) -> Iterator[tuple[slice, np.ndarray, np.ndarray | None]]:
    """(token slice, hidden [n, T, D] float32, raw stats [n, T, k] | None) per chunk-aligned block."""
    for sl in st.blocks(block_tokens):
        yield (sl, *read_block(st, sl, stats))


def fit_rows_chunk(st, tokens: slice, selected: np.ndarray, stats: Sequence[str]
                   ) -> tuple[np.ndarray, np.ndarray | None]:
    """The selected fit rows of one block (``selected``: sorted store rows; those inside ``tokens`` are kept).

    One block's work of :func:`gather_fit_rows` (in this process or as a Dask task).
    """
    sel = selected[(selected >= tokens.start) & (selected < tokens.stop)] - tokens.start
    h, s = read_block(st, tokens, stats)
    return h[sel], (None if s is None else s[sel])


def gather_fit_rows(st, tokens: np.ndarray, stats: Sequence[str], block_tokens: int | None = None,
                    runner: DaskRunner | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """States and statistics of the selected fit tokens, read block by block.

    Args:
        st: the fit-split store.
        tokens: [n] sorted store rows.
        stats: statistic names.
        block_tokens: block size (None = chunk size).
        runner: read and select each block holding selected rows as a Dask task
            (:class:`looptrace.io.parallel.DaskRunner`; None = in this process). The rows are concatenated in
            block order either way, so the gathered arrays are the same.

    Returns:
        (hidden [n, T, D] float32, stats [n, T, k] | None), rows in ``tokens`` order.
    """
    tokens = np.asarray(tokens)
    blocks = [sl for sl in st.blocks(block_tokens)
              if np.searchsorted(tokens, sl.start) < np.searchsorted(tokens, sl.stop)]
    hs, ss = [], []
    for h, s in map_chunks(fit_rows_chunk, st, blocks, (tokens, tuple(stats)), runner, ahead=1):  # reads overlap
        hs.append(h)
        if s is not None:
            ss.append(s)
    return np.concatenate(hs), (np.concatenate(ss) if ss else None)
