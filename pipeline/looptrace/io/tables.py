"""Reading ``token_loop.parquet`` (the geometry stage's per-(token, loop) table) into arrays.

The offline rule stages (readouts, diagnose, gates) score rules on [token] and [token, loop] numpy arrays
held in :class:`SplitArrays`, the one container of a split's (or a block's) per-token arrays; this module
is the one place that turns the Parquet table into them and checks its shape.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import polars as pl

from looptrace.config import InputError, MissingInputError
from looptrace.io.parquet import verify_parquet
from looptrace.signals import names as signal_names


@dataclass(frozen=True)
class SplitArrays:
    """The arrays of one split's tokens, or of a block of them: one row per scored token.

    The readouts, diagnose and gates stages score rules on it, and the geometry stage streams a store as
    blocks of it.

    Attributes:
        token: [token] int64 store row ids (written to chosen_exits); None = 0..n − 1.
        loop: per-(token, loop) name -> [token, loop] array: ``correct`` bool (argmax_t == y), ``argmax``
            int64, ``target_logprob`` and the signals (float; ``gate_logit`` only for a natively gated model).
        fields: per-token name -> [token] int64 (``target``, ``difficulty``, ``token_type``, ``sequence``,
            ``position``: whichever the reader loaded).
    """

    token: np.ndarray | None
    loop: dict[str, np.ndarray]
    fields: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def n(self) -> int:
        """Number of tokens."""
        return next(iter(self.loop.values())).shape[0]

    @property
    def n_loops(self) -> int:
        """T."""
        return self.loop["correct"].shape[1]

    @property
    def correct(self) -> np.ndarray:
        """[token, loop] bool, argmax_t == y."""
        return self.loop["correct"]

    @property
    def loss(self) -> np.ndarray:
        """[token, loop] ℓ_t = −target_logprob (nats)."""
        return -self.loop["target_logprob"]

    @property
    def full_accuracy(self) -> float:
        """Accuracy at full depth t = T (fraction)."""
        return float(np.asarray(self.correct, dtype=bool)[:, -1].mean())

    @property
    def has_gate(self) -> bool:
        """True when ``gate_logit`` is present (a natively gated model)."""
        return "gate_logit" in self.loop


#: Per-token columns read from token_loop.parquet besides the signals.
TOKEN_COLUMNS = ("token", "difficulty", "token_type", "target")
#: Per-token columns read when present: ``sequence`` is the bootstrap's resampling unit (tokens of one sequence
#: share a prefix; :mod:`looptrace.intervals`); a table without it resamples tokens.
OPTIONAL_TOKEN_COLUMNS = ("sequence",)


def load_token_loop(path: Path | str, splits: Sequence[str] = ("val", "test"),
                    columns: Sequence[str] = ("argmax", "target_logprob")) -> dict[str, SplitArrays]:
    """Read splits of ``artifacts/geometry/<model>/token_loop.parquet`` into per-token arrays.

    Args:
        path: the parquet file (DESIGN.md: Geometry columns).
        splits: split names to read.
        columns: per-(token, loop) columns wanted (``loop`` and ``correct`` are always read).

    Returns:
        split -> :class:`SplitArrays` (tokens sorted by id; fields difficulty, token_type, target, and
        sequence when the table has it). ``gate_logit`` is dropped when it is all null (model without a gate).

    Raises:
        FileNotFoundError: the file is missing (names the stage to run).
        ValueError: a column or split is missing, or a token does not have exactly loops 1..T.
    """
    path = Path(path)
    if not path.is_file():
        raise MissingInputError(f"{path} not found; run the geometry stage first (dvc repro geometry)")
    try:
        schema = pl.read_parquet_schema(path)
    except (OSError, pl.exceptions.PolarsError) as exc:
        raise InputError(f"{path} is truncated or not a Parquet file ({_first(exc)}); re-run the geometry stage "
                         "(`dvc repro geometry`) to rebuild it") from None
    extra = [c for c in OPTIONAL_TOKEN_COLUMNS if c in schema]
    want = list(dict.fromkeys(["split", *TOKEN_COLUMNS, *extra, "loop", "correct", *columns]))
    missing = [c for c in want if c not in schema]
    opt_in = [c for c in missing if c in signal_names.OPT_IN]
    if opt_in:  # an opt-in array (SPEC §2b) the dump did not store
        raise InputError(f"{path}: column '{opt_in[0]}' is missing: it is stored only with "
                         f"{signal_names.OPT_IN[opt_in[0]]} set (e.g. `dump.contraction: {{power_iters: 2}}`); "
                         "set it and re-run dump and geometry, or drop the rule that reads it")
    if missing:
        raise InputError(f"{path}: column '{missing[0]}' is missing; re-run the geometry stage "
                         f"(DESIGN.md lists the token_loop columns)")
    verify_parquet(path, want)  # its manifest's digest, or its page checksums
    try:
        df = (pl.scan_parquet(path).filter(pl.col("split").is_in(list(splits))).select(want)
              .sort("split", "token", "loop").collect())
    except (OSError, pl.exceptions.PolarsError) as exc:
        raise InputError(f"{path} cannot be read ({_first(exc)}); re-run the geometry stage (`dvc repro geometry`) "
                         "to rebuild it") from None
    out: dict[str, SplitArrays] = {}
    for split in splits:
        sub = df.filter(pl.col("split") == split)
        if sub.height == 0:
            raise InputError(f"{path}: no rows for split '{split}'; the geometry stage must cover it "
                             f"(geometry.splits in params.yaml)")
        loops = sub["loop"].to_numpy()
        T = int(loops.max())
        n = sub.height // T
        if sub.height % T or not np.array_equal(loops.reshape(n, T), np.broadcast_to(np.arange(1, T + 1), (n, T))):
            raise InputError(f"{path}: split '{split}' does not have exactly loops 1..{T} for every token; "
                             f"re-run the geometry stage")
        tok = sub["token"].to_numpy().reshape(n, T)
        if not (tok == tok[:, :1]).all() or np.unique(tok[:, 0]).size != n:
            raise InputError(f"{path}: split '{split}' has inconsistent token ids; re-run the geometry stage")
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
            raise InputError(f"{path}: split '{split}' has non-finite target_logprob; re-run dump/geometry")
        first = {c: sub[c].to_numpy().reshape(n, T)[:, 0].astype(np.int64) for c in (*TOKEN_COLUMNS, *extra)}
        out[split] = SplitArrays(token=first.pop("token"), loop=per_loop, fields=first)
    Ts = {s: f.n_loops for s, f in out.items()}
    if len(set(Ts.values())) > 1:
        raise InputError(f"{path}: splits have different numbers of loops {Ts}; re-run the geometry stage")
    return out


def _first(exc: BaseException) -> str:
    msg = str(exc).strip()
    return (msg.splitlines()[0] if msg else type(exc).__name__)[:120]
