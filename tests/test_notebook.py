"""notebooks/explore.ipynb executes (nbclient, the venv's kernel) on a tiny pipeline's outputs (the
``tiny_artifacts`` fixture, looptrace.testing.tiny_artifacts), and its user-written exit rule gives the
depth/accuracy an explicit per-token loop gives."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]


def test_notebook_executes_and_user_rule_is_right(tiny_artifacts, monkeypatch):
    import nbclient
    import nbformat
    from looptrace.io.store import open_store

    for k, v in {"LOOPTRACE_ARTIFACTS": str(tiny_artifacts), "LOOPTRACE_MODEL": "rs-tiny",
                 "LOOPTRACE_SPLIT": "test", "LOOPTRACE_TOKEN": "7"}.items():
        monkeypatch.setenv(k, v)  # inherited by the kernel process
    nb = nbformat.read(REPO / "notebooks" / "explore.ipynb", as_version=4)
    nbclient.NotebookClient(nb, timeout=120, kernel_name="python3",
                            resources={"metadata": {"path": str(REPO / "notebooks")}}).execute()
    texts = [o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
             if o.output_type == "stream" and o.get("name") == "stdout"]
    result = json.loads(next(line for t in texts for line in t.splitlines() if line.startswith('{"rule": "my_rule"')))
    assert sum(1 for c in nb.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})) == 2

    # Independent check: the threshold is one of the 51 val percentiles of max_prob, and at it the rule
    # "max_prob ≥ γ and argmax_t = argmax_{t−1}" exits where an explicit per-token loop says.
    val, test = (open_store(tiny_artifacts / "dump" / "rs-tiny" / f"{s}.zarr") for s in ("val", "test"))
    grid = np.percentile(val.read("max_prob").astype(np.float64).ravel(), np.linspace(0.5, 99.5, 51))
    g = result["chosen_threshold"]
    assert np.isclose(grid, g, rtol=0, atol=1e-12).any()
    mp, am, y = test.read("max_prob").astype(np.float64), test.read("argmax"), test.read("target")
    T = test.n_loops
    depths, correct = [], []
    for i in range(test.n_tokens):
        d = next((t + 1 for t in range(1, T) if mp[i, t] >= g and am[i, t] == am[i, t - 1]), T)
        depths.append(d)
        correct.append(am[i, d - 1] == y[i])
    assert result["n_test_tokens"] == test.n_tokens == 120
    assert result["test_depth"] == pytest.approx(np.mean(depths), abs=1e-12)
    assert result["test_accuracy"] == pytest.approx(np.mean(correct), abs=1e-12)
    assert result["full_depth_accuracy"] == pytest.approx(np.mean(am[:, -1] == y), abs=1e-12)
