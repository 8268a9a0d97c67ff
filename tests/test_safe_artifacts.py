"""Artifacts that cannot run code.

Fitted gates round-trip through gates.json + gates.skops + ponder.npz (no pickle) with the same predictions; a
tampered gate artifact (a pickle payload, or a skops file naming a function) is refused before anything in it runs;
a checkpoint is read with ``torch.load(weights_only=True)``, so one holding a pickled callable is refused, not run.
"""

from __future__ import annotations

import os
import pickle
import zipfile
from copy import deepcopy

import numpy as np
import pytest
import torch
from sklearn.linear_model import LogisticRegression
from sklearn.neural_network import MLPClassifier

from looptrace.config import CheckpointLoadError, InputError
from looptrace.gates.artifact import load_fitted, save_fitted
from looptrace.gates.config import GateSpec, PonderConfig
from looptrace.gates.features import FeaturePipeline
from looptrace.gates.fit import FittedGate
from looptrace.gates.ponder import fit_ponder
from looptrace.models.looped import load_checkpoint
from tests.builders import tiny_checkpoint


class _Boom:
    """Unpickling this runs ``open(marker, 'w')``: the test checks the marker never appears."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.fixture
def fitted(tmp_path):
    """One model's fit: PCA + scaler features, a logreg, an MLP, a ponder-linear and a constant gate."""
    rng = np.random.default_rng(0)
    n, T, D = 60, 3, 6
    h = rng.normal(size=(n, T, D)).astype(np.float32)
    stats = rng.normal(size=(n, T, 1))
    feats = FeaturePipeline(T, D, pca_components=2, stats=("entropy",), log_stats=False).fit(h, stats)
    X = feats.transform(h, stats)  # [n, T, F]
    F = X.shape[-1]
    y = (X[..., 0] > 0).astype(int).reshape(-1)
    lr = LogisticRegression().fit(X.reshape(-1, F), y)
    mlp = MLPClassifier((4,), max_iter=5, random_state=0).fit(X.reshape(-1, F), y)
    pond, info = fit_ponder(X, rng.random((n, T)), "linear", PonderConfig(epochs=2), seed=0)
    gates = {"logreg-oracle": FittedGate(GateSpec("logreg", "oracle"), lr, info={"seconds": 0.1}),
             "mlp-oracle": FittedGate(GateSpec("mlp", "oracle"), mlp),
             "ponder-linear": FittedGate(GateSpec("linear", "ponder"), pond, info=info),
             "logreg-utility": FittedGate(GateSpec("logreg", "utility"), None, constant=0.25)}
    d = tmp_path / "gates" / "m"
    d.mkdir(parents=True)
    save_fitted(d, "m", feats, gates, ("entropy",), "float16")
    return d, feats, gates, X, (h, stats)


def test_gates_round_trip_without_pickle(fitted):
    d, feats, gates, X, (h, stats) = fitted
    assert sorted(p.name for p in d.iterdir()) == ["gates.json", "gates.skops", "ponder.npz"]
    fit = load_fitted(d)
    assert fit["model"] == "m" and fit["stats"] == ("entropy",) and fit["hidden_dtype"] == "float16"
    np.testing.assert_array_equal(fit["features"].transform(h, stats), X)
    for name, g in gates.items():
        got = fit["gates"][name]
        assert got.spec == g.spec and got.constant == g.constant
        np.testing.assert_array_equal(got.stop_prob(X), g.stop_prob(X))
    assert fit["gates"]["logreg-utility"].stop_prob(X)[0, 0] == 0.25  # the constant gate, by its constant


def test_equal_fits_give_equal_bytes(fitted, tmp_path):
    # skops names objects by id() and stamps the time of writing; the artifact is canonical, so a copy of the fit
    # (other ids), saved later, is the same bytes.
    d, feats, gates = fitted[:3]
    copy = tmp_path / "copy"
    copy.mkdir()
    save_fitted(copy, "m", deepcopy(feats), deepcopy(gates), ("entropy",), "float16")
    for name in ("gates.json", "gates.skops", "ponder.npz"):
        assert (copy / name).read_bytes() == (d / name).read_bytes(), name
    with zipfile.ZipFile(d / "gates.skops") as z:
        assert {i.date_time for i in z.infolist()} == {(1980, 1, 1, 0, 0, 0)}
        npy = [i.filename for i in z.infolist() if i.filename.endswith(".npy")]
        assert npy and all(int(n[:-4]) <= 10_000 for n in npy)  # renumbered, not memory addresses


def test_tampered_pickle_gate_artifact_is_refused_not_run(fitted, tmp_path):
    d = fitted[0]
    marker = tmp_path / "ran"
    (d / "gates.skops").write_bytes(pickle.dumps(_Boom(str(marker))))
    with pytest.raises(InputError, match=r"gate artifact '.*gates.skops' is not a skops file .*refused rather than "
                                         r"loaded \(it could run code\)"):
        load_fitted(d)
    assert not marker.exists()


def test_skops_file_naming_a_function_is_refused(fitted):
    import skops.io as sio

    d = fitted[0]
    objs = sio.load(d / "gates.skops", trusted=sio.get_untrusted_types(file=d / "gates.skops"))
    objs["pca"] = os.system  # a callable where an estimator should be
    sio.dump(objs, d / "gates.skops")
    with pytest.raises(InputError) as exc:
        load_fitted(d)
    assert "names types outside the trusted list: posix.system" in str(exc.value)


def test_gates_json_of_another_format_is_refused(fitted):
    d = fitted[0]
    (d / "gates.json").write_text('{"format": "other/9"}')
    with pytest.raises(InputError, match="is not a looptrace-gates/1 file"):
        load_fitted(d)


def test_checkpoint_with_a_pickled_callable_is_refused_not_run(tmp_path):
    ckpt = tiny_checkpoint(tmp_path / "train", name="rs-uniform")
    good = torch.load(ckpt, weights_only=True)
    marker = tmp_path / "ran"
    torch.save({**good, "meta": _Boom(str(marker))}, ckpt)
    with pytest.raises(CheckpointLoadError) as exc:
        load_checkpoint(ckpt)
    assert "holds objects other than tensors and plain values (refused: loading it could run code" in str(exc.value)
    assert not marker.exists()
    model, back = load_checkpoint(tiny_checkpoint(tmp_path / "train2", name="rs-uniform"))  # a clean one loads
    assert set(back) == set(good) and model.cfg.to_dict() == good["model_config"]
