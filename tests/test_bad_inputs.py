"""The bad-input table: every bad input a user can give a stage gives one line naming the key or the
file, and exit 2 — never a traceback.

Each case runs the real CLI (``looptrace <stage> ...`` through typer's CliRunner) on the repository's params.yaml
with one override file layered over it (or on a file of its own), with every input and output root under a
temporary directory, and asserts the exit code, that stderr is exactly one ``error:`` line, and that the line holds
the expected words (the key or the file, and the fix). ``python -m tests.test_bad_inputs`` rewrites
docs/bad-inputs.md from the same table with the messages as they are now.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from looptrace.cli import app

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "bad-inputs.md"
NO_CUDA = not torch.cuda.is_available()
HAS_S3FS = importlib.util.find_spec("s3fs") is not None


def _argv(stage: str, t: Path) -> list[str]:
    """The stage's command line with every root under ``t`` (model ``m``)."""
    roots = {"train": ["--train-root", t / "train"], "dump": ["--dump-root", t / "dump"],
             "geometry": ["--geometry-root", t / "geometry"], "readouts": ["--readouts-root", t / "readouts"],
             "gates": ["--gates-root", t / "gates"], "loopmap": ["--loopmap-root", t / "loopmap"]}
    argv = {
        "train": ["--task", "running_sum", "--regime", "uniform", "--out", t / "train"],
        "dump": ["--model", "m", *roots["train"], "--out", t / "dump"],
        "dynamics": ["--model", "m", *roots["train"], "--out", t / "dynamics"],
        "loopmap": ["--model", "m", *roots["train"], "--out", t / "loopmap"],
        "geometry": ["--model", "m", *roots["dump"], "--out", t / "geometry"],
        "readouts": ["--model", "m", *roots["geometry"], "--out", t / "readouts"],
        "gates": ["--models", "m", *roots["dump"], "--out", t / "gates"],
        "diagnose": ["--models", "m", *roots["readouts"], *roots["gates"], *roots["geometry"], *roots["dump"],
                     *roots["loopmap"], "--out", t / "diagnose"],
        "latency": ["--models", "m", *roots["train"], *roots["dump"], *roots["readouts"], *roots["gates"],
                    "--out", t / "latency"],
        "generate": ["--models", "m", *roots["train"], *roots["dump"], *roots["readouts"], *roots["gates"],
                     "--out", t / "generate"],
        "report": ["--models", "m", "--root", t, "--out", t / "report"],
    }[stage]
    return [stage, *map(str, argv)]


@dataclass(frozen=True)
class Case:
    """One bad input: ``override`` is YAML layered over params.yaml (``params`` replaces the params files instead);
    ``setup(t)`` writes input artifacts; ``expect`` are substrings of the one error line."""

    id: str
    stage: str
    what: str
    expect: tuple[str, ...]
    override: str | None = None
    params: str | None = None
    setup: Callable[[Path], None] | None = None
    extra: tuple[str, ...] = ()
    code: int = 2
    skip: str = field(default="")
    env: dict | None = None  # environment of the run (None values unset a variable)


# ------------------------------------------------------------------------------------------- input artifacts

def _checkpoint(t: Path) -> Path:
    from tests.builders import tiny_checkpoint

    return tiny_checkpoint(t / "train", name="m")


def _garbage_ckpt(t: Path) -> None:
    _checkpoint(t).write_bytes(b"garbage\n")


def _truncated_ckpt(t: Path) -> None:
    p = _checkpoint(t)
    p.write_bytes(p.read_bytes()[:1000])


class _Boom:
    def __reduce__(self):
        return (print, ("this ran",))


def _code_ckpt(t: Path) -> None:
    p = _checkpoint(t)
    torch.save({**torch.load(p, weights_only=True), "meta": _Boom()}, p)


def _foreign_ckpt(t: Path) -> None:
    from tests.builders import tiny_checkpoint

    (t / "train").mkdir(parents=True)
    tiny_checkpoint(t / "train", name="other").parent.rename(t / "train" / "m")


def _stores(t: Path, model: dict | None = None, chunk: int = 16) -> None:
    from tests.builders import random_signal_arrays, write_arrays

    attrs = {"token_types": ["keep", "change"], "vocab_size": 4} | ({"model": model} if model else {})
    for i, s in enumerate(("fit", "val", "test")):
        write_arrays(t / "dump" / "m" / f"{s}.zarr", random_signal_arrays(np.random.default_rng(i), N=40),
                     attrs=attrs, chunk_tokens=chunk)


def _foreign_stores(t: Path) -> None:
    _stores(t, {"name": "other", "checkpoint_hash": "0" * 64})


def _stale_test_store(t: Path) -> None:
    """model.pt retrained (or replaced) after the dump: the store records another checkpoint's hash."""
    _checkpoint(t)
    _stores(t, {"name": "m", "checkpoint_hash": "0" * 64})


def _not_stores(t: Path) -> None:
    for s in ("fit", "val", "test"):
        (t / "dump" / "m" / f"{s}.zarr").mkdir(parents=True)


def _damaged_array_meta(t: Path) -> None:
    _stores(t)
    z = t / "dump" / "m" / "fit.zarr" / "margin" / "zarr.json"
    z.write_text(z.read_text()[:200])


def _zarr_format_2(t: Path, member: str = "") -> None:
    import json

    _stores(t)
    z = t / "dump" / "m" / "fit.zarr" / member / "zarr.json"
    z.write_text(json.dumps({**json.loads(z.read_text()), "zarr_format": 2}))


def _symlink_loop(t: Path) -> None:
    _stores(t)
    (t / "loop").symlink_to(t / "loop")


#: No AWS credentials anywhere (and no instance metadata service to ask).
NO_AWS = {"AWS_ACCESS_KEY_ID": None, "AWS_SECRET_ACCESS_KEY": None, "AWS_SESSION_TOKEN": None, "AWS_PROFILE": None,
          "AWS_EC2_METADATA_DISABLED": "true", "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/credentials",
          "AWS_CONFIG_FILE": "/nonexistent/config", "AWS_ENDPOINT_URL": None, "AWS_ENDPOINT_URL_S3": None}


def _lm_checkpoint(t: Path) -> None:
    from tests import hf_helpers as H

    H.build_dory(t / "dory")
    H.corpus(t / "corpus.jsonl")


def _lm_short_override() -> str:
    """The LM profile's dump section for a tiny checkpoint and corpus under ``<tmp>``, asking 64 test sequences of a
    corpus that yields a few."""
    import yaml

    d = yaml.safe_load((REPO / "profiles" / "lm" / "params.yaml").read_text())["dump"]
    d["adapter"].update(path="<tmp>/dory", dtype="float32", name="m")
    d["text"].update(path="<tmp>/corpus.jsonl", seq_len=16)
    d.update(sequences={"fit": 4, "val": 4, "test": 64}, batch_size=3, chunk_tokens=20, allow_prefix_overlap=True)
    return yaml.safe_dump({"dump": d}, sort_keys=False).strip()


def _out_is_a_file(t: Path) -> None:
    _stores(t)
    (t / "geometry").write_text("not a directory")


def _token_loop(t: Path) -> Path:
    from tests.builders import token_loop_splits, write_token_loop

    return write_token_loop(t / "geometry" / "m" / "token_loop.parquet", token_loop_splits(n=20))


def _truncated_token_loop(t: Path) -> None:
    p = _token_loop(t)
    p.write_bytes(p.read_bytes()[:200])


def _damage_page(path: Path, column: str = "entropy") -> None:
    """64 bytes overwritten inside the first data page of ``column`` (not the footer: the file still opens)."""
    import pyarrow.parquet as pq

    meta = pq.ParquetFile(path).metadata
    names = [meta.schema.column(i).name for i in range(meta.num_columns)]
    col = meta.row_group(0).column(names.index(column))
    at = col.data_page_offset + col.total_compressed_size // 2
    raw = bytearray(path.read_bytes())
    raw[at:at + 64] = bytes(64)
    path.write_bytes(bytes(raw))


def _checksummed_token_loop(t: Path, manifest: bool) -> Path:
    """token_loop.parquet as the geometry stage writes it now: page checksums, and its directory's manifest."""
    import polars as pl

    from looptrace.io.manifest import write_manifest
    from looptrace.io.parquet import write_parquet

    p = _token_loop(t)
    write_parquet(pl.read_parquet(p), p)
    if manifest:
        write_manifest(p.parent, "geometry")
    return p


def _damaged_page_token_loop(t: Path) -> None:
    _damage_page(_checksummed_token_loop(t, manifest=False))


def _damaged_token_loop_with_manifest(t: Path) -> None:
    _damage_page(_checksummed_token_loop(t, manifest=True))


def _readouts_artifacts(t: Path) -> None:
    from tests.builders import tiny_artifacts

    tiny_artifacts(t, name="m")


def _truncated_readouts_metrics(t: Path) -> None:
    _readouts_artifacts(t)
    p = t / "readouts" / "m" / "metrics.json"
    p.write_text(p.read_text()[:40])


# ------------------------------------------------------------------------------------------- the table

CASES = [
    # base
    Case("threads-0", "dump", "`base.threads: 0`", ("base.threads = 0: must be ≥ 1",), "base: {threads: 0}"),
    Case("threads-bool", "train", "`base.threads: true`", ("base.threads = true: expected an integer, got a bool",),
         "base: {threads: true}"),
    Case("analysis-threads-0", "latency", "`base.analysis_threads: 0`", ("base.analysis_threads = 0",),
         "base: {analysis_threads: 0}"),
    Case("device-cuda", "train", "`base.device: cuda` on a machine without CUDA",
         ("base.device = 'cuda': this machine has no usable CUDA device", "set base.device: cpu"),
         "base: {device: cuda}", skip="" if NO_CUDA else "this machine has CUDA"),
    Case("device-typo", "dump", "`base.device: gpu`", ("base.device = 'gpu': must be a string matching",),
         "base: {device: gpu}"),
    Case("seed-negative", "geometry", "`base.seed: -1`", ("base.seed = -1: must be in [0, 4294967296)",),
         "base: {seed: -1}"),
    Case("dask-workers-0", "geometry", "`base.dask.workers: 0`", ("base.dask.workers must be an integer >= 1",),
         "base: {dask: {workers: 0}}"),
    # params files
    Case("empty-params", "dump", "an empty params file", ("params section 'dump' is missing from",), params=""),
    Case("missing-params", "geometry", "`--params` naming no file", ("params file", "not found"),
         params=None, extra=("--params", "/nonexistent/params.yaml")),
    Case("yaml-syntax", "readouts", "a params file that is not YAML", ("is not valid YAML",), params="base: {seed: [\n"),
    Case("section-typo", "readouts", "a misspelled top-level section (`readout:`)",
         ("unknown params section 'readout'", "did you mean 'readouts'?"), "readout: {rules: [fixed]}"),
    Case("section-list", "readouts", "`readouts: [bad]` (a list)",
         ("section 'readouts' must be a mapping (key: value lines), got a list ['bad']",), "readouts: [bad]"),
    Case("unknown-key", "geometry", "a misspelled key (`geometry.epz`)",
         ("unknown key 'epz' in params section 'geometry'; did you mean 'eps'?",), "geometry: {epz: {}}"),
    # train
    Case("steps-0", "train", "`train.steps: 0`", ("train.steps = 0: must be ≥ 1", "untrained"), "train: {steps: 0}"),
    Case("batch-0", "train", "`train.batch_size: 0`", ("train.batch_size = 0: must be ≥ 1",), "train: {batch_size: 0}"),
    Case("val-seq-0", "train", "`train.val_sequences: 0`", ("train.val_sequences = 0",), "train: {val_sequences: 0}"),
    Case("ckpt-fractions", "train", "`train.checkpoint_fractions: [1.5, -1]`",
         ("train.checkpoint_fractions[0] = 1.5: must be in (0, 1)",), "train: {checkpoint_fractions: [1.5, -1]}"),
    Case("n-head", "train", "`train.model: {d_model: 10, n_head: 4}`",
         ("train.model.d_model = 10 is not a multiple of train.model.n_head = 4",),
         "train: {model: {d_model: 10, n_head: 4}}"),
    Case("lr-string", "train", "`train.lr: fast`", ("train.lr = 'fast': expected a number, got a string",),
         "train: {lr: fast}"),
    Case("unknown-task", "train", "`--task nope`", ("task 'nope' is not defined in params section 'train.task_defs'",),
         extra=("--task", "nope")),
    # dump
    Case("dump-batch-0", "dump", "`dump.batch_size: 0`", ("dump.batch_size must be >= 1",), "dump: {batch_size: 0}"),
    Case("dump-dtype", "dump", "`dump.hidden_dtype: float8`", ("dump.hidden_dtype must be one of",),
         "dump: {hidden_dtype: float8}"),
    Case("dump-allow-nan-int", "dump", "`dump.allow_nan: 1`", ("dump.allow_nan = 1: expected true or false",),
         "dump: {allow_nan: 1}"),
    Case("dump-split", "dump", "`dump.sequences: {train: 5}`", ("dump.sequences: unknown split 'train'",),
         "dump: {sequences: {train: 5}}"),
    Case("ckpt-garbage", "dump", "a `model.pt` holding garbage",
         ("model.pt' (8 bytes) is truncated or not a torch checkpoint", "looptrace train"), setup=_garbage_ckpt),
    Case("ckpt-truncated", "dump", "a truncated `model.pt`",
         ("model.pt' (1000 bytes) is truncated or not a torch checkpoint", "rebuild it"), setup=_truncated_ckpt),
    Case("ckpt-missing", "dump", "no `model.pt`", ("model.pt' not found; rebuild it with `dvc repro train`",)),
    Case("ckpt-foreign", "dump", "another model's `model.pt` under this model's name",
         ("is model 'other', not 'm' (another model's checkpoint under this name?)",), setup=_foreign_ckpt),
    Case("ckpt-code", "dump", "a `model.pt` holding a pickled callable",
         ("holds objects other than tensors and plain values (refused: loading it could run code",), setup=_code_ckpt),
    # dynamics
    Case("dyn-split", "dynamics", "`dynamics.probe_split: train`", ("dynamics.probe_split must be one of",),
         "dynamics: {probe_split: train}"),
    # loopmap
    Case("loopmap-split", "loopmap", "`loopmap.split: train`", ("loopmap.split must be one of",),
         "loopmap: {split: train}"),
    Case("loopmap-ckpt", "loopmap", "no `model.pt`", ("model.pt' not found; run `dvc repro train` first",)),
    # geometry
    Case("geo-eps", "geometry", "`geometry.eps: {kl_prev: [-1]}`", ("geometry.eps.kl_prev: give a non-empty list",),
         "geometry: {eps: {kl_prev: [-1]}}"),
    Case("geo-splits", "geometry", "`geometry.splits: [train]`", ("geometry.splits: each must be one of",),
         "geometry: {splits: [train]}"),
    Case("store-missing", "geometry", "no dump", ("m/fit.zarr not found; run `looptrace dump` first",)),
    Case("not-a-store", "geometry", "a directory that is not a store", ("is not a Zarr v3 store (no zarr.json)",),
         setup=_not_stores),
    Case("array-meta", "geometry", "a truncated array `zarr.json`",
         ("'margin/zarr.json' is damaged", "re-run `looptrace dump`"), setup=_damaged_array_meta),
    Case("store-foreign", "geometry", "another model's stores under this model's name",
         ("is a dump of model 'other', not 'm' (another model's store under this name?)",), setup=_foreign_stores),
    Case("out-file", "geometry", "`--out` pointing at a file", ("is a file, not a directory; pass --out a directory",),
         setup=_out_is_a_file),
    # readouts / calibration / intervals
    Case("nq-bool", "readouts", "`calibration.n_quantiles: true`",
         ("calibration.n_quantiles = true: expected an integer, got a bool",), "calibration: {n_quantiles: true}"),
    Case("nq-1", "readouts", "`calibration.n_quantiles: 1`", ("calibration.n_quantiles = 1: must be ≥ 11",),
         "calibration: {n_quantiles: 1}"),
    Case("rules-empty", "readouts", "`readouts.rules: []`", ("readouts.rules = []: list at least one exit rule",),
         "readouts: {rules: []}"),
    Case("rule-unknown", "readouts", "`readouts.rules: [nope]`", ("nope",), "readouts: {rules: [nope]}"),
    Case("dx-range", "readouts", "`calibration.dx: [95, 101]`", ("calibration.dx[1] = 101.0: must be in (0, 100]",),
         "calibration: {dx: [95, 101]}"),
    Case("level", "readouts", "`intervals.level: 2`", ("intervals.level must be in [0.5, 1)",),
         "intervals: {level: 2}"),
    Case("token-loop-missing", "readouts", "no `token_loop.parquet`",
         ("token_loop.parquet not found; run the geometry stage",)),
    Case("token-loop-truncated", "readouts", "a truncated `token_loop.parquet`",
         ("token_loop.parquet is truncated or not a Parquet file", "re-run the geometry stage"),
         setup=_truncated_token_loop),
    # gates
    Case("gates-empty", "gates", "`gates.gates: []`", ("gates.gates must list at least one gate",),
         "gates: {gates: []}"),
    Case("gates-pca", "gates", "`gates.pca_components: -1`", ("gates.pca_components must be ≥ 0",),
         "gates: {pca_components: -1}"),
    Case("gates-stat", "gates", "`gates.stats: [bogus]`", ("gates.stats: unknown statistic 'bogus'",),
         "gates: {stats: [bogus]}"),
    Case("gates-store", "gates", "no dump for the model", ("not found; run `looptrace dump` first",)),
    # diagnose
    Case("diag-x", "diagnose", "`diagnose.x` not in `calibration.dx`",
         ("diagnose.x = 90.0 is not in calibration.dx = [95.0, 98.0, 99.0]",), "diagnose: {x: 90}"),
    Case("diag-agg", "diagnose", "`diagnose.spearman_aggregation: mean`",
         ("diagnose.spearman_aggregation must be 'difficulty_mean' or 'token'",),
         "diagnose: {spearman_aggregation: mean}"),
    Case("diag-missing", "diagnose", "no readouts outputs", ("m/metrics.json not found; run the readouts stage",)),
    # latency / generate
    Case("lat-batch", "latency", "`latency.batch_sizes: [0]`", ("latency.batch_sizes must be a non-empty list",),
         "latency: {batch_sizes: [0]}"),
    Case("lat-rule", "latency", "`latency.rules` not in `readouts.rules`",
         ("latency.rules = 'top1' is not in readouts.rules = ['fixed']",),
         "readouts: {rules: [fixed]}\nlatency: {rules: [top1]}"),
    Case("lat-stale-store", "latency", "a `test.zarr` dumped from another checkpoint than `model.pt`",
         ("was dumped from checkpoint 000000000000, not", "re-run `looptrace dump` for model 'm'"),
         setup=_stale_test_store),
    Case("gen-stale-store", "generate", "a `test.zarr` dumped from another checkpoint than `model.pt`",
         ("was dumped from checkpoint 000000000000, not", "the model was retrained or replaced since the dump"),
         setup=_stale_test_store),
    Case("gen-policy", "generate", "`generate.policies: [bad]`", ("generate.policies must be a non-empty list",),
         "generate: {policies: [bad]}"),
    # report
    Case("rep-eps", "report", "`report.convergence_eps` not in `geometry.eps`",
         ("report.convergence_eps = 0.5 is not in geometry.eps.kl_prev",), "report: {convergence_eps: 0.5}"),
    Case("rep-x", "report", "`report.x` not in `calibration.dx`", ("report.x = 90.0 is not in calibration.dx",),
         "report: {x: 90}"),
    Case("rep-dpi", "report", "`report.dpi: 10`", ("report.dpi must be ≥ 50",), "report: {dpi: 10}"),
    Case("rep-metrics", "report", "a truncated readouts `metrics.json`",
         ("readouts/m/metrics.json does not match its manifest.json", "re-run the readouts stage"),
         setup=_truncated_readouts_metrics),
    # nothing quiet
    Case("store-format", "geometry", "a store whose `zarr.json` declares `zarr_format: 2`",
         ("fit.zarr: 'zarr.json' field 'zarr_format' is 2, expected 3", "re-run `looptrace dump`"),
         setup=_zarr_format_2),
    Case("array-format", "gates", "an array whose `zarr.json` declares `zarr_format: 2`",
         ("fit.zarr: 'margin/zarr.json' field 'zarr_format' is 2, expected 3",),
         setup=lambda t: _zarr_format_2(t, "margin")),
    # every artifact verified on read
    Case("token-loop-page", "readouts", "64 bytes overwritten in a data page of `token_loop.parquet` (no manifest)",
         ("token_loop.parquet has a damaged data page", "re-run the geometry stage"), setup=_damaged_page_token_loop),
    Case("token-loop-manifest", "readouts", "64 bytes overwritten in `token_loop.parquet` beside its manifest",
         ("token_loop.parquet does not match its manifest.json", "re-run the geometry stage"),
         setup=_damaged_token_loop_with_manifest),
    Case("lm-short-split", "dump", "an LM corpus that yields fewer test sequences than `dump.sequences` asks",
         ("corpus.jsonl': split 'test' gets", "of the 64 asked (dump.sequences)",
          "set dump.text.short_splits: warn"), _lm_short_override(), setup=_lm_checkpoint),
    # the environment's faults are the user's to fix
    Case("dask-unparsable", "geometry", "`base.dask.scheduler: 'foo:bar:baz'` (does not parse)",
         ("Dask scheduler address 'foo:bar:baz'", "does not parse", "write it as tcp://host:8786"),
         "base: {dask: {scheduler: 'foo:bar:baz'}}", setup=_stores),
    Case("dask-unreachable", "geometry", "`base.dask.scheduler` naming a port nothing listens on",
         ("Dask scheduler address 'tcp://127.0.0.1:1'", "nothing answers within 1 s",
          "base.dask.connect_timeout_s"), "base: {dask: {scheduler: 'tcp://127.0.0.1:1', connect_timeout_s: 1}}",
         setup=_stores),
    Case("dask-timeout-0", "geometry", "`base.dask.connect_timeout_s: 0`",
         ("base.dask.connect_timeout_s must be a number of seconds > 0",), "base: {dask: {connect_timeout_s: 0}}"),
    Case("s3-no-credentials", "geometry", "an `s3://` dump root with no AWS credentials",
         ("s3 store s3://looptrace-no-such-bucket/dump/m/fit.zarr: no AWS credentials found", "AWS_ACCESS_KEY_ID"),
         extra=("--dump-root", "s3://looptrace-no-such-bucket/dump"), env=NO_AWS,
         skip="" if HAS_S3FS else "s3fs is not installed (the `remote` extra; make test-lowest installs `hf` only)"),
    Case("out-symlink-loop", "geometry", "`--out` through a symlink loop",
         ("Too many levels of symbolic links", "the path goes through a symlink loop"),
         setup=_symlink_loop, extra=("--out", "<tmp>/loop/geometry")),
    Case("out-name-too-long", "geometry", "`--out` with a 300-character directory name",
         ("File name too long", "longer than the filesystem allows"), setup=_stores,
         extra=("--out", "<tmp>/" + "x" * 300 + "/geometry")),
    Case("user-rule-raises", "readouts", "a user's exit rule that raises (IndexError inside their function)",
         ("your exit rule 'reads_a_loop_it_does_not_have' (tests.user_rules.reads_a_loop_it_does_not_have at ",
          "user_rules.py:", "raised IndexError", "shape (", "not in looptrace"),
         "readouts: {rules: [fixed, 'tests.user_rules:reads_a_loop_it_does_not_have']}",
         setup=lambda t: _token_loop(t)),
    # params that mean exactly what they say
    Case("dup-key", "readouts", "a key given twice (`calibration: {delta: 0.5, delta: 5}`)",
         ("key 'calibration.delta' is given twice (line 1 and line 1)", "keep one of them"),
         "calibration: {delta: 0.5, delta: 5}"),
    Case("dup-section", "readouts", "a section given twice in one file",
         ("section 'calibration' is given twice (line 1 and line 2)",),
         "calibration: {delta: 0.5}\ncalibration: {delta: 5}"),
    Case("n-boot-1", "readouts", "`intervals.n_boot: 1`",
         ("intervals.n_boot = 1: a 0.95 percentile interval needs at least 200 resamples", "or 0 for no intervals"),
         "intervals: {n_boot: 1}"),
    Case("nq-huge", "readouts", "`calibration.n_quantiles: 1000000` on a model with 80 val values",
         ("calibration.n_quantiles = 1000000 exceeds the 80 val values", "set calibration.n_quantiles ≤ 80 (51 in [AD])"),
         "calibration: {n_quantiles: 1000000}", setup=lambda t: _token_loop(t)),
    Case("block-tokens-1", "geometry", "`geometry.block_tokens: 1` on a store chunked by 40 tokens",
         ("geometry.block_tokens = 1 is far below the chunk of store", "decoded 40 times",
          "set geometry.block_tokens ≥ 3, or null"), "geometry: {block_tokens: 1}", setup=lambda t: _stores(t, chunk=40)),
]


def run_case(case: Case, t: Path):
    """Run one case in ``t``; returns (exit code, stderr)."""
    if case.setup:
        case.setup(t)
    argv, extra = _argv(case.stage, t), [x.replace("<tmp>", str(t)) for x in case.extra]
    if extra and extra[0] == "--params":  # the params files themselves are the bad input
        params = extra
    else:
        if extra:  # an option replaced (e.g. --task nope)
            i = argv.index(extra[0])
            argv[i:i + len(extra)] = extra
        if case.params is not None:
            f = t / "params.yaml"
            f.write_text(case.params)
            params = ["--params", str(f)]
        else:
            params = ["--params", str(REPO / "params.yaml")]
            if case.override is not None:
                f = t / "over.yaml"
                f.write_text(case.override.replace("<tmp>", str(t)) + "\n")
                params += ["--params", str(f)]
    _clear_fs_cache(case)
    try:
        res = CliRunner().invoke(app, [*argv, *params], env=case.env)
    finally:
        _clear_fs_cache(case)
    return res.exit_code, res.stderr


def _clear_fs_cache(case: Case) -> None:
    """A case with its own environment (credentials) must neither reuse nor leave a cached S3 filesystem."""
    if case.env:
        import fsspec

        fsspec.get_filesystem_class("s3").clear_instance_cache()


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_one_line_exit_2(case, tmp_path):
    if case.skip:
        pytest.skip(case.skip)
    code, err = run_case(case, tmp_path)
    lines = err.strip().splitlines()
    assert code == case.code, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for needle in case.expect:
        assert needle in lines[0], (needle, lines[0])


def test_doc_lists_every_case():
    text = DOC.read_text()
    rows = re.findall(r"^\| `([\w-]+)` \|", text, re.M)
    assert rows == [c.id for c in CASES], "docs/bad-inputs.md is stale: python -m tests.test_bad_inputs"
    assert len(rows) >= 40


def _render() -> str:
    import tempfile

    out = []
    for c in CASES:
        with tempfile.TemporaryDirectory() as d:
            t = Path(d)
            code, err = run_case(c, t)
            msg = err.strip().replace(str(t), "<tmp>").replace(str(REPO), ".").removeprefix("error: ")
        cell = msg.replace("|", "\\|")
        out.append(f"| `{c.id}` | {c.stage} | {c.what} | {code} | {cell} |")
    head = DOC.read_text().split("<!-- table -->")[0]
    tail = DOC.read_text().split("<!-- /table -->")[1]
    return (head + "<!-- table -->\n| case | stage | bad input | exit | message (one line, `error: ` omitted) |\n"
            "|---|---|---|---|---|\n" + "\n".join(out) + "\n<!-- /table -->" + tail)


if __name__ == "__main__":
    DOC.write_text(_render())
    print(f"{DOC.relative_to(REPO)} written ({len(CASES)} cases)", file=sys.stderr)
