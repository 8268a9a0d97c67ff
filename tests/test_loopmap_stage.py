"""The ``loopmap`` stage (SPEC §2b): closed forms on a linear loop map h ← a·h + b (every figure the stage
measures is known exactly there), a size-0 intervention, the vectorised bootstrap AUC against scikit-learn, and the
stage run on a tiny checkpoint (outputs, figure widths, same params → same bytes)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import torch
import typer
from typer.testing import CliRunner

from looptrace.config import ConfigError
from looptrace.loopmap.config import LoopmapConfig
from looptrace.loopmap.diagnoses import weighted_auc
from looptrace.loopmap.measure import measure, no_loop_step
from looptrace.loopmap.plots import MAX_PX
from looptrace.loopmap.tabulate import frontier_table, loopmap_tables
from looptrace.models.interface import AdapterInfo, LoopedModelAdapter, States
from tests.conftest import REPO

A, T, S, D, V = 0.5, 8, 5, 4, 3


class ScaledIdentity(LoopedModelAdapter):
    """h_0 = E[token], h_t = a·h_{t−1} + b (positions never mix), logits = h W (float64)."""

    def __init__(self, a: float = A, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.a = a
        self.E = torch.as_tensor(rng.standard_normal((V, D)))
        self.b = torch.as_tensor(rng.standard_normal(D))
        self.W = torch.as_tensor(rng.standard_normal((D, V)))
        self.info = AdapterInfo(name="lin", n_loops=T, d_model=D, vocab_size=V, loop_group=[0] * T, has_gate=False,
                                config={}, checkpoint_hash="")

    def loop_step(self, h, h0, loop):
        return self.a * h + self.b

    def states(self, input_ids):
        h0 = self.E[input_ids]
        hs, h = [], h0
        for t in range(T):
            h = self.loop_step(h, h0, t)
            hs.append(h)
        return States(hidden=torch.stack(hs, 2), hidden_init=h0)

    def readout(self, h, loop):
        return h @ self.W


def _sample(n: int = 12, seed: int = 1):
    rng = np.random.default_rng(seed)
    return rng.integers(0, V, (n, S)), rng.integers(0, V, (n, S))


def test_linear_map_every_figure_in_closed_form():
    adapter = ScaledIdentity()
    tokens, targets = _sample()
    targets[0, 1] = -100  # an unscored position is left out of every table
    cfg = LoopmapConfig(sequences=12, batch_size=5, power_iters=3, loops=(0, 1), scales=(0.3,), patch=True,
                        window_threshold=0.1, n_boot=20)
    raw = measure(adapter, tokens, targets, cfg, seed=0, progress=False)
    n_tok = tokens.size - 1
    # ρ_t = σ_max(a·I) = a on every token and loop, and its upper bound ≥ a; λ_t = log a at every loop (Benettin)
    np.testing.assert_allclose(raw["rho"], A, rtol=1e-6)
    assert raw["exact"] and (raw["rho_bound"] >= A).all() and (raw["rho_bound"] <= A * (1 + 1e-6)).all()
    np.testing.assert_allclose(raw["ftle"], math.log(A), rtol=1e-6)
    assert raw["rho"].shape == (n_tok, T) and raw["sequence"].shape == (n_tok,)
    # every intervention (noise or patch) of a linear map decays as ‖a^j δ‖/‖δ‖ = a^j, measured and linearised
    assert [(c.kind, c.loop) for c, _ in raw["interventions"]] == [("noise", 0), ("patch", 0), ("noise", 1),
                                                                   ("patch", 1)]
    for icfg, eff in raw["interventions"]:
        want = A ** np.arange(1, T - icfg.loop + 1)
        moved = eff["delta_norm"] > 0  # a patch donor with the same token at loop 0 is no intervention: effect 0
        assert moved.all() or icfg.kind == "patch"
        assert 0 < moved.sum() and float(np.abs(eff["state"][~moved]).max(initial=0)) == 0.0
        np.testing.assert_allclose(eff["state"][moved], np.broadcast_to(want, eff["state"][moved].shape), rtol=1e-9)
        np.testing.assert_allclose(eff["linear"][moved], np.broadcast_to(want, eff["state"][moved].shape), rtol=1e-9)
    frames, words = loopmap_tables("lin", raw, cfg, seed=0, n_loops=T)
    # the window: first j with a^j ≤ 0.1 is j = 4 (0.5³ = 0.125, 0.5⁴ = 0.0625), for the state and its prediction
    wl = frames["window_length"]
    for r in wl.filter(pl.col("measure").is_in(["state", "linear"])).iter_rows(named=True):
        assert r["window"] == math.ceil(math.log(0.1) / math.log(A)) == 4 and r["reached"], r
        assert r["horizon"] == T - r["loop"]
    w = frames["windows"].filter((pl.col("measure") == "state") & (pl.col("kind") == "noise") & (pl.col("loop") == 1))
    np.testing.assert_allclose(w["value"].to_numpy(), A ** w["j"].to_numpy(), rtol=1e-9)
    np.testing.assert_allclose(w["lo"].to_numpy(), A ** w["j"].to_numpy(), rtol=1e-9)
    assert w["n_tokens"].unique().to_list() == [n_tok]
    wp = frames["windows"].filter((pl.col("measure") == "state") & (pl.col("kind") == "patch") & (pl.col("loop") == 0))
    np.testing.assert_allclose(wp["value"].to_numpy(), A ** wp["j"].to_numpy(), rtol=1e-9)  # δ = 0 tokens left out
    assert wp["n_tokens"][0] == int((raw["interventions"][1][1]["delta_norm"] > 0).sum()) < n_tok
    # regime: λ = log 0.5 < −δ and ρ < 1 everywhere
    reg = frames["regime"].row(0, named=True)
    assert reg["regime"] == "contracting" and reg["share_rho_below_1"] == 1.0 and reg["n_tokens"] == n_tok
    assert reg["ftle_median"] == pytest.approx(math.log(A), rel=1e-6)
    pl_ = frames["per_loop"]
    np.testing.assert_allclose(pl_["rho_median"].to_numpy(), A, rtol=1e-6)
    np.testing.assert_allclose(pl_["ftle_median"].to_numpy(), math.log(A), rtol=1e-6)
    np.testing.assert_allclose(pl_["growth_median"].to_numpy(), math.log(A), rtol=1e-5)  # log ‖a·u‖ every loop
    assert pl_["share_rho_below_1"].to_list() == [1.0] * T
    assert frames["auc"].height == 8 and set(frames["auc"]["model"]) == {"lin"}
    assert words[0].startswith("The loop map contracts")


def test_certified_exit_on_the_linear_map_is_the_distance_to_the_fixed_point():
    """For a·I the Banach bound is tight: b_t = ‖h_t − h*‖/‖h_t‖ with h* = b/(1 − a), so the certified exit at ε is
    the first loop whose true relative distance to h* is ≤ ε (computed here from the closed-form fixed point)."""
    adapter = ScaledIdentity()
    tokens, targets = _sample(n=6)
    cfg = LoopmapConfig(sequences=6, batch_size=6, power_iters=2, loops=(), patch=False, n_boot=0,
                        eps=(0.5, 0.1, 0.01))
    raw = measure(adapter, tokens, targets, cfg, seed=0, progress=False)
    fr = frontier_table("lin", raw, cfg).filter(pl.col("rule") == "certified_fixed_point")
    h0 = adapter.E[torch.as_tensor(tokens)].reshape(-1, D).numpy()
    hstar = adapter.b.numpy() / (1 - A)
    ht = np.stack([hstar + A ** t * (h0 - hstar) for t in range(1, T + 1)], 1)  # [token, loop, d]
    dist = np.linalg.norm(ht - hstar, axis=-1) / np.linalg.norm(ht, axis=-1)
    correct = raw["correct"]
    for eps, r in zip((0.5, 0.1, 0.01), fr.iter_rows(named=True), strict=True):
        hit = dist <= eps * (1 + 1e-9)
        depth = np.where(hit.any(1), hit.argmax(1) + 1, T)
        assert r["mean_depth"] == pytest.approx(depth.mean()), eps
        assert r["accuracy"] == pytest.approx(correct[np.arange(len(depth)), depth - 1].mean()), eps
        assert r["share_certified"] == pytest.approx(hit.any(1).mean()), eps
    # fixed depth d: its accuracy is loop d's
    fixed = frontier_table("lin", raw, cfg).filter(pl.col("rule") == "fixed")
    assert fixed["mean_depth"].to_list() == list(range(1, T + 1))
    np.testing.assert_allclose(fixed["accuracy"].to_numpy(), correct.mean(0))


def test_beyond_exact_width_the_exit_is_estimated_not_certified():
    adapter = ScaledIdentity()
    tokens, targets = _sample(n=6)
    cfg = LoopmapConfig(sequences=6, batch_size=6, power_iters=2, exact_width=D - 1, loops=(), patch=False,
                        n_boot=0, eps=(0.5, 0.1))
    raw = measure(adapter, tokens, targets, cfg, seed=0, progress=False)
    assert not raw["exact"] and np.isnan(raw["rho_bound"]).all()
    np.testing.assert_allclose(raw["rho"], A, rtol=1e-6)  # the power method is exact on a·I
    frames, words = loopmap_tables("lin", raw, cfg, seed=0, n_loops=T)
    assert set(frames["frontier"]["rule"]) == {"estimated_fixed_point", "fixed", "rel_step", "entropy"}
    assert words[1].startswith("Estimated fixed-point exit (not certified")
    assert "ertified fixed-point exit (" not in words[1].replace("Estimated", "")


def test_outputs_do_not_depend_on_the_batch_size():
    """Every draw is per sequence (contraction start vectors, noise) or over the whole sample (patch donors): the
    tables of a float64 tiny model at batch sizes 7, 3 and 1 agree to rounding (exact ρ_t and, beyond exact_width,
    the seeded power method)."""
    from tests.builders import tiny_adapter_and_data

    adapter, data = tiny_adapter_and_data(n_seq=7, unscored=True, gate="none")
    adapter.model.double()
    for width in (256, 8):  # d_model 16: exact; power method
        tables = []
        for bs in (7, 3, 1):
            cfg = LoopmapConfig(sequences=7, batch_size=bs, power_iters=2, exact_width=width, loops=(0, 1),
                                scales=(0.1,), patch=True, n_boot=20)
            raw = measure(adapter, data.tokens, data.targets, cfg, seed=4, progress=False)
            tables.append(loopmap_tables("tiny", raw, cfg, seed=4, n_loops=adapter.info.n_loops)[0])
        first = tables[0]
        assert first["windows"].filter(pl.col("kind") == "patch").height  # the patch is measured
        for other in tables[1:]:
            for name, df in first.items():
                o = other[name]
                assert df.columns == o.columns and df.height == o.height, name
                for c in df.columns:
                    a, b = df[c], o[c]
                    if a.dtype == pl.Float64:
                        np.testing.assert_allclose(b.to_numpy(), a.to_numpy(), rtol=1e-9, atol=1e-12,
                                                   err_msg=f"{name}.{c}")
                    else:
                        assert a.to_list() == b.to_list(), f"{name}.{c}"


def test_size_zero_intervention_changes_nothing():
    adapter = ScaledIdentity()
    tokens, targets = _sample(n=4)
    cfg = LoopmapConfig(sequences=4, batch_size=4, loops=(0, 2), scales=(0.0,), patch=False, n_boot=10)
    raw = measure(adapter, tokens, targets, cfg, seed=0, progress=False)
    for _, eff in raw["interventions"]:
        for m, e in eff.items():
            assert float(np.abs(e).max()) == 0.0, m
    frames, _ = loopmap_tables("lin", raw, cfg, seed=0, n_loops=T)
    assert frames["windows"]["value"].abs().max() == 0.0
    assert frames["window_length"]["window"].to_list() == [1] * 8  # gone at the first loop after it


def test_weighted_auc_is_sklearns_for_every_weight_row():
    from sklearn.metrics import roc_auc_score

    rng = np.random.default_rng(0)
    y = rng.random(200) < 0.3
    x = np.round(rng.random(200), 1)  # many ties
    W = rng.integers(0, 3, (30, 200)).astype(float)
    got = weighted_auc(y, x, W)
    want = [roc_auc_score(y, x, sample_weight=w) for w in W]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
    W[0, y] = 0  # no positive weight: undefined
    assert np.isnan(weighted_auc(y, x, W)[0])


def test_config_is_checked():
    with pytest.raises(ConfigError, match="loopmap.split must be one of"):
        LoopmapConfig(split="train")
    with pytest.raises(ConfigError, match="loopmap.patch needs sequences >= 2"):
        LoopmapConfig(sequences=1)
    assert LoopmapConfig(batch_size=1).batch_size == 1  # patch donors come from the whole sample, not the batch
    with pytest.raises(ConfigError, match="loopmap.exact_width must be >= 1"):
        LoopmapConfig(exact_width=0)
    with pytest.raises(ConfigError, match="loopmap.eps"):
        LoopmapConfig(eps=(0.0,))
    assert LoopmapConfig().interventions(2, 0)[0].loop == 1 and len(LoopmapConfig().interventions(2, 0)) == 3


def _run_stage(tmp: Path, out: str, params: Path) -> str:
    import looptrace.stages.loopmap as stage

    app = typer.Typer()
    app.command()(stage.main)
    res = CliRunner().invoke(app, ["--model", "rs-joint", "--params", str(REPO / "params.yaml"), "--params",
                                   str(params), "--train-root", str(tmp / "train"), "--out", str(tmp / out)])
    assert res.exit_code == 0, res.output
    return res.output


def test_stage_on_a_tiny_checkpoint_writes_every_output_and_the_same_bytes_twice(tmp_path):
    from PIL import Image

    from tests.builders import tiny_checkpoint

    tiny_checkpoint(tmp_path / "train", "rs-joint")
    over = tmp_path / "over.yaml"
    over.write_text("base: {threads: 1}\nloopmap: {sequences: 6, batch_size: 3, power_iters: 1, loops: [1, 5], "
                    "n_boot: 10, dpi: 200}\n")
    text = _run_stage(tmp_path, "a", over)
    import matplotlib

    with matplotlib.rc_context({"font.size": 17, "axes.grid": True}):  # another stage's global style (the report's)
        _run_stage(tmp_path, "b", over)
    assert "rs-joint: loop map on 6 sequences" in text
    a, b = tmp_path / "a" / "rs-joint", tmp_path / "b" / "rs-joint"
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(["auc.parquet", "frontier.parquet", "manifest.json", "metrics.json", "per_loop.parquet",
                            "regime.parquet", "rho_ftle.png", "summary.md", "window_length.parquet",
                            "windows.parquet", "windows.png", "trace.parquet", "gate_patch.parquet",
                            "flip_depth.parquet", "tracing.md", "trace.png"])
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    m = json.loads((a / "metrics.json").read_text())
    assert m["n_loops"] == 4 and m["skipped_loops"] == [5] and m["not_measured"] is None
    assert m["regime"]["regime"] in ("contracting", "marginal", "expanding")
    assert "params" in m and "trace" not in m["params"] and "gate_q" not in m["params"]  # at defaults: left out
    fd = pl.read_parquet(a / "flip_depth.parquet")
    assert fd["rule"][0] == "flip_depth" and "q_exit" in set(fd["rule"])  # the tiny checkpoint has a linear gate
    assert "Answer flips (" in (a / "tracing.md").read_text()
    for png in ("rho_ftle.png", "windows.png", "trace.png"):
        assert Image.open(a / png).size[0] <= MAX_PX
    wl = pl.read_parquet(a / "window_length.parquet")
    assert set(wl["loop"]) == {1} and set(wl["kind"]) == {"noise", "patch"}  # k = 5 ≥ T = 4 skipped
    assert "Loop map: rs-joint" in (a / "summary.md").read_text()

    # diagnose reads them: the regime row and the AUC rows as the stage wrote them, the stage's sentences
    from looptrace.loopmap.diagnose_rows import LOOPMAP_SCHEMA, loopmap_artifacts

    frame, text = loopmap_artifacts(["absent", "rs-joint"], tmp_path / "a")
    assert frame is not None and dict(frame.schema) == LOOPMAP_SCHEMA and frame.height == 1 + 8
    reg = pl.read_parquet(a / "regime.parquet").row(0, named=True)
    row = frame.row(0, named=True)
    assert row["model"] == "rs-joint" and row["failure"] is None
    for k in ("regime", "ftle_median", "ftle_lo", "share_rho_below_1", "n_sequences"):
        assert row[k] == reg[k], k
    auc = pl.read_parquet(a / "auc.parquet")
    assert frame.slice(1).select(auc.drop("model").columns).equals(auc.drop("model"))
    assert "## Loop-map dynamics" in text and "**rs-joint**" in text and reg["words"] in text
    assert loopmap_artifacts(["absent"], tmp_path / "a") == (None, "")


def test_a_model_with_loop_memory_is_not_measured_and_says_why():
    class Mem(ScaledIdentity):
        class model:  # noqa: N801 - the attribute path the check reads (adapter.model.cfg.loop_memory)
            class cfg:  # noqa: N801
                loop_memory = True

    assert no_loop_step(ScaledIdentity()) is None
    assert "loop memory" in no_loop_step(Mem())

    class NoStep(LoopedModelAdapter):
        info = ScaledIdentity().info

        def states(self, input_ids):
            raise AssertionError

        def readout(self, h, loop):
            raise AssertionError

    assert "exposes no loop step" in no_loop_step(NoStep())
