"""Every benchmark in benchmarks/ still runs: a tiny-size smoke run of each (seconds; ``--smoke`` sets the sizes and
does not enforce the timing targets, which mean nothing at that size). A benchmark that fails shows its own error,
its child processes' tracebacks included (they write to the benchmark's stderr)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.builders import tiny_checkpoint, tiny_model, tiny_task
from tests.conftest import REPO

pytestmark = pytest.mark.slow  # subprocesses that import torch: in `make test`, not in the floors' fast suite

BENCH = REPO / "benchmarks"

#: benchmark -> its smoke arguments (latency's are added by its test: it reads an artifacts tree).
SMOKE = {"contraction.py": ["--smoke"], "contraction_hf.py": ["--smoke"], "dump.py": ["--smoke"], "dump_hf.py": ["--smoke"], "heads.py": ["--smoke"], "generate.py": ["--smoke"],
         "gpu.py": ["--smoke"], "lm_scale.py": ["--smoke"],
         "geometry.py": ["--smoke"], "latency.py": [], "scale.py": ["--smoke"], "seeds.py": ["--smoke"],
         "train_step.py": ["--smoke"], "verify_read.py": ["--smoke"], "speculative_lm.py": ["--smoke"],
         "train_recipe.py": ["--tasks", "running_parity", "--recipe", "smoke", "steps=10", "warmup=2", "val_sequences=16",
                             "checkpoint_fractions=[]", "stop.every=5", "--evals", "2", "--test-sequences", "16"]}


def run_bench(name: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, str(BENCH / name), *args], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, f"{name} {' '.join(args)} failed ({res.returncode}):\n{res.stdout[-2000:]}\n" \
                                f"{res.stderr[-4000:]}"
    return res


def test_every_benchmark_has_a_smoke_run():
    assert sorted(p.name for p in BENCH.glob("*.py")) == sorted(SMOKE)


@pytest.mark.parametrize("name", sorted(n for n in SMOKE if n != "latency.py"))
def test_benchmark_smoke(name):
    out = run_bench(name, *SMOKE[name]).stdout
    assert out.strip(), f"{name} printed nothing"


def test_latency_benchmark_smoke(tiny_artifacts):
    """On the tiny artifacts tree (dump, geometry, readouts of one model) plus that model's checkpoint."""
    task = tiny_task(length=6)
    tiny_checkpoint(tiny_artifacts / "train", "rs-tiny", task, model=tiny_model(vocab=5, seq=6, loops=4))
    out = run_bench("latency.py", "--root", str(tiny_artifacts), "--models", "rs-tiny", "--rules", "top1",
                    "--batch", "8", "--bs1-sequences", "2", "--repeats", "1").stdout
    assert "rs-tiny" in out


def test_a_failing_child_shows_its_own_error(tmp_path):
    """geometry.py's child runs in a subprocess: its traceback reaches the benchmark's stderr (not swallowed)."""
    res = subprocess.run([sys.executable, str(BENCH / "geometry.py"), "--child", "stream", "--store",
                          str(tmp_path / "absent.zarr"), "--out", str(tmp_path / "out")], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode != 0 and "Traceback" in res.stderr
    # and the parent passes it through: the parent's stderr holds the child's traceback
    code = (f"import runpy; from pathlib import Path; g = runpy.run_path({str(BENCH / 'geometry.py')!r}, "
            "run_name='bench'); "
            f"g['_run_child']('stream', Path({str(tmp_path / 'absent.zarr')!r}), Path({str(tmp_path / 'o')!r}))")
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode != 0 and res.stderr.count("Traceback") >= 2, res.stderr[-2000:]


def test_lm_scale_figures():
    """The cost exponent and the H100 FLOP count of benchmarks/lm_scale.py against hand-computed values."""
    import runpy

    g = runpy.run_path(str(BENCH / "lm_scale.py"), run_name="lm_scale")
    assert g["slope"]([512, 2048, 8192], [1.5, 6.0, 24.0]) == pytest.approx(1.0)
    assert g["slope"]([1, 4, 16], [7.0, 7.0, 7.0]) == pytest.approx(0.0)
    # Ouro-1.4B at 64-token windows: N_layer = 4·2048² + 3·2048·5632 = 51,380,224; 2·(4·24·N_layer + 4·2048·49152)
    # = 10,670,309,376, plus attention 4·2048·32.5·96 = 25,559,040
    assert g["SHAPES"]["ouro"].flops_per_token(64) == 10_695_868_416
    # Nanbeige4.2-3B (GQA 48 / 8 heads of width 128): N_layer = 2·3072·6144 + 2·3072·1024 + 3·3072·10752
    # = 143,130,624; 2·(2·22·N_layer + 2·3072·166144) = 14,637,072,384, plus attention 4·6144·32.5·44 = 35,143,680
    assert g["SHAPES"]["nanbeige"].flops_per_token(64) == 14_672_216_064
