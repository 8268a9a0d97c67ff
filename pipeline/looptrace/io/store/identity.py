"""The split stores of one model belong together: :func:`check_same_model`, :func:`check_store_model` and
:func:`open_split_stores` refuse stores that are not one dump of the model a stage combines them with."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from looptrace.io.store.location import StoreTarget, join_store
from looptrace.io.store.reader import TrajectoryStore, open_store
from looptrace.io.store.schema import StoreError

#: What must agree between the split stores of one model before a stage combines them: (label, getter).
IDENTITY_FIELDS: tuple[tuple[str, Any], ...] = (
    ("model name", lambda a: (a.get("model") or {}).get("name")),
    ("checkpoint hash", lambda a: (a.get("model") or {}).get("checkpoint_hash")),
    ("model config", lambda a: (a.get("model") or {}).get("config")),
    ("code hash", lambda a: a.get("code_hash")),
    ("dump params", lambda a: {k: v for k, v in (a.get("params") or {}).items() if k != "sequences"}),
    ("task", lambda a: a.get("task")),
    ("regime", lambda a: a.get("regime")),
    ("loops", lambda a: a.get("n_loops")),
    ("d_model", lambda a: a.get("d_model")),
    ("vocab size", lambda a: a.get("vocab_size")),
)


def check_same_model(stores: Mapping[str, TrajectoryStore]) -> None:
    """Refuse split stores that do not come from one dump of one model (before combining them).

    Compares model name, checkpoint hash, model config, code hash, dump params (all but ``sequences``), task,
    regime, loop count, d_model and vocabulary size of every store with the first one's.

    Raises:
        StoreError: one line naming both stores, the field and both values.
    """
    items = list(stores.items())
    if len(items) < 2:
        return
    (split0, ref), rest = items[0], items[1:]
    for split, st in rest:
        for what, get in IDENTITY_FIELDS:
            a, b = get(ref.attrs), get(st.attrs)
            if a != b:
                def short(v: Any) -> str:
                    text = str(v)
                    return text if len(text) <= 40 else text[:37] + "..."

                name_a = (ref.attrs.get("model") or {}).get("name")
                name_b = (st.attrs.get("model") or {}).get("name")
                raise StoreError(f"stores {ref.label} ({split0}, model {name_a}) and {st.label} ({split}, model "
                                 f"{name_b}) differ in {what} ({short(a)} vs {short(b)}): they are not one dump of "
                                 f"one model; re-run `looptrace dump` for this model")


def check_store_model(store: TrajectoryStore, name: str, checkpoint_hash: str | None = None,
                      checkpoint: str | None = None) -> None:
    """Refuse a store that is not ``name``'s dump (another model's store copied under this name), or — when
    ``checkpoint_hash`` is given — not a dump of the checkpoint a stage is about to combine it with.

    Args:
        store: an open store.
        name: the model the caller looks for (``<model>`` of ``<root>/<model>/<split>.zarr``).
        checkpoint_hash: sha256 of the checkpoint the caller loaded (None: not checked).
        checkpoint: the checkpoint's path or id, named in the error.

    Raises:
        StoreError: one line naming the store, both models (or both hashes) and the fix.
    """
    model = store.attrs.get("model") or {}
    if model.get("name") not in (None, name):
        raise StoreError(f"store {store.label} is a dump of model '{model.get('name')}', not '{name}' (another "
                         f"model's store under this name?); re-run `looptrace dump` for model '{name}'")
    have = model.get("checkpoint_hash")
    if checkpoint_hash is not None and have and have != checkpoint_hash:
        raise StoreError(f"store {store.label} was dumped from checkpoint {have[:12]}, not {checkpoint or 'the one'} "
                         f"loaded now ({checkpoint_hash[:12]}): the model was retrained or replaced since the dump; "
                         f"re-run `looptrace dump` for model '{name}' (dvc repro)")


def open_split_stores(root: StoreTarget, model: str, splits: Sequence[str], **open_kwargs: Any
                      ) -> dict[str, TrajectoryStore]:
    """``{split: open_store(<root>/<model>/<split>.zarr)}`` for a model, checked to belong together.

    Args:
        root: the dump root (a path or URL, e.g. ``artifacts/dump`` or ``s3://bucket/dump``).
        model: the model's name (a sub-directory of ``root``).
        splits: the splits to open, in order.
        open_kwargs: passed to :func:`open_store` (``allow_nan``, ``verify``...).

    Raises:
        StoreError: a store is missing/invalid, is another model's (:func:`check_store_model`), or the stores
            differ in identity (:func:`check_same_model`).
    """
    stores = {s: open_store(join_store(root, model, f"{s}.zarr"), **open_kwargs) for s in splits}
    for st in stores.values():
        check_store_model(st, model)
    check_same_model(stores)
    return stores
