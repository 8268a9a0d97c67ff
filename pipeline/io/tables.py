"""Reading ``token_loop.parquet`` (the geometry stage's per-(token, loop) table) into arrays.

The offline rule stages (readouts, diagnose) score rules on [token] and [token, loop] numpy arrays;
this module is the one place that turns the Parquet table into them and checks its shape.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl


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



#: Per-token columns read from token_loop.parquet besides the signals.
TOKEN_COLUMNS = ("token", "difficulty", "token_type", "target")


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
                    columns: Sequence[str] = ("argmax", "target_logprob")) -> dict[str, SplitFrame]:
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
