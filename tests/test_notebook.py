"""notebooks/explore.ipynb executes (nbclient, the venv's kernel) on a tiny pipeline's outputs, and its
user-written exit rule (registered with looptrace.rules.exit_rule, calibrated by the readouts code) gives the
threshold, depth and accuracy an explicit per-token loop gives."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]


def test_notebook_executes_and_user_rule_is_right(tiny_artifacts, monkeypatch):
    nbclient = pytest.importorskip("nbclient")  # the dev extra (absent in `make test-lowest`)
    nbformat = pytest.importorskip("nbformat")
    from looptrace.io.store.reader import open_store

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

    # Independent check: the grid is the 51 val percentiles of the rule's score (max_prob where argmax_t =
    # argmax_{t−1}, loops ≥ 2); the chosen threshold is the lowest-val-depth one within 0.5 points of full depth;
    # at it the rule "max_prob ≥ γ and argmax_t = argmax_{t−1}" exits where an explicit per-token loop says.
    val, test = (open_store(tiny_artifacts / "dump" / "rs-tiny" / f"{s}.zarr") for s in ("val", "test"))
    T = test.n_loops

    def exits(st, g):
        mp, am = st.read("max_prob").astype(np.float64), st.read("argmax")
        return np.array([next((t + 1 for t in range(1, T) if mp[i, t] >= g and am[i, t] == am[i, t - 1]), T)
                         for i in range(st.n_tokens)])

    vmp, vam, vy = val.read("max_prob").astype(np.float64), val.read("argmax"), val.read("target")
    grid = np.percentile(vmp[:, 1:][vam[:, 1:] == vam[:, :-1]], np.linspace(0.5, 99.5, 51))
    vd = [exits(val, g) for g in grid]
    vacc = np.array([np.mean(vam[np.arange(d.size), d - 1] == vy) for d in vd])
    vdepth = np.array([d.mean() for d in vd])
    ok = np.flatnonzero(vacc + 1e-12 >= np.mean(vam[:, -1] == vy) - 0.005)
    k = min(ok, key=lambda i: (vdepth[i], -vacc[i], i))
    assert result["chosen_threshold"] == grid[k]
    am, y = test.read("argmax"), test.read("target")
    depths = exits(test, grid[k])
    # token-level splits: only the positions whose context is test's are scored (lengths <= 4 are fit's only)
    from looptrace.tasks import IGNORE
    from tests.builders import tiny_task

    assert result["n_test_tokens"] == test.n_tokens == int((tiny_task(length=6).dataset("test", 20, 44).targets
                                                            != IGNORE).sum())
    assert result["test_depth"] == pytest.approx(depths.mean(), abs=1e-12)
    assert result["test_accuracy"] == pytest.approx(np.mean(am[np.arange(depths.size), depths - 1] == y), abs=1e-12)
    assert result["full_depth_accuracy"] == pytest.approx(np.mean(am[:, -1] == y), abs=1e-12)
