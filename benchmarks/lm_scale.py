"""Every stage at the shapes looptrace's users run: random-init Ouro-1.4B-, Huginn-0125- and Nanbeige4.2-3B-shaped
checkpoints (real width, heads, vocabulary and loop count; fewer layers) through dump -> geometry -> readouts ->
gates -> diagnose -> report at three sizes growing 4x each, each stage against the physical limit measured in the
same run.

For each model of ``--model`` (a row of :data:`SHAPES`):

1. **checkpoint**: the stand-in of the adapter tests (tests/hf_helpers.py ``build_ouro`` / ``build_huginn`` /
   ``build_nanbeige``: the published code's interfaces) at the published width, heads, vocabulary and loop count,
   with ``Shape.layers`` layers inside the loop block (the published count is printed beside it) and bfloat16
   weights, saved and loaded through :func:`looptrace.models.adapters.loading.load_adapter` as the dump stage does
   (``dump.adapter``).
2. For each size N of ``--tokens`` (scored tokens, fit:val:test = 2:1:1, ``seq_len``-token windows of a generated
   JSONL corpus tokenised by the checkpoint's tokenizer): the LM profile (params.yaml + profiles/lm/params.yaml,
   merged into one file with this run's paths and sizes) run stage by stage:

   - **dump**: what the dump entry runs (``load_adapter`` then :func:`looptrace.capture.dump_text.dump_text_model`),
     the load timed apart; at the largest size also the **bare forward** over the same batches
     (:func:`looptrace.capture.dump.bare_forward`: states + every loop's readout, nothing kept) — dump / bare is the
     capture's cost. The store's bytes on disk per token·loop against raw bfloat16 states (2·d bytes).
   - **geometry, readouts, gates, diagnose, report**: each stage's entry (``looptrace.stages.<name>.main``, what
     ``dvc repro`` runs, without the interpreter start-up) called with the LM profile's arguments.

   Each stage runs in a fresh process forked from this one (imports done, nothing computed), so its **peak RSS**
   (``VmHWM``, reset at the start) is its own; also its wall and CPU time, **bytes read** (every file it opened for
   reading from Python — zarr chunks, and the tables the manifest check hashes — counted per open) and
   **tokens·loops per second** (N·T / wall). Then, in another fresh process, the **physical limit**: one
   decompressing read of exactly what the stage read, nothing computed — every zarr chunk it opened decoded once
   (``zarr.Array.get_block_selection``: Blosc + crc32c), every Parquet table read with polars, every JSON parsed.

3. Per stage across the three sizes: the **cost exponent** (least-squares slope of log wall on log N), the
   **peak RSS ratio** (largest / smallest size) and, for the stages that stream a store, stage / read at the
   largest size; against the targets (:data:`TARGETS`): streaming stages ≤ 1.5 × the read, exponent in
   [0.9, 1.1] (also printed on CPU seconds, which a loaded machine disturbs less), RSS ratio ≤ 1.25, dump / bare
   ≤ 1.15. ``--profile`` adds a cProfile run of each offline stage at the largest size (a separate, untimed run):
   where its time goes; ``--profile-dump`` one of the dump at the smallest size.

A model without an adapter yet is a :data:`PENDING` line: ``--model`` naming it fails with that line; ``--model
all`` runs the rest and says so.

    python benchmarks/lm_scale.py [--model ouro|huginn|nanbeige|all] [--tokens N1 N2 N3] [--layers L]
                                  [--threads 2] [--workdir DIR] [--profile] [--profile-dump] [--smoke]

``--smoke``: the same code at the builders' tiny default shapes (d_model 32) and tiny sizes (Ouro at two, Huginn
and Nanbeige at one), about a minute on an idle 2-core machine — the stages' fixed costs (tests/test_benchmarks.py);
targets are printed but not enforced. Exit status 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import inspect
import io
import json
import math
import os
import platform
import shutil
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests/hf_helpers.py: the adapter tests' checkpoint builders

#: Targets of the run (printed; exit status 1 when one is missed outside ``--smoke``).
TARGETS = {"stream/read": 1.5, "exponent": (0.9, 1.1), "rss_ratio": 1.25, "dump/bare": 1.15}
#: The offline stages, in pipeline order; those that stream a store's states (their stage / read has a target).
STAGES = ("geometry", "readouts", "gates", "diagnose", "report")
STREAMING = ("geometry", "gates")
#: H100 SXM dense bfloat16 peak (FLOP/s) and the model-FLOP utilisation assumed by the dump-time estimate.
H100_BF16 = 989e12
H100_MFU = 0.4


# ----------------------------------------------------------------------------------------------
# Model shapes
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Shape:
    """One model family at its published shape, and how this benchmark builds and runs it.

    Attributes:
        name: ``--model`` name (also the run name of every artifact).
        kind: ``dump.adapter.kind``.
        builder: function of tests/hf_helpers.py that saves the checkpoint (``builder(path, dtype=..., **config)``).
        d_model, heads, vocab, loops: published width, attention heads, vocabulary and loop count (kept).
        mlp: published MLP width (gated: three d × mlp matrices).
        kv_heads, head_dim: key/value heads and head width (0: ``heads`` and d / heads, no GQA).
        params: sections of the LM profile this model runs with changed (``{section: {key: value}}``).
        published: published layers (prelude, loop block, coda): the FLOP count of the H100 estimate.
        layers: layers inside the loop block here (prelude and coda: ``min(published, 1)``).
        config: the builder's config.json keys at (shape, loop-block layers).
        tokens: default sizes (scored tokens, all splits together).
        seq_len, batch, chunk: ``dump.text.seq_len``, ``dump.batch_size`` (sequences), ``dump.chunk_tokens``.
        injection: parameters of the per-loop input injection (Huginn's adapter: 2d × d).
        exit_layers: published layers run by every loop's readout (Huginn's coda), besides the head.
        verify_exit: ``dump.adapter.verify_exit`` (the first batch's exit check against the model's own logits).
        smoke: overrides of ``--smoke`` (tiny builder defaults and sizes).
    """

    name: str
    kind: str
    builder: str
    d_model: int
    heads: int
    vocab: int
    loops: int
    mlp: int
    published: tuple[int, int, int]
    layers: int
    config: Callable[[Shape, int], dict]
    tokens: tuple[int, ...]
    seq_len: int
    batch: int
    chunk: int
    injection: int = 0
    exit_layers: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    params: dict = field(default_factory=dict)
    verify_exit: bool = True
    smoke: dict = field(default_factory=dict)

    def flops_per_token(self, seq_len: int) -> float:
        """Forward FLOPs per scored token of a dump of the *published* model (every loop read out):
        2 · (P·N_layer + T·(L·N_layer + N_inj) + T·(C·N_layer + d·V)) + 4·H·h·S̄ per layer run (attention scores and
        values over the mean causal context S̄ = (S + 1) / 2); N_layer = 2·d·H·h + 2·d·H_kv·h + 3·d·mlp (queries and
        output over H heads of width h, keys and values over H_kv: 4d² without GQA and h = d / H)."""
        d, T = self.d_model, self.loops
        p, loop, _ = self.published
        h = self.head_dim or d // self.heads
        q_width, kv_width = self.heads * h, (self.kv_heads or self.heads) * h
        n_layer = 2 * d * q_width + 2 * d * kv_width + 3 * d * self.mlp
        runs = p + T * loop + T * self.exit_layers
        weights = p * n_layer + T * (loop * n_layer + self.injection) + T * (self.exit_layers * n_layer + d * self.vocab)
        return 2.0 * weights + 4.0 * q_width * (seq_len + 1) / 2 * runs


def _ouro_config(s: Shape, layers: int) -> dict:
    return {"hidden_size": s.d_model, "intermediate_size": s.mlp, "num_hidden_layers": layers,
            "num_attention_heads": s.heads, "num_key_value_heads": s.heads, "vocab_size": s.vocab,
            "total_ut_steps": s.loops, "layer_types": ["full_attention"] * layers, "max_window_layers": layers,
            "max_position_embeddings": 4096, "torch_dtype": "bfloat16"}


def _huginn_config(s: Shape, layers: int) -> dict:
    return {"n_embd": s.d_model, "n_heads": s.heads, "n_layers": layers + 2, "block_size": 4096,
            "vocab_size": s.vocab, "intermediate_size": s.mlp, "n_layers_in_prelude": 1,
            "n_layers_in_recurrent_block": layers, "n_layers_in_coda": 1, "mean_recurrence": s.loops,
            "torch_dtype": "bfloat16"}


def _nanbeige_config(s: Shape, layers: int) -> dict:
    return {"hidden_size": s.d_model, "intermediate_size": s.mlp, "num_hidden_layers": layers,
            "num_attention_heads": s.heads, "num_key_value_heads": s.kv_heads, "head_dim": s.head_dim,
            "vocab_size": s.vocab, "num_loops": s.loops, "max_position_embeddings": 4096, "rope_theta": 70000000.0,
            "torch_dtype": "bfloat16"}


#: ``--smoke``: the builders' own tiny defaults (d_model 32, vocab 300, 4 loops, 2 loop-block layers), tiny sizes
#: (Huginn at one size: the same code path, half the time).
_TINY = {"config": lambda s, n: {}, "layers": 2, "tokens": (32, 128), "seq_len": 8, "batch": 8, "chunk": 16}

#: The models (published shapes: Ouro-1.4B config.json; Huginn-0125 config.json; Nanbeige4.2-3B config.json). A new
#: model is one row here.
SHAPES: dict[str, Shape] = {
    "ouro": Shape("ouro", "ouro", "build_ouro", d_model=2048, heads=16, vocab=49152, loops=4, mlp=5632,
                  published=(0, 24, 0), layers=1, config=_ouro_config, tokens=(2048, 8192, 32768), seq_len=64,
                  batch=16, chunk=128,
                  smoke=dict(_TINY, d_model=32, heads=4, vocab=300, loops=4, mlp=64)),
    # Random-init weights (the builder's N(0, 0.1²) jitter at d 5280) make the 32-loop map chaotic: bfloat16
    # rounding of the batched run against the model's own forward grows past the exit check's tolerance, so it is
    # off here (it checks numerics, which this cost benchmark does not measure).
    "huginn": Shape("huginn", "huginn", "build_huginn", d_model=5280, heads=55, vocab=65536, loops=32, mlp=17920,
                    published=(2, 4, 2), layers=1, config=_huginn_config, tokens=(128, 512, 2048), seq_len=8,
                    batch=32, chunk=8, injection=2 * 5280 * 5280, exit_layers=2, verify_exit=False,
                    smoke=dict(_TINY, d_model=32, heads=2, vocab=300, loops=4, mlp=64, injection=2 * 32 * 32,
                               tokens=(32,))),
    # GQA 48 / 8 heads of width 128 (queries 6144 wide against d 3072); the final norm after every loop. At T = 2
    # the gates decide at loop 1 only, where kl_prev is undefined (the gates stage refuses a statistic with no
    # finite value) and the 'utility' labels (I_t, t >= 2, ouro alignment) have no row: the LM profile's gates
    # and statistics less those.
    "nanbeige": Shape("nanbeige", "nanbeige", "build_nanbeige", d_model=3072, heads=48, vocab=166144, loops=2,
                      mlp=10752, published=(0, 22, 0), layers=1, config=_nanbeige_config, tokens=(2048, 8192, 32768),
                      seq_len=64, batch=8, chunk=128, kv_heads=8, head_dim=128,
                      params={"gates": {"stats": ["entropy", "max_prob", "margin", "rel_step"],
                                        "gates": ["logreg-oracle", "logreg-consistent", "mlp-oracle", "mlp-consistent",
                                                  "ponder-linear", "ponder-mlp", "logreg-converged"]}},
                      smoke=dict(_TINY, d_model=32, heads=4, kv_heads=2, head_dim=16, vocab=300, loops=2, mlp=64,
                                 layers=3, tokens=(32,))),
}

#: Models named by ``--model`` that cannot run yet: one line each (say what is missing and what to add).
PENDING: dict[str, str] = {}


# ----------------------------------------------------------------------------------------------
# Fresh processes: fork after the imports, one per stage
# ----------------------------------------------------------------------------------------------

def _status_kb(key: str) -> int:
    """A ``/proc/self/status`` field in KiB (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {key}")


def _reset_peak() -> None:
    """Reset VmHWM (the peak RSS) to the current RSS: Linux ``clear_refs`` 5."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def forked(fn: Callable[[dict], dict], spec: dict, log: Path) -> dict:
    """``fn(spec)`` in a child forked from this process (its stdout to ``log``, stderr to ours); its result dict.

    The parent has imported the stage modules but runs nothing in torch, polars or zarr, so the child starts with
    no thread pools and a peak RSS that is its own once reset.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        code = 0
        try:
            os.close(r)
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 1)
            out = json.dumps(fn(spec)).encode()
            with os.fdopen(w, "wb") as pipe:
                pipe.write(out)
        except BaseException:  # noqa: BLE001 - reported on stderr, exit status 1
            traceback.print_exc()
            code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as pipe:
        data = pipe.read()
    _, status = os.waitpid(pid, 0)
    if status != 0 or not data:
        tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
        raise RuntimeError(f"{spec.get('what', fn.__name__)} failed (exit status {status >> 8}; its traceback on "
                           f"stderr above; its stdout, {log}):\n{tail}")
    return json.loads(data)


class _Opens:
    """Files under ``root`` opened for reading, counted per open (an audit hook: zarr's and the manifest's reads)."""

    def __init__(self, root: Path):
        self.root = str(root)
        self.count: Counter[str] = Counter()
        self.size: dict[str, int] = {}  # at the open (claims and staging files are gone by the end)

    def __call__(self, event: str, args: tuple) -> None:
        if event != "open":
            return
        path, mode = args[0], args[1]
        if isinstance(path, str | os.PathLike) and (mode is None or "r" in str(mode)) and \
                str(path).startswith(self.root) and os.path.isfile(path):
            path = os.fspath(path)
            self.count[path] += 1
            self.size[path] = os.path.getsize(path)


def _measured(call: Callable[[], Any], root: Path) -> dict:
    """Wall, CPU, peak RSS (reset first) and files opened of ``call()`` in this (fresh) process."""
    opens = _Opens(root)
    sys.addaudithook(opens)  # cannot be removed: only ever in a forked child
    _reset_peak()
    rss0 = _status_kb("VmRSS")
    c0, t0 = time.process_time(), time.perf_counter()
    call()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    peak = _status_kb("VmHWM")
    files = {f: n for f, n in opens.count.items() if os.path.isfile(f)}  # still there: what the read re-reads
    return {"wall": wall, "cpu": cpu, "peak_mib": peak / 1024, "grow_mib": (peak - rss0) / 1024, "files": files,
            "bytes_read": sum(opens.size[f] * n for f, n in opens.count.items()),
            "bytes_distinct": sum(opens.size[f] for f in opens.count)}


# ----------------------------------------------------------------------------------------------
# Children
# ----------------------------------------------------------------------------------------------

def build_child(spec: dict) -> dict:
    """Save the checkpoint with the adapter tests' builder, weights made in bfloat16 (half the memory of float32:
    the builder casts to ``dtype`` anyway)."""
    import torch

    from tests import hf_helpers

    torch.set_num_threads(spec["threads"])
    t0 = time.perf_counter()
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        getattr(hf_helpers, spec["builder"])(Path(spec["path"]), dtype=torch.bfloat16, **spec["config"])
    finally:
        torch.set_default_dtype(prev)
    return {"seconds": time.perf_counter() - t0}


def dump_child(spec: dict) -> dict:
    """What the dump entry runs with ``dump.adapter`` (load, then :func:`dump_text_model`), timed apart; then the
    bare forward over the same batches when ``spec['bare']``."""
    import torch

    from looptrace.capture.dump import DumpConfig, bare_forward
    from looptrace.capture.dump_text import dump_text_model
    from looptrace.config import load_base, load_section
    from looptrace.models.adapters.loading import load_adapter
    from looptrace.tasks.text import text_dataset

    params = [Path(spec["params"])]
    base = load_base(params)
    cfg = load_section(DumpConfig, "dump", params, required=True)
    torch.set_num_threads(base.threads)
    t0 = time.perf_counter()
    adapter = load_adapter(cfg.adapter, device=base.device)
    load_s = time.perf_counter() - t0
    assert cfg.text is not None and cfg.adapter is not None
    data, _ = text_dataset(cfg.text, cfg.sequences, cfg.adapter.path, adapter.info.vocab_size, True)
    batches = [torch.from_numpy(b.tokens[i:i + cfg.batch_size]) for b in data.values()
               for i in range(0, len(b.tokens), cfg.batch_size)]
    bare_forward(adapter, [batches[0][:1]])  # warm-up (kernels, allocator) on one sequence: paid by neither
    if spec.get("profile"):  # where the dump's time goes (a store of its own, not the measured one)
        return _profiled(lambda: dump_text_model(adapter, cfg, Path(spec["root"]) / "dump-profile" / spec["model"],
                                                 base, progress=False))
    out = Path(spec["root"]) / "dump" / spec["model"]
    res = _measured(lambda: dump_text_model(adapter, cfg, out, base, progress=False), Path(spec["root"]))
    res.update(load_s=load_s, store_bytes=_dir_bytes(out), per_array=_array_bytes(out))
    if spec["bare"]:
        c0, t0 = time.process_time(), time.perf_counter()
        bare_forward(adapter, batches)
        res["bare_s"], res["bare_cpu"] = time.perf_counter() - t0, time.process_time() - c0
    res.pop("files")
    return res


def _entry_kwargs(main: Callable, given: dict) -> dict:
    """Every argument of a stage entry: ``given``, else the Typer option's default (what the CLI passes)."""
    out = {}
    for name, p in inspect.signature(main).parameters.items():
        if name in given:
            out[name] = given[name]
            continue
        default = getattr(p.default, "default", p.default)
        if default is ... or default is inspect.Parameter.empty:
            raise TypeError(f"stage entry {main.__module__}: no value for required option {name!r}")
        out[name] = default
    return out


def stage_args(stage: str, model: str, root: Path, params: Path) -> dict:
    """The LM profile's arguments of each stage entry (profiles/lm/dvc.yaml, with this run's roots)."""
    common = {"params": [params]}
    return {
        "geometry": {"model": model, "dump_root": root / "dump", "out": root / "geometry"},
        "readouts": {"model": model, "geometry_root": root / "geometry", "out": root / "readouts"},
        "gates": {"models": model, "dump_root": root / "dump", "out": root / "gates"},
        "diagnose": {"models": model, "readouts_root": root / "readouts", "gates_root": root / "gates",
                     "geometry_root": root / "geometry", "dump_root": root / "dump",
                     "loopmap_root": root / "loopmap", "out": root / "diagnose"},
        "report": {"models": model, "root": root, "out": root / "report"},
    }[stage] | common


def _entry(stage: str) -> Callable:
    from looptrace.stages import registered

    return {s.name: s for s in registered()}[stage].main


def stage_child(spec: dict) -> dict:
    """One stage entry, measured (:func:`_measured`); with ``spec['profile']`` a cProfile summary instead."""
    root = Path(spec["root"])
    main = _entry(spec["stage"])
    kwargs = _entry_kwargs(main, stage_args(spec["stage"], spec["model"], root, Path(spec["params"])))
    if spec.get("profile"):
        return _profiled(lambda: main(**kwargs))
    out = _measured(lambda: main(**kwargs), root)
    metrics = root / spec["stage"] / "metrics.json"
    if spec["stage"] == "gates" and metrics.is_file():  # the stage's own split of its wall (streaming vs fitting)
        out["phases"] = json.loads(metrics.read_text()).get("phase_seconds") or {}
    return out


def streaming_wall(stage: str, s: dict) -> float:
    """The wall of a stage's passes over the store: the whole stage, or for gates its streaming phases (the fit
    subsample's read, PCA and features; scoring val and test), without the fitting on the gathered rows."""
    ph = s.get("phases") or {}
    if stage == "gates" and ph:
        return float(ph["read_and_features"] + ph["score"])
    return float(s["wall"])


def _profiled(call: Callable[[], Any], top: int = 10) -> dict:
    """Wall of ``call()`` under cProfile and its ``top`` functions by self time."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.runcall(call)
    wall = time.perf_counter() - t0
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    return {"wall": wall, "profile": _profile_lines(buf.getvalue())}


def _profile_lines(text: str) -> list[str]:
    """The rows of a pstats table (tottime, cumtime, function), paths shortened to the package."""
    rows = []
    for line in text.splitlines():
        parts = line.split(None, 5)
        try:
            float(parts[1]), float(parts[3])
        except (IndexError, ValueError):
            continue
        if len(parts) == 6 and parts[0].replace("/", "").isdigit():
            where = parts[5]
            for cut in ("site-packages/", "pipeline/"):
                if cut in where:
                    where = where.split(cut, 1)[1]
            rows.append(f"{float(parts[1]):7.2f} s self {float(parts[3]):7.2f} s cum  {where}")
    return rows


def read_child(spec: dict) -> dict:
    """The physical limit of one stage: one decompressing read of exactly the files it opened, nothing computed
    (each zarr chunk decoded once, each Parquet table read, each JSON parsed, any other file's bytes)."""
    import numpy as np
    import polars as pl
    import zarr

    chunks: dict[str, set[tuple[int, ...]]] = {}
    other: list[str] = []
    for f in spec["files"]:
        head, sep, tail = f.rpartition("/c/")
        if sep and os.path.isfile(os.path.join(head, "zarr.json")):
            chunks.setdefault(head, set()).add(tuple(int(i) for i in tail.split("/")))
        else:
            other.append(f)
    t0 = time.perf_counter()
    n = 0
    for arr_path, blocks in chunks.items():
        arr = zarr.open_array(arr_path, mode="r")
        for b in sorted(blocks):
            n += np.asarray(arr.get_block_selection(b)).nbytes
    for f in other:
        if f.endswith(".parquet"):
            pl.read_parquet(f)
        elif f.endswith(".json"):
            with open(f) as fh:
                json.load(fh)
        else:
            with open(f, "rb") as fh:
                fh.read()
    return {"wall": time.perf_counter() - t0, "decoded_bytes": n, "arrays": len(chunks), "other_files": len(other)}


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def _array_bytes(model_dir: Path) -> dict[str, dict[str, float]]:
    """Per array of the stores with a ``token`` axis: bytes on disk (all splits), raw bytes per token (zarr
    metadata) and tokens; ``_other``: the disk bytes of the rest (loop_group, chunk markers and digests)."""
    out: dict[str, dict[str, float]] = {"_other": {"disk": 0.0, "raw_per_token": 0.0, "tokens": 0.0}}
    for store in sorted(Path(model_dir).glob("*.zarr")):
        for meta in sorted(store.glob("*/zarr.json")):
            m = json.loads(meta.read_text())
            if m.get("node_type") != "array":
                continue
            shape = m["shape"]
            disk = _dir_bytes(meta.parent / "c") if (meta.parent / "c").exists() else 0
            if not shape or (m.get("dimension_names") or [None])[0] != "token":
                out["_other"]["disk"] += disk
                continue
            row = out.setdefault(meta.parent.name, {
                "disk": 0.0, "raw_per_token": float(math.prod(shape[1:]) * _itemsize(m["data_type"])), "tokens": 0.0})
            row["disk"] += disk
            row["tokens"] += shape[0]
    return out


def _itemsize(dtype: Any) -> int:
    name = dtype if isinstance(dtype, str) else dtype.get("name", "")
    return {"float64": 8, "int64": 8, "uint64": 8, "float32": 4, "int32": 4, "uint32": 4, "float16": 2,
            "bfloat16": 2, "uint16": 2, "int16": 2, "uint8": 1, "int8": 1, "bool": 1}.get(name, 0)


# ----------------------------------------------------------------------------------------------
# One model
# ----------------------------------------------------------------------------------------------

def write_params(path: Path, shape: Shape, ckpt: Path, corpus: Path, n_tokens: int) -> dict[str, int]:
    """The LM profile merged with this run's checkpoint, corpus and sizes (fit:val:test = 2:1:1 sequences)."""
    import yaml

    from looptrace.config import read_params

    seqs = max(4, n_tokens // shape.seq_len)
    sequences = {"fit": seqs - 2 * (seqs // 4), "val": seqs // 4, "test": seqs // 4}
    p = read_params([REPO / "params.yaml", REPO / "profiles" / "lm" / "params.yaml"])
    p["base"]["threads"] = THREADS
    p["dump"]["adapter"].update(kind=shape.kind, path=str(ckpt), name=shape.name, dtype="bfloat16",
                                trust_remote_code=True, verify_exit=shape.verify_exit)
    p["dump"]["text"].update(path=str(corpus), seq_len=shape.seq_len)
    p["dump"].update(sequences=sequences, batch_size=shape.batch, chunk_tokens=shape.chunk)
    for section, keys in shape.params.items():
        p[section].update(keys)
    path.write_text(yaml.safe_dump(p, sort_keys=False))
    return sequences


THREADS = 2


def run_model(shape: Shape, sizes: list[int], work: Path, profile: bool, profile_dump: bool) -> dict:
    """Build the checkpoint, then dump and run every stage at each size; the per-size measurements."""
    from tests import hf_helpers

    ckpt = work / "ckpt" / f"{shape.name}-L{shape.layers}-d{shape.d_model}"
    cfg = shape.config(shape, shape.layers)
    if not (ckpt / "model.safetensors").exists() or json.loads((ckpt / "config.json").read_text()).get(
            "vocab_size") != cfg.get("vocab_size", hf_helpers.VOCAB):
        shutil.rmtree(ckpt, ignore_errors=True)
        b = forked(build_child, {"what": f"{shape.name}: building the checkpoint", "builder": shape.builder,
                                 "path": str(ckpt), "config": cfg, "threads": THREADS}, work / "build.log")
        print(f"  checkpoint built in {b['seconds']:.1f} s ({_dir_bytes(ckpt) / 1e9:.2f} GB, bfloat16)", flush=True)
    else:
        print(f"  checkpoint reused: {ckpt}", flush=True)
    docs = max(60, 3 * max(sizes) // 8)  # ~25 tokens per document, a third of them per split: 3x the largest size
    corpus = work / f"corpus-{docs}.jsonl"
    if not corpus.exists():
        hf_helpers.corpus(corpus, n=docs, seed=0)
    rows = []
    for n in sizes:
        root = work / shape.name / f"n{n}"
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        params = root / "params.yaml"
        seqs = write_params(params, shape, ckpt, corpus, n)
        spec = {"params": str(params), "root": str(root), "model": shape.name}
        d = forked(dump_child, {**spec, "what": f"{shape.name} N={n}: dump", "bare": n == max(sizes)},
                   root / "dump.log")
        tokens = int(d["per_array"]["target"]["tokens"])
        row = {"n": n, "tokens": tokens, "sequences": seqs, "dump": d, "stages": {}}
        print(f"  N={n}: {tokens} scored tokens ({seqs['fit']}/{seqs['val']}/{seqs['test']} sequences of "
              f"{shape.seq_len}); dump {d['wall']:.1f} s (load {d['load_s']:.1f} s apart), store "
              f"{d['store_bytes'] / 1e6:.1f} MB" + (f"; bare forward {d['bare_s']:.1f} s" if "bare_s" in d else ""),
              flush=True)
        for stage in STAGES:
            s = forked(stage_child, {**spec, "stage": stage, "what": f"{shape.name} N={n}: {stage}"},
                       root / f"{stage}.log")
            r = forked(read_child, {"files": sorted(s.pop("files")), "what": f"{shape.name} N={n}: read of {stage}"},
                       root / f"{stage}.read.log")
            s["read"] = r
            row["stages"][stage] = s
            print(f"    {stage:9s} {s['wall']:7.2f} s, read {s['bytes_read'] / 1e6:8.1f} MB in {r['wall']:6.2f} s, "
                  f"peak RSS {s['peak_mib']:6.0f} MiB", flush=True)
        if profile_dump and n == min(sizes):  # the dump's profile at the smallest size (a whole extra dump)
            what = f"{shape.name} N={n}: dump (profile)"
            row.setdefault("profiles", {})["dump"] = forked(dump_child, {**spec, "what": what, "profile": True},
                                                            root / "dump.prof.log")
        if profile and n == max(sizes):
            for stage in STAGES:
                pr = forked(stage_child, {**spec, "stage": stage, "profile": True,
                                          "what": f"{shape.name} N={n}: {stage} (profile)"}, root / f"{stage}.prof.log")
                row.setdefault("profiles", {})[stage] = pr
        rows.append(row)
    return {"shape": shape, "rows": rows, "ckpt_bytes": _dir_bytes(ckpt)}


# ----------------------------------------------------------------------------------------------
# Figures and the table
# ----------------------------------------------------------------------------------------------

def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of log y on log x (the cost exponent)."""
    lx, ly = [math.log(x) for x in xs], [math.log(max(y, 1e-9)) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    den = sum((x - mx) ** 2 for x in lx)
    return sum((x - mx) * (y - my) for x, y in zip(lx, ly, strict=True)) / den if den else float("nan")


def _mark(ok: bool | None) -> str:
    return "" if ok is None else ("ok" if ok else "MISSED")


def report_model(res: dict) -> tuple[list[str], bool]:
    """The per-stage table of one model, its summary against the targets, and whether every target holds."""
    shape: Shape = res["shape"]
    rows = res["rows"]
    T, d = shape.loops, shape.d_model
    lines = [f"{'N':>6} {'tokens':>6} {'stage':9} {'wall s':>8} {'cpu s':>7} {'tok·loop/s':>10} {'read MB':>9} "
             f"{'peak RSS MiB':>12} {'(+stage)':>8} {'read s':>7} {'stage/read':>10}"]
    for r in rows:
        dm = r["dump"]
        tl = r["tokens"] * T
        lines.append(f"{r['n']:6d} {r['tokens']:6d} {'dump':9} {dm['wall']:8.2f} {dm['cpu']:7.1f} "
                     f"{tl / dm['wall']:10.0f} {0:9.1f} {dm['peak_mib']:12.0f} {dm['grow_mib']:8.0f} "
                     f"{dm.get('bare_s', float('nan')):7.2f} "
                     f"{(dm['wall'] / dm['bare_s']) if 'bare_s' in dm else float('nan'):10.2f}")
        for st, s in r["stages"].items():
            lines.append(f"{'':6} {'':6} {st:9} {s['wall']:8.2f} {s['cpu']:7.1f} {tl / s['wall']:10.0f} "
                         f"{s['bytes_read'] / 1e6:9.1f} {s['peak_mib']:12.0f} {s['grow_mib']:8.0f} "
                         f"{s['read']['wall']:7.2f} {s['wall'] / max(s['read']['wall'], 1e-9):10.2f}")
    lines.append("  (dump row: read s = the bare forward over the same batches, stage/read = dump / bare; "
                 "+stage = peak RSS above the RSS at the stage's start)")
    ok = True
    toks = [r["tokens"] for r in rows]
    lines.append(f"{'stage':9} {'exponent':>8} {'':6} {'(CPU)':>6} {'(2 max)':>7} {'RSS ratio':>9} {'':6} "
                 f"{'stream/read at N max':>19} {'':6}")
    for st in ("dump", *STAGES):
        get = (lambda r, st=st: r["dump"]) if st == "dump" else (lambda r, st=st: r["stages"][st])
        e = slope(toks, [get(r)["wall"] for r in rows]) if len(rows) >= 2 else float("nan")
        e_cpu = slope(toks, [get(r)["cpu"] for r in rows]) if len(rows) >= 2 else float("nan")
        # the exponent between the two largest sizes: the per-token work, once the fixed costs are amortised
        e_top = slope(toks[-2:], [get(r)["wall"] for r in rows[-2:]]) if len(rows) >= 3 else float("nan")
        rss = get(rows[-1])["peak_mib"] / get(rows[0])["peak_mib"]
        e_ok = TARGETS["exponent"][0] <= e <= TARGETS["exponent"][1] if len(rows) >= 2 else None
        rss_ok = rss <= TARGETS["rss_ratio"]
        if st == "dump":
            dm = rows[-1]["dump"]
            ratio = dm["wall"] / dm["bare_s"] if "bare_s" in dm else float("nan")
            r_ok: bool | None = ratio <= TARGETS["dump/bare"] if "bare_s" in dm else None
        else:
            s = rows[-1]["stages"][st]
            ratio = streaming_wall(st, s) / max(s["read"]["wall"], 1e-9)
            r_ok = ratio <= TARGETS["stream/read"] if st in STREAMING else None
        ok &= (e_ok is not False) and rss_ok and (r_ok is not False)
        lines.append(f"{st:9} {e:8.2f} {_mark(e_ok):6} {e_cpu:6.2f} {e_top:7.2f} {rss:9.2f} {_mark(rss_ok):6} {ratio:19.2f} "
                     f"{_mark(r_ok):6}")
    big = rows[-1]
    for r in rows:
        ph = r["stages"].get("gates", {}).get("phases")
        if ph:
            lines.append(f"gates at N={r['n']}: read + PCA + features {ph['read_and_features']:.2f} s, scoring val and "
                         f"test {ph['score']:.2f} s (streaming: {streaming_wall('gates', r['stages']['gates']):.2f} s "
                         f"= {streaming_wall('gates', r['stages']['gates']) / max(r['stages']['gates']['read']['wall'], 1e-9):.2f}"
                         f" x the read), fitting {ph['gate_fit']:.2f} s, evaluation {ph['evaluate']:.2f} s")
    if "bare_cpu" in big["dump"]:  # CPU seconds: the ratio that a loaded machine disturbs least
        lines.append(f"dump / bare forward at N={big['n']}: wall {big['dump']['wall'] / big['dump']['bare_s']:.2f}, "
                     f"CPU {big['dump']['cpu'] / big['dump']['bare_cpu']:.2f}")
    per_tl = big["dump"]["store_bytes"] / (big["tokens"] * T)
    lines.append(f"store on disk: {per_tl:,.0f} bytes per token·loop ({big['dump']['store_bytes'] / 1e6:.1f} MB for "
                 f"{big['tokens']} tokens x T = {T}) = {per_tl / (2 * d):.3f} x raw bfloat16 states (2·d = {2 * d} B)")
    lines.append(f"targets: exponent in [{TARGETS['exponent'][0]}, {TARGETS['exponent'][1]}] (on the three sizes; "
                 f"'(2 max)': between the two largest), RSS ratio (largest / "
                 f"smallest N) ≤ {TARGETS['rss_ratio']}, streaming passes ({', '.join(STREAMING)}: for gates its read, PCA, "
                 f"feature and scoring passes, not the fitting) ≤ "
                 f"{TARGETS['stream/read']} x the read, dump / bare ≤ {TARGETS['dump/bare']}")
    for r in rows:
        for st, pr in (r.get("profiles") or {}).items():
            lines.append(f"profile of {st} at N={r['n']} (cProfile, {pr['wall']:.2f} s with the profiler; by self "
                         "time):")
            lines.extend("    " + ln for ln in pr["profile"])
    return lines, ok


def storage_lines(shape: Shape, per: dict, n: int) -> list[str]:
    """Per 1M scored tokens, the store under each storage choice: the default store as dumped (raw from the zarr
    metadata, on disk as measured: ``per`` of :func:`_array_bytes` over ``n`` tokens) and the other choices from
    their raw sizes (states dtype, per-layer states, top-k, full logits)."""
    T, d, V = shape.loops, shape.d_model, shape.vocab
    raw = {k: v["raw_per_token"] for k, v in per.items() if k != "_other"}
    disk = {k: v["disk"] / n for k, v in per.items()}  # the markers and digests too: bytes of the store
    states = ("hidden", "hidden_init")
    rest_raw = sum(v for k, v in raw.items() if k not in states and k not in ("topk_ids", "topk_logits"))
    topk_raw = raw.get("topk_ids", 0) + raw.get("topk_logits", 0)
    k = int(round(raw.get("topk_ids", 0) / (4 * T))) if "topk_ids" in raw else 0
    state_raw = (T + 1) * d
    gb = 1e6 / 1e9
    return [f"capacity per 1M scored tokens, {shape.name} (published shape: d {d}, T = {T}, vocab {V}):",
            f"  default store (bfloat16 states + top-{k} logits + statistics): raw {(sum(raw.values())) * gb:,.1f} "
            f"GB, on disk {sum(disk.values()) * gb:,.1f} GB (measured compression of these random-init states)",
            f"  states (T + 1 = {T + 1} x d per token): bfloat16/float16 {2 * state_raw * gb:,.1f} GB, float32 "
            f"{4 * state_raw * gb:,.1f} GB; per extra looped layer (dump.layers) {2 * T * d * gb:,.1f} GB",
            f"  logits: top-{k} {topk_raw * gb:,.2f} GB, top-64 {T * 64 * 8 * gb:,.2f} GB, full float32 "
            f"(full_logits_max_vocab ≥ {V}) {T * V * 4 * gb:,.1f} GB; statistics + token fields {rest_raw * gb:,.2f} GB"]


def capacity(res: dict) -> list[str]:
    """Per 1M scored tokens: the store under each storage choice, each stage's time (extrapolated linearly from the
    largest size), and the dump on one H100 (FLOP estimate)."""
    shape: Shape = res["shape"]
    big = res["rows"][-1]
    n = big["tokens"]
    lines = [*storage_lines(shape, big["dump"]["per_array"], n),
             f"  each stage per 1M tokens on this machine, extrapolated linearly from the {n}-token run (CPU h of "
             "its process, wall h; the cost exponent measured across the sizes beside it):"]
    toks = [r["tokens"] for r in res["rows"]]
    for st in ("dump", *STAGES):
        get = (lambda r, st=st: r["dump"]) if st == "dump" else (lambda r, st=st: r["stages"][st])
        s = get(big)
        e = slope(toks, [get(r)["wall"] for r in res["rows"]]) if len(toks) >= 2 else float("nan")
        lines.append(f"    {st:9} CPU {s['cpu'] * 1e6 / n / 3600:8.2f} h, wall {s['wall'] * 1e6 / n / 3600:8.2f} h "
                     f"(exponent {e:.2f})")
    f = shape.flops_per_token(shape.seq_len)
    lines.append(f"  dump on one H100 (estimate, published layer count): {f / 1e9:.1f} GFLOP/token x 1e6 / "
                 f"({H100_BF16 / 1e12:.0f} TFLOP/s x MFU {H100_MFU}) = {f * 1e6 / (H100_BF16 * H100_MFU):.0f} s")
    return lines


# ----------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------

#: Modules the stages import inside their functions (seconds each: sklearn, skops, torch's compiler stack that
#: torch.optim pulls in, matplotlib, plotly, scipy), imported before forking: a stage's time is its work, as in a
#: long-lived process, not the interpreter's first import (which a fresh `dvc repro` process pays once per stage).
LAZY_IMPORTS = ("sklearn.decomposition", "sklearn.linear_model", "sklearn.neural_network", "sklearn.metrics",
                "sklearn.preprocessing", "skops.io", "scipy.stats", "scipy.special", "torch.optim", "torch._dynamo",
                "plotly.graph_objects", "plotly.subplots", "plotly.offline")


def _warm_imports() -> None:
    import importlib

    import matplotlib

    matplotlib.use("Agg")  # as the report's figures do
    importlib.import_module("matplotlib.pyplot")
    for name in LAZY_IMPORTS:
        importlib.import_module(name)


def main(argv: list[str] | None = None) -> int:
    global THREADS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="all", choices=(*SHAPES, *PENDING, "all"))
    ap.add_argument("--tokens", type=int, nargs="+", default=None, help="sizes (scored tokens, all splits); "
                    "default: the model's row of SHAPES (three sizes growing 4x)")
    ap.add_argument("--layers", type=int, default=None, help="layers inside the loop block (default: the row's)")
    ap.add_argument("--threads", type=int, default=2, help="base.threads (torch threads of the dump)")
    ap.add_argument("--workdir", type=Path, default=None, help="keep checkpoints, stores and outputs here (a "
                    "checkpoint of the same shape is reused); default: a temporary directory, removed")
    ap.add_argument("--profile", action="store_true", help="also a cProfile run of each offline stage at the "
                    "largest size (untimed): where its time goes")
    ap.add_argument("--profile-dump", action="store_true", help="also a cProfile run of the dump at the smallest "
                    "size (a whole extra dump)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes and sizes (about a minute): does it still run "
                    "(tests/test_benchmarks.py); targets not enforced")
    args = ap.parse_args(argv)
    THREADS = args.threads
    if args.model in PENDING:
        print(f"--model {args.model}: {PENDING[args.model]}", file=sys.stderr)
        return 2
    if not Path("/proc/self/clear_refs").exists():
        print("benchmarks/lm_scale.py needs Linux (/proc/self/clear_refs resets the peak RSS per stage)",
              file=sys.stderr)
        return 2
    names = list(SHAPES) if args.model == "all" else [args.model]
    shapes = []
    for name in names:
        s = SHAPES[name]
        if args.smoke:
            s = replace(s, **s.smoke)
        if args.layers:
            s = replace(s, layers=args.layers)
        shapes.append(s)
    # Import every stage entry now (torch, polars, zarr, matplotlib, ...): each forked child starts from here.
    from looptrace.models.adapters.kinds import KINDS
    from looptrace.stages import registered

    registered()
    _warm_imports()
    for s in shapes:
        KINDS[s.kind]  # an unknown kind: one line from the registry
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    print(f"# looptrace benchmarks/lm_scale.py — {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {platform.node()}, {cpu}, "
          f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; command: python benchmarks/lm_scale.py "
          f"{' '.join(argv if argv is not None else sys.argv[1:])}")
    if args.model == "all":
        for name, why in PENDING.items():
            print(f"# {name}: not run — {why}")
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="looptrace-lm-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    ok = True
    t_start = time.perf_counter()
    try:
        for s in shapes:
            sizes = sorted(args.tokens or s.tokens)
            pub = "+".join(str(x) for x in s.published)
            print(f"\n== {s.name}: d_model {s.d_model}, {s.heads} heads, vocab {s.vocab}, T = {s.loops} loops; "
                  f"{s.layers} layer(s) in the loop block here ({pub} published prelude+block+coda; here "
                  f"{'0' if not s.published[0] else '1'}+{s.layers}+{'0' if not s.published[2] else '1'}), bfloat16; "
                  f"sizes {sizes} tokens, seq_len {s.seq_len}, batch {s.batch} sequences, chunk {s.chunk} tokens, "
                  f"{THREADS} threads ==", flush=True)
            res = run_model(s, sizes, work, args.profile, args.profile_dump)
            lines, good = report_model(res)
            ok &= good
            print("\n".join(lines))
            print("\n".join(capacity(res)), flush=True)
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    print(f"\n# total {time.perf_counter() - t_start:.0f} s wall; every target met: {ok}")
    return 0 if ok or args.smoke else 1


if __name__ == "__main__":
    sys.exit(main())
