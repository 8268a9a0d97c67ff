"""[FP]'s convergence labels of the refit gates (``gates`` label scheme ``converged``, SPEC §6): by hand, and equal to
the settled depths the geometry stage writes to convergence.parquet for the same tokens."""

from __future__ import annotations

import math

import numpy as np
import polars as pl
import pytest

from looptrace.config import ConfigError, from_dict
from looptrace.gates.config import GatesConfig, GateSpec
from looptrace.gates.features import convergence_signal
from looptrace.gates.fit import fit_model_gates
from looptrace.gates.labels import converged_stop, stop_targets
from looptrace.geometry.stage import GeometryConfig, geometry_model
from tests.builders import two_group_stores

NAN = math.nan


def test_converged_labels_by_hand():
    # ε = 1e-3; settled = first loop from which the signal stays below ε through T
    sig = np.array([[NAN, 5e-4, 2e-3, 1e-4],   # dips below, goes back above at 3 -> settled 4
                    [NAN, 1e-4, 1e-4, 1e-4],   # below from 2 (NaN at 1 is never below) -> settled 2
                    [0.5, 0.4, 0.3, 0.2],      # never below: censored (T + 1) -> never stop
                    [1e-5, 1e-5, 1e-5, 1e-5]])  # below everywhere -> settled 1
    want = [[False, False, False, True],
            [False, True, True, True],
            [False, False, False, False],
            [True, True, True, True]]
    assert converged_stop(sig, 1e-3).tolist() == want
    cfg = GatesConfig(converged_signal="kl_prev", converged_eps=1e-3)
    st = stop_targets(GateSpec("logreg", "converged"), np.zeros((4, 4)), np.zeros((4, 4), int), cfg, sig)
    assert st.tolist() == np.asarray(want, dtype=float).tolist()
    with pytest.raises(ValueError, match="convergence signal"):
        stop_targets(GateSpec("logreg", "converged"), np.zeros((4, 4)), np.zeros((4, 4), int), cfg)


@pytest.mark.parametrize("signal,eps", [("kl_prev", 1e-3), ("rel_step", 0.3), ("argmax", 0.5)])
def test_converged_labels_equal_geometry_settled_depths(tmp_path, signal, eps):
    stores = two_group_stores(tmp_path / "dump", T=4)
    st = stores["fit"]
    geometry_model({"fit": st}, GeometryConfig(splits=("fit",), eps={signal: (eps,)}), tmp_path / "geo",
                   progress=False)
    conv = (pl.read_parquet(tmp_path / "geo" / "convergence.parquet")
            .filter((pl.col("split") == "fit") & (pl.col("signal") == signal) & (pl.col("kind") == "settled"))
            .sort("token"))
    settled = conv["depth"].to_numpy()
    tokens = np.arange(0, st.n_tokens, 3)  # a subsample, as the gates' fit subsample is
    h, am = st.read("hidden", tokens), st.read("argmax", tokens).astype(np.int64)
    cfg = GatesConfig(converged_signal=signal, converged_eps=eps)
    lab = stop_targets(GateSpec("logreg", "converged"), np.zeros(am.shape), am, cfg,
                       convergence_signal(st, tokens, signal, h, am))
    want = np.arange(1, 5)[None, :] >= settled[tokens][:, None]
    assert np.array_equal(lab.astype(bool), want)
    assert 0 < want.mean() < 1  # both classes occur, so the comparison is not vacuous


def test_converged_gate_fits_on_the_labels(tmp_path):
    stores = two_group_stores(tmp_path / "dump", T=4)
    cfg = from_dict(GatesConfig, {"gates": ["logreg-converged"], "cross_gates": [], "pca_components": 4,
                                  "stats": ["entropy"], "max_fit_tokens": None, "converged_signal": "argmax",
                                  "converged_eps": 0.5}, "gates")
    mg = fit_model_gates(stores["fit"], cfg, cfg.specs, 0, "m", progress=False)
    st = stores["fit"]
    am = st.read("argmax").astype(np.int64)
    want = converged_stop((am != am[:, -1:]).astype(np.float32), 0.5)[:, :-1].mean()
    assert mg.gates["logreg-converged"].info["stop_target_mean"] == pytest.approx(want)


def test_converged_config_errors():
    with pytest.raises(ConfigError, match="converged_signal must be one of"):
        GatesConfig(converged_signal="entropy")
    with pytest.raises(ConfigError, match="converged_eps must be > 0"):
        GatesConfig(converged_eps=0.0)
    assert GateSpec.parse("mlp-converged") == GateSpec("mlp", "converged")
