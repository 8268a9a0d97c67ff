"""What a trajectory store holds (SPEC §1): the schema version, the arrays with their dimensions and stored dtypes,
the required attributes, the codecs, the chunk digest and :class:`StoreError`."""

from __future__ import annotations

from typing import Any

import crc32c
import numpy as np
from zarr.codecs import BloscCodec, Crc32cCodec

from looptrace.config import UserError
from looptrace.signals.names import LOGIT_SIGNALS

#: Bumped whenever an array, dimension or required attribute changes meaning.
SCHEMA_VERSION = 1

#: Per-(token, loop) logit statistics of SPEC §3 (all float32 except ``argmax``, int32).
STAT_NAMES = LOGIT_SIGNALS

#: Per-token metadata arrays (int64), in ``tokens_frame`` column order.
TOKEN_FIELDS = ("target", "token_id", "sequence", "position", "difficulty", "token_type")

#: Optional per-(token, loop) loop-map statistics (SPEC §2b), written only with ``dump.contraction``
#: (:mod:`looptrace.loopmap.contraction`): ρ_t of the diagonal Jacobian block, its upper bound (NaN beyond
#: ``dump.contraction.exact_width``), the sequence's FTLE and its share.
CONTRACTION_NAMES = ("contraction", "contraction_bound", "ftle", "ftle_share")

#: Optional per-(token, loop, layer, head) attention statistics (SPEC §2c), written only with ``dump.heads``
#: (:mod:`looptrace.capture.heads`): each head's attention entropy and its Jensen–Shannon divergence from the previous
#: loop (nats). ``layer`` indexes ``params.heads`` (the block layers measured), not ``params.layers``.
HEAD_NAMES = ("head_entropy", "head_js")

#: Dimension names of every array the store may hold.
DIMS: dict[str, tuple[str, ...]] = {
    "hidden": ("token", "loop", "d_model"),
    "hidden_init": ("token", "d_model"),
    "layer_hidden": ("token", "loop", "layer", "d_model"),  # opt-in dump.layers (looptrace.capture.layers)
    "logits": ("token", "loop", "vocab"),
    "topk_ids": ("token", "loop", "k"),
    "topk_logits": ("token", "loop", "k"),
    **{s: ("token", "loop") for s in STAT_NAMES},
    "gate_logit": ("token", "loop"),
    **{c: ("token", "loop") for c in CONTRACTION_NAMES},
    **{h: ("token", "loop", "layer", "head") for h in HEAD_NAMES},  # opt-in dump.heads (looptrace.capture.heads)
    **{f: ("token",) for f in TOKEN_FIELDS},
    "loop_group": ("loop",),
    "chunk_nan_count": ("chunk",),
    "chunk_digest": ("chunk", "array"),
}

#: Stored dtype of every array except ``hidden``/``hidden_init`` (which follow ``dump.hidden_dtype``).
DTYPES: dict[str, str] = {
    "logits": "float32", "topk_ids": "int32", "topk_logits": "float32",
    **{s: "float32" for s in STAT_NAMES}, "argmax": "int32", "gate_logit": "float32",
    **{c: "float32" for c in CONTRACTION_NAMES}, **{h: "float32" for h in HEAD_NAMES},
    **{f: "int64" for f in TOKEN_FIELDS}, "loop_group": "int32", "chunk_nan_count": "int64",
    "chunk_digest": "uint32",
}

HIDDEN_NAMES = ("hidden", "hidden_init", "layer_hidden")

#: Stored dtypes of the states; bfloat16 is kept as its uint16 bit pattern (looptrace.io.precision).
HIDDEN_DTYPES = ("float16", "float32", "bfloat16")

#: Arrays every store must hold (``logits`` or ``topk_*`` and ``gate_logit`` are optional).
REQUIRED = ("hidden", "hidden_init", *STAT_NAMES, *TOKEN_FIELDS, "loop_group")

#: Group attributes every store must carry (the rest default to None / empty on read).
REQUIRED_ATTRS = ("schema_version", "complete", "n_tokens", "n_loops", "d_model", "vocab_size",
                  "chunk_tokens", "nan_count", "dtypes")

#: Descriptive attributes and their value when a writer does not know them (``write_store``).
ATTR_DEFAULTS: dict[str, Any] = {"model": {}, "split": None, "task": None, "regime": None,
                                 "difficulty_name": "difficulty", "difficulty_levels": [], "token_types": [],
                                 "params": {}, "seeds": {}, "versions": {}}

_MARKER = "chunk_nan_count"

_DIGEST = "chunk_digest"

#: Internal arrays (resume markers, chunk digests): not data, not listed by ``names``.
_INTERNAL = (_MARKER, _DIGEST)

_RERUN = "re-run `looptrace dump` to rebuild it"


class StoreError(UserError, ValueError):
    """A one-line, user-facing problem with a trajectory store (names the store, the array and the fix)."""


#: Blosc block size: blocks of 4 MiB (instead of Blosc's automatic ~256 KiB at level 1) give zstd more
#: context and fewer block headers. Measured on random-init d_model 512 states, one 4096-token chunk per
#: write: store / float32 .npy 0.493 → 0.469, and 289 → 186 ms of CPU per chunk (the smaller blocks cost more).
BLOSC_BLOCKSIZE = 1 << 22


def _codecs(clevel: int) -> list:
    # zstd at a low level with bit shuffle: float16 states compress to ~0.85 and float32 logits to ~0.82
    # (byte shuffle ~0.93 / 0.91; lz4 ~0.91 / 0.86, 30 % less CPU but the store misses half the float32
    # bytes); ints and stats far more. crc32c last, so the checksum covers the bytes actually stored (SPEC §1).
    return [BloscCodec(cname="zstd", clevel=clevel, shuffle="bitshuffle", blocksize=BLOSC_BLOCKSIZE), Crc32cCodec()]


def _is_checksum_error(exc: BaseException) -> bool:
    msg = str(exc).lower()
    return "checksum" in msg or "decompress" in msg or "blosc" in msg or "corrupt" in msg


def chunk_digest(rows: np.ndarray) -> int:
    """crc32c of one chunk's rows in their stored dtype (C order): the chunk's identity in ``chunk_digest``."""
    return int(crc32c.crc32c(np.ascontiguousarray(rows).data))
