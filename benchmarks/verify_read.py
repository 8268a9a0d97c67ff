"""Benchmark of verified reads: what checking a table costs when a stage reads it.

A synthetic ``token_loop.parquet`` (the geometry stage's columns, written as the stage writes it: page checksums on,
and the directory's ``manifest.json``) is read the way the readouts stage reads it, two ways, alternating
``--repeats`` times (the fastest wall time of each counts; the cores are shared):

1. verified: what :func:`looptrace.io.tables.load_token_loop` does now — :func:`looptrace.io.parquet.verify_parquet`
   (the manifest's sha256 of the file) and then the read (polars ``scan_parquet``, filter, sort);
2. unverified: the read alone (the read path without verification): ``ratio`` = verified / unverified;
3. verified_pages: as 1. with the manifest moved away (a directory DVC restored file by file), so the check is a
   pyarrow decode with ``page_checksum_verification=True``: ``ratio_pages``, for reference.

The hash cache of :mod:`looptrace.io.manifest` is cleared before each verified read (a stage reads a table once).
Target: ratio = time(verified) / time(unverified) ≤ 1.5. Exit status 1 when it is missed.

    python benchmarks/verify_read.py [--tokens 50000] [--loops 8] [--repeats 5] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

TARGET = 1.5
#: The table builders live with the tests (tests/builders.py): the repository root on the path.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def build(path: Path, n_tokens: int, loops: int) -> Path:
    import polars as pl

    from looptrace.io.manifest import write_manifest
    from looptrace.io.parquet import write_parquet
    from tests.builders import token_loop_splits, write_token_loop

    p = write_token_loop(path / "token_loop.parquet", token_loop_splits(n=n_tokens, T=loops))
    write_parquet(pl.read_parquet(p), p)  # as the stage writes it: page checksums
    write_manifest(path, "geometry")
    return p


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=50_000, help="tokens per split (val and test)")
    ap.add_argument("--loops", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, one repeat, target not enforced (the suite)")
    args = ap.parse_args()
    if args.smoke:
        args.tokens, args.loops, args.repeats = 500, 3, 1

    import polars as pl

    from looptrace.io import manifest, parquet

    with tempfile.TemporaryDirectory() as d:
        path = build(Path(d), args.tokens, args.loops)
        cols = ["split", "token", "difficulty", "token_type", "target", "loop", "correct", "argmax", "target_logprob",
                "entropy"]

        def read() -> pl.DataFrame:  # the read itself (polars, unverified)
            return (pl.scan_parquet(path).filter(pl.col("split").is_in(["val", "test"])).select(cols)
                    .sort("split", "token", "loop").collect())

        def verified() -> pl.DataFrame:  # load_token_loop's path: the check, then the read
            manifest._VERIFIED.clear()  # a stage reads a table once
            parquet.verify_parquet(path, cols)
            return read()

        def verified_pages() -> pl.DataFrame:  # no manifest (a DVC-restored directory): page checksums instead
            (path.parent / manifest.MANIFEST).rename(path.parent / "m.json")
            try:
                return verified()
            finally:
                (path.parent / "m.json").rename(path.parent / manifest.MANIFEST)

        modes = {"verified": verified, "unverified": read, "verified_pages": verified_pages}
        times: dict[str, list[float]] = {k: [] for k in modes}
        for _ in range(args.repeats):
            for mode, fn in modes.items():
                t0 = time.perf_counter()
                fn()
                times[mode].append(time.perf_counter() - t0)
        best = {k: min(v) for k, v in times.items()}
        ratio = best["verified"] / best["unverified"]
        out = {"file_mb": round(path.stat().st_size / 2**20, 1), "rows": 2 * args.tokens * args.loops,
               **{f"{k}_s": round(v, 4) for k, v in best.items()}, "ratio": round(ratio, 3),
               "ratio_pages": round(best["verified_pages"] / best["unverified"], 3), "target": TARGET}
    print(json.dumps(out))
    return 0 if ratio <= TARGET or args.smoke else 1


if __name__ == "__main__":
    np.seterr(all="ignore")
    sys.exit(main())
