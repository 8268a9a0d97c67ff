"""The gate artifact: one model's fitted gates on disk, in files that load without executing code.

Fitted gates travel between people through DVC remotes, so loading them must not run whatever a file holds (a
pickle does). The gates stage saves one model's fit as three files:

- ``gates.json``: format version, model, statistics, hidden dtype, the feature pipeline's settings and each gate's
  spec, kind (``sklearn`` | ``ponder`` | ``constant``), constant P(stop) and fit diagnostics;
- ``gates.skops``: the scikit-learn objects (PCA, StandardScaler, each LogisticRegression / MLPClassifier) in the
  skops format (a zip of JSON schemas and numpy arrays), rebuilt only when every type it names is one skops trusts
  by default or one of :data:`TRUSTED_TYPES`: a tampered file naming any other type (``builtins.eval``, a pickled
  object) is refused before anything is built. Its object ids and entry timestamps are canonical
  (:func:`_canonical_skops`), so the same fit gives the same bytes;
- ``ponder.npz``: the PonderNet gates' state dicts as plain float arrays (read with ``allow_pickle=False``).
"""

from __future__ import annotations

import io
import json
import re
import zipfile
from pathlib import Path
from typing import Any, cast

import numpy as np

from looptrace.config import InputError, MissingInputError
from looptrace.gates.config import GateSpec
from looptrace.gates.features import FeaturePipeline
from looptrace.gates.fit import FittedGate
from looptrace.gates.ponder import _ponder_module
from looptrace.io.artifacts import jsonable

#: Version of the gate artifact (``gates.json`` ``format``).
GATES_FORMAT = "looptrace-gates/1"
#: Types ``gates.skops`` may hold beyond skops' own default-trusted ones: what fitted PCA / StandardScaler /
#: LogisticRegression / MLPClassifier objects are made of (the MLP's optimiser state; the estimators themselves
#: for skops versions that do not trust them by default).
TRUSTED_TYPES = (
    "sklearn.decomposition._pca.PCA",
    "sklearn.preprocessing._data.StandardScaler",
    "sklearn.linear_model._logistic.LogisticRegression",
    "sklearn.neural_network._multilayer_perceptron.MLPClassifier",
    "sklearn.neural_network._stochastic_optimizers.AdamOptimizer",
    "sklearn.neural_network._stochastic_optimizers.SGDOptimizer",
    "sklearn.preprocessing._label.LabelBinarizer",
)
FILES = ("gates.json", "gates.skops", "ponder.npz")


def save_fitted(gates_dir: Path | str, model: str, features, gates: dict, stats, hidden_dtype: str) -> None:
    """Write one model's fit as ``gates.json`` + ``gates.skops`` + ``ponder.npz`` in ``gates_dir``.

    Args:
        gates_dir: the model's output directory of the gates stage.
        model: model name.
        features: the fitted :class:`~looptrace.gates.features.FeaturePipeline`.
        gates: gate name -> :class:`~looptrace.gates.fit.FittedGate`.
        stats: the statistic names the features read.
        hidden_dtype: the store's ``hidden`` dtype the gates were fit on.
    """
    # lazy: skops and torch: only when a fit is saved or loaded (importing gates loads neither)
    import skops.io as sio

    d = Path(gates_dir)
    objs: dict[str, Any] = {"pca": features.pca, "scaler": features.scaler}
    arrays: dict[str, np.ndarray] = {}
    meta = {}
    for name, g in gates.items():
        entry = {"gate": g.spec.gate, "labels": g.spec.labels, "constant": g.constant, "info": g.info}
        if g.constant is not None:
            entry["kind"] = "constant"
        elif g.spec.labels == "ponder":
            m = g.model
            entry.update(kind="ponder", n_features=int(m.n_features), arch=m.arch, hidden=int(m.hidden))
            for k, v in m.state_dict().items():
                arrays[f"{name}/{k}"] = v.detach().cpu().numpy()
        else:
            entry["kind"] = "sklearn"
            objs[f"gate:{name}"] = g.model
        meta[name] = entry
    doc = {"format": GATES_FORMAT, "model": model, "stats": list(stats), "hidden_dtype": str(hidden_dtype),
           "features": {"n_loops": features.n_loops, "d_model": features.d_model,
                        "pca_components": features.pca_components, "stats": list(features.stats),
                        "log_stats": features.log_stats, "loop_feature": features.loop_feature},
           "gates": meta}
    (d / "gates.json").write_text(json.dumps(jsonable(doc), indent=2) + "\n")
    (d / "gates.skops").write_bytes(_canonical_skops(sio.dumps(objs)))
    np.savez(d / "ponder.npz", **cast(dict[str, Any], arrays))  # keys "<gate>/<param>", never allow_pickle


def _canonical_skops(data: bytes) -> bytes:
    """The skops archive ``data`` made a function of its content alone.

    skops names each object by its ``id()`` (the ``__id__`` fields of ``schema.json`` and the ``<id>.npy`` entry
    names) and stamps each zip entry with the time of writing, so two dumps of equal objects differ. Here every id is
    renumbered 1, 2, ... in order of first appearance in the schema (references keep pointing at the same object)
    and every entry gets the timestamp 1980-01-01; the archive loads to the same objects.
    """
    with zipfile.ZipFile(io.BytesIO(data)) as src:
        entries = [(info, src.read(info)) for info in src.infolist()]
    schema = next(b for i, b in entries if i.filename == "schema.json").decode()
    order: dict[str, str] = {}
    for m in _ID.finditer(schema):
        order.setdefault(m.group(1) or m.group(2), str(len(order) + 1))
    schema = _ID.sub(lambda m: (f'"__id__": {order[m.group(1)]}' if m.group(1) else f'"{order[m.group(2)]}.npy"'),
                     schema)
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as dst:
        for info, body in entries:
            name = info.filename
            if name == "schema.json":
                body = schema.encode()
            elif name.endswith(".npy") and name[:-4] in order:
                name = f"{order[name[:-4]]}.npy"
            fixed = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
            fixed.compress_type, fixed.external_attr = info.compress_type, info.external_attr
            dst.writestr(fixed, body)
    return out.getvalue()


#: An object id in a skops schema: an ``"__id__": <id>`` field or a ``"<id>.npy"`` file reference.
_ID = re.compile(r'"__id__": (\d+)|"(\d+)\.npy"')


def _refuse(path: Path, why: str) -> InputError:
    return InputError(f"gate artifact '{path}' {why}; refused rather than loaded (it could run code): rebuild it "
                      "with `dvc repro gates` (looptrace gates)")


def _first(exc: BaseException) -> str:
    msg = str(exc).strip()
    return (msg.splitlines()[0] if msg else type(exc).__name__)[:100]


def load_fitted(gates_dir: Path | str) -> dict:
    """One model's fit from ``gates_dir``: features, gates, stats, hidden dtype (the dict
    :class:`~looptrace.online.live_gate.OnlineGate` takes). Nothing in the files is executed.

    Raises:
        MissingInputError: a file is missing (names the stage to run).
        InputError: a file is damaged, of another format, or names a type that is not trusted.
    """
    # lazy: skops and torch: only when a fit is saved or loaded (importing gates loads neither)
    import skops.io as sio
    import torch

    d = Path(gates_dir)
    for f in FILES:
        if not (d / f).is_file():
            raise MissingInputError(f"{d / f} not found; run the gates stage (`dvc repro gates`)")
    try:
        doc = json.loads((d / "gates.json").read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise _refuse(d / "gates.json", f"is not valid JSON ({_first(exc)})") from None
    if not isinstance(doc, dict) or doc.get("format") != GATES_FORMAT:
        raise _refuse(d / "gates.json", f"is not a {GATES_FORMAT} file")
    path = d / "gates.skops"
    try:
        untrusted = sio.get_untrusted_types(file=path)
    except Exception as exc:  # noqa: BLE001 - not a skops archive (e.g. a pickle): nothing was built from it
        raise _refuse(path, f"is not a skops file ({type(exc).__name__}: {_first(exc)})") from None
    foreign = [t for t in untrusted if t not in TRUSTED_TYPES]
    if foreign:
        raise _refuse(path, f"names types outside the trusted list: {', '.join(foreign[:3])}")
    try:
        objs = sio.load(path, trusted=list(untrusted))
        with np.load(d / "ponder.npz", allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except Exception as exc:  # noqa: BLE001 - a damaged archive; every type in it was already checked
        raise _refuse(path, f"cannot be read ({type(exc).__name__}: {_first(exc)})") from None
    try:
        f = doc["features"]
        feats = FeaturePipeline(f["n_loops"], f["d_model"], f["pca_components"], f["stats"], f["log_stats"],
                                f["loop_feature"])
        feats.pca, feats.scaler = objs["pca"], objs["scaler"]
        gates = {}
        for name, e in doc["gates"].items():
            spec = GateSpec(e["gate"], e["labels"])
            if e["kind"] == "constant":
                model = None
            elif e["kind"] == "ponder":
                mod = _ponder_module(int(e["n_features"]), e["arch"], int(e["hidden"]))
                prefix = f"{name}/"
                mod.load_state_dict({k[len(prefix):]: torch.as_tensor(v) for k, v in arrays.items()
                                     if k.startswith(prefix)})
                model = mod.eval()
            else:
                model = objs[f"gate:{name}"]
            gates[name] = FittedGate(spec, model, constant=e["constant"], info=e.get("info"))
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise _refuse(d / "gates.json", f"does not match gates.skops / ponder.npz ({type(exc).__name__}: "
                      f"{_first(exc)})") from None
    return {"model": doc.get("model"), "features": feats, "gates": gates, "stats": tuple(doc["stats"]),
            "hidden_dtype": doc.get("hidden_dtype") or "float16"}
