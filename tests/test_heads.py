"""Per-head attention statistics (``dump.heads``) and the inside-the-loop tables (SPEC §2c).

References are independent of the code under test: entropy and Jensen–Shannon divergence in closed form on
hand-made distributions; attention weights written out in numpy from the layer's own weights and inputs (and
checked to reproduce the module's output); per-layer step norms, relative steps and settled depths by numpy on a
tiny store; the states of a dump bit for bit the same with the option on or off.
"""

import math

import numpy as np
import polars as pl
import pytest
import torch

from looptrace.capture.dump import DumpConfig, dump_split
from looptrace.capture.heads import attention_weights, check_heads, entropy, head_stats, js_divergence
from looptrace.config import ConfigError
from looptrace.geometry.inside import inside_tables, resampled_medians
from looptrace.intervals import IntervalsConfig, Resampler
from looptrace.io.store.location import memory_store
from looptrace.models.interface import LoopedTransformerAdapter
from looptrace.models.invariant import BatchInvariant
from looptrace.models.looped import GroupConfig, LoopedTransformer, ModelConfig
from looptrace.tasks import IGNORE
from tests.builders import tiny_adapter_and_data

# ---------------------------------------------------------------------------------------------- closed forms


def test_entropy_and_js_on_hand_made_distributions():
    t = lambda *v: torch.tensor(v, dtype=torch.float64)  # noqa: E731
    assert float(entropy(t(0.25, 0.25, 0.25, 0.25))) == pytest.approx(math.log(4), abs=1e-15)
    assert float(entropy(t(1.0, 0.0, 0.0))) == 0.0  # 0 log 0 = 0
    assert float(entropy(t(0.5, 0.5, 0.0))) == pytest.approx(math.log(2), abs=1e-15)
    # disjoint supports: log 2, the maximum
    assert float(js_divergence(t(1.0, 0.0), t(0.0, 1.0))) == pytest.approx(math.log(2), abs=1e-15)
    assert float(js_divergence(t(0.2, 0.3, 0.5), t(0.2, 0.3, 0.5))) == 0.0
    # p = (1/2, 1/2), q = (1, 0): m = (3/4, 1/4); ½ KL(p‖m) + ½ KL(q‖m) = ½ · ½ log(4/3) + ½ log(4/3) = ¾ log(4/3)
    assert float(js_divergence(t(0.5, 0.5), t(1.0, 0.0))) == pytest.approx(0.75 * math.log(4 / 3), abs=1e-15)
    assert float(js_divergence(t(1.0, 0.0), t(0.5, 0.5))) == pytest.approx(0.75 * math.log(4 / 3), abs=1e-15)
    # the KL form of the definition on random rows (the code computes H(m) − ½ H(p) − ½ H(q)), near-equal rows too
    rng = np.random.default_rng(0)
    p, q = rng.dirichlet(np.ones(7), size=5), rng.dirichlet(np.ones(7), size=5)
    q[0] = p[0] * (1 + 1e-6 * rng.standard_normal(7))
    q[0] /= q[0].sum()
    want = 0.5 * _kl(p, (p + q) / 2) + 0.5 * _kl(q, (p + q) / 2)
    got = js_divergence(torch.from_numpy(p), torch.from_numpy(q)).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-15)
    assert 0 < got[0] < 1e-11


# ---------------------------------------------------------------------------------------------- attention weights


def _np_weights(attn, x: np.ndarray, causal: bool) -> np.ndarray:
    """softmax(Q Kᵀ / √d_head + mask) in numpy float64 from the module's weights: [B, S, D] -> [B, H, S, S]."""
    W = attn.qkv.weight.detach().double().numpy()
    b = attn.qkv.bias.detach().double().numpy()
    B, S, D = x.shape
    H = attn.n_head
    qkv = x.astype(np.float64) @ W.T + b
    q = qkv[..., :D].reshape(B, S, H, D // H).transpose(0, 2, 1, 3)
    k = qkv[..., D:2 * D].reshape(B, S, H, D // H).transpose(0, 2, 1, 3)
    s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(D // H)
    if causal:
        s = np.where(np.tril(np.ones((S, S), bool)), s, -np.inf)
    e = np.exp(s - s.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


@pytest.mark.parametrize("causal", [True, False])
def test_attention_weights_equal_a_second_implementation_and_reproduce_the_modules_output(causal):
    torch.manual_seed(1)
    cfg = ModelConfig(vocab_size=5, block_size=7, d_model=12, n_head=3, causal=causal)
    attn = LoopedTransformer(cfg).blocks[0][0].attn.eval()
    x = torch.randn(2, 7, 12)
    with torch.no_grad():
        a = attention_weights(attn, x)
        np.testing.assert_allclose(a.numpy(), _np_weights(attn, x.numpy(), causal), rtol=1e-5, atol=1e-7)
        if causal:
            assert (a.triu(diagonal=1) == 0).all()
        # the weights are the module's: Σ_j a_ij v_j, heads concatenated, through proj = its output
        v = attn.qkv(x).split(12, dim=2)[2].double().view(2, 7, 3, 4).transpose(1, 2)
        y = (a @ v).transpose(1, 2).reshape(2, 7, 12).float()
        torch.testing.assert_close(attn.proj(y), attn(x), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------- during the dump


def _kl(u: np.ndarray, w: np.ndarray) -> np.ndarray:
    """KL(u ‖ w) over the last axis, 0 log 0 = 0 (w > 0 wherever u > 0)."""
    pos = u > 0
    return np.where(pos, u * np.log(np.where(pos, u, 1) / np.where(pos, w, 1)), 0).sum(-1)


def _reference(model: LoopedTransformer, ids: torch.Tensor, layers: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Entropy and JS [B, S, T, L, H] written out from the model's modules (form ``add`` with reinjection): every
    block layer's attention input by hand, its weights in numpy (:func:`_np_weights`)."""
    ent, js = [], []
    prev: dict = {}
    with torch.no_grad(), BatchInvariant(key_length=model.cfg.block_size):
        h0 = model.embed(ids)
        h = h0
        for g, group in enumerate(model.cfg.groups):
            for k in range(group.loops):
                x = h + h0
                e_t, j_t = [], []
                for j, layer in enumerate(model.blocks[g]):
                    if j in layers:
                        a = _np_weights(layer.attn, layer.ln_1(x).numpy(), model.cfg.causal)  # [B, H, S, S]
                        e_t.append(-(np.where(a > 0, a * np.log(np.where(a > 0, a, 1)), 0)).sum(-1))
                        if k == 0:
                            j_t.append(np.full(a.shape[:-1], np.nan))
                        else:
                            p, q = a, prev[(g, j)]
                            m = (p + q) / 2
                            j_t.append(0.5 * _kl(p, m) + 0.5 * _kl(q, m))
                        prev[(g, j)] = a
                    x = layer(x)
                h = x
                where = [sorted(layers).index(j) for j in layers]  # block order -> the order layers were listed in
                ent.append(np.stack([e_t[i] for i in where], axis=1))  # [B, L, H, S]
                js.append(np.stack([j_t[i] for i in where], axis=1))
    to = lambda v: np.stack(v, axis=1).transpose(0, 4, 1, 2, 3)  # noqa: E731 - [B, T, L, H, S] -> [B, S, T, L, H]
    return to(ent), to(js)


def test_head_stats_equal_the_reference_across_groups_with_nan_at_each_groups_first_loop():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=7, block_size=6, d_model=16, n_head=2, groups=(GroupConfig(3, 2), GroupConfig(2, 3)))
    model = LoopedTransformer(cfg).eval()
    ad = LoopedTransformerAdapter(model, "t")
    ids = torch.randint(0, 7, (3, 6))
    ent, js = head_stats(ad, ids, [1, 0])
    want_e, want_j = _reference(model, ids, [1, 0])
    assert ent.shape == (3, 6, 5, 2, 2)
    np.testing.assert_allclose(ent.numpy(), want_e, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(js.numpy(), want_j, rtol=1e-4, atol=1e-7)
    assert np.isnan(js[:, :, [0, 2]].numpy()).all() and np.isfinite(js[:, :, [1, 3, 4]].numpy()).all()
    assert float(ent.min()) >= 0 and float(ent.max()) <= math.log(6) + 1e-6
    assert float(js[:, :, [1, 3, 4]].max()) <= math.log(2) + 1e-6
    with pytest.raises(ConfigError, match="layer 2 is not in every looped block"):
        check_heads(ad, [2])


def test_dump_stores_head_arrays_and_every_other_array_is_unchanged_bit_for_bit(capsys):
    adapter, data = tiny_adapter_and_data(n_seq=9, unscored=True)
    plain = dump_split(adapter, data, memory_store(), DumpConfig(batch_size=4, chunk_tokens=16, hidden_dtype="float32"))
    assert "head_entropy" not in plain and "heads" not in plain.attrs["params"]
    capsys.readouterr()
    st = dump_split(adapter, data, memory_store(),
                    DumpConfig(batch_size=4, chunk_tokens=16, hidden_dtype="float32", heads=(0,)))
    n, T = st.n_tokens, st.n_loops
    assert f"head_entropy and head_js [{n}, {T}, 1, 2] float32 = " in capsys.readouterr().err
    assert st.attrs["params"]["heads"] == [0]
    for name in plain.names:  # the states, logits, statistics and token fields: the same bits
        np.testing.assert_array_equal(st.read(name), plain.read(name), err_msg=name)
    mask = data.targets != IGNORE
    want_e, want_j = _reference(adapter.model, torch.from_numpy(data.tokens), [0])
    np.testing.assert_allclose(st.read("head_entropy"), want_e[mask], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(st.read("head_js"), want_j[mask], rtol=1e-4, atol=1e-7)


def test_heads_refused_for_a_model_without_looptrace_attention():
    adapter, data = tiny_adapter_and_data(n_seq=3)

    class Opaque(LoopedTransformerAdapter):
        def loop_layers(self, group):
            return [torch.nn.Linear(2, 2)]

    other = Opaque(adapter.model, "opaque")
    with pytest.raises(ConfigError, match="exposes no looptrace self-attention.*set dump.heads: \\[\\]"):
        dump_split(other, data, memory_store(), DumpConfig(heads=(0,)))


# ---------------------------------------------------------------------------------------------- geometry tables


def test_resampled_median_is_the_median_of_the_resampled_multiset():
    rng = np.random.default_rng(3)
    v = rng.standard_normal(11)
    v[4] = np.nan
    unit = np.array([0, 0, 1, 1, 1, 2, 3, 3, 4, 4, 4])
    counts = np.array([[1, 1, 1, 1, 1], [2, 0, 1, 0, 2], [0, 0, 5, 0, 0], [0, 3, 0, 2, 0]], float)
    rs = Resampler(unit, 0, counts=counts)
    got = resampled_medians(rs, v, batch=3)
    for b, c in enumerate(counts):
        w = c[unit].astype(int)
        keep = np.isfinite(v)
        assert got[b] == pytest.approx(np.median(np.repeat(v[keep], w[keep])), abs=1e-15)
    assert got[0] == pytest.approx(np.nanmedian(v))


def test_resampled_medians_equal_np_median_of_the_repeated_values_at_size():
    # many blocks, ties across blocks, units of unequal length, a resample that keeps nothing: every median equals
    # np.median of the multiset written out (exactly: the blocked sums are integer sums)
    rng = np.random.default_rng(7)
    unit = np.repeat(np.arange(40), rng.integers(1, 50, 40))
    v = np.round(rng.standard_normal(unit.size), 1)
    v[rng.integers(0, unit.size, 20)] = np.inf
    counts = rng.multinomial(40, np.full(40, 1 / 40), size=50).astype(float)
    counts[7] = 0.0
    rs = Resampler(unit, 0, counts=counts)
    got = resampled_medians(rs, v, batch=16)
    keep = np.isfinite(v)
    for b, c in enumerate(counts):
        w = c[unit].astype(int)
        want = np.median(np.repeat(v[keep], w[keep])) if w[keep].sum() else np.nan
        np.testing.assert_array_equal(got[b], want)  # exact (NaN = NaN, -0.0 = 0.0)


def _settled(signal: np.ndarray, eps: float) -> np.ndarray:
    """SPEC §2 settled depth by a plain loop: the first t from which signal < eps through T (T + 1 if none)."""
    n, T = signal.shape
    out = np.full(n, T + 1)
    for i in range(n):
        for t in range(T, 0, -1):
            if not signal[i, t - 1] < eps:
                break
            out[i] = t
    return out


def test_inside_tables_against_numpy_on_a_tiny_store():
    _, data = tiny_adapter_and_data(n_seq=10, unscored=False)
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=5, block_size=data.tokens.shape[1], d_model=16, n_head=2, groups=(GroupConfig(2, 4),))
    adapter = LoopedTransformerAdapter(LoopedTransformer(cfg).eval(), "rs-test")
    st = dump_split(adapter, data, memory_store(), DumpConfig(batch_size=4, chunk_tokens=16, hidden_dtype="float32",
                                                              layers=(0, 1), heads=(1,)))
    ivl = IntervalsConfig(n_boot=200)
    tables = inside_tables({"val": st}, [0.3, 0.1], ivl, "rs-test", 0, block_tokens=None)
    assert set(tables) == {"layers.parquet", "heads.parquet"}
    lay, hd = tables["layers.parquet"], tables["heads.parquet"]
    x = st.read("layer_hidden").astype(np.float64)  # [n, T, 2, D]
    h0 = st.read("hidden_init").astype(np.float64)
    prev = np.concatenate([h0[:, None, None].repeat(2, axis=2), x[:, :-1]], axis=1)
    step = np.linalg.norm(x - prev, axis=-1)  # [n, T, 2]
    rel = step / np.linalg.norm(x, axis=-1)  # SPEC §2: ‖Δ_t‖ / ‖x_t‖

    def row(**kw):
        f = lay
        for k, v in kw.items():
            f = f.filter(pl.col(k).is_null() if v is None else pl.col(k) == v)
        assert f.height == 1, kw
        return f.row(0, named=True)

    for layer in (0, 1):
        for t in range(4):
            r = row(layer=layer, loop=t + 1, metric="step_norm")
            assert r["estimate"] == pytest.approx(np.median(step[:, t, layer]), rel=1e-5)
            assert r["lo"] <= r["estimate"] <= r["hi"] and r["n_boot"] == 200 and r["n_sequences"] == 10
            assert row(layer=layer, loop=t + 1, metric="rel_step")["estimate"] == pytest.approx(
                np.median(rel[:, t, layer]), rel=1e-5)
    # the last layer of the block is the block output h_t: equal rows
    assert row(layer=None, loop=2, metric="rel_step")["estimate"] == pytest.approx(
        row(layer=1, loop=2, metric="rel_step")["estimate"], rel=1e-6)
    for eps in (0.3, 0.1):
        d0, d_out = _settled(rel[:, :, 0], eps), _settled(rel[:, :, 1], eps)
        assert row(layer=0, metric="settled_depth", eps=eps)["estimate"] == np.median(d0)
        assert row(layer=0, metric="settles_before_output", eps=eps)["estimate"] == pytest.approx(np.mean(d0 < d_out))
        assert row(layer=0, metric="settled_gap", eps=eps)["estimate"] == pytest.approx(np.mean(d0 - d_out))
        assert row(layer=1, metric="settled_gap", eps=eps)["estimate"] == 0.0
    ent, js = st.read("head_entropy"), st.read("head_js")
    for h in range(2):
        for t in range(4):
            r = hd.filter((pl.col("head") == h) & (pl.col("loop") == t + 1) & (pl.col("metric") == "entropy")).row(
                0, named=True)
            assert r["layer"] == 1 and r["estimate"] == pytest.approx(float(np.median(ent[:, t, 0, h])), rel=1e-6)
            r = hd.filter((pl.col("head") == h) & (pl.col("loop") == t + 1) & (pl.col("metric") == "js")).row(
                0, named=True)
            if t == 0:
                assert r["count"] == 0 and math.isnan(r["estimate"])
            else:
                assert r["estimate"] == pytest.approx(float(np.median(js[:, t, 0, h])), rel=1e-6)
    plain = dump_split(adapter, data, memory_store(), DumpConfig(batch_size=4, chunk_tokens=16))
    assert inside_tables({"val": plain}, [0.1], ivl, "rs-test", 0) == {}


# ---------------------------------------------------------------------------------------------- report


def test_report_figures_read_the_tables_values(tmp_path):
    from looptrace.report.fig_heads import _per_loop, fig_heads, fig_layers
    from looptrace.report.inputs import Inputs

    meta = pl.DataFrame({"model": ["a-s0", "a-s1"], "task": ["rp", "rp"], "regime": ["geometric", "geometric"],
                         "regime_kind": ["geometric", "geometric"], "n_loops": [3, 3],
                         "full_depth_accuracy": [1.0, 1.0], "has_gate": [False, False]})
    heads = pl.DataFrame([{"model": m, "split": "test", "layer": 0, "head": h, "loop": t, "metric": k,
                           "estimate": 0.1 * t + h + (10.0 if k == "entropy" else 0.0) + i, "lo": None, "hi": None,
                           "count": 5} for i, m in enumerate(["a-s0", "a-s1"]) for h in (0, 1) for t in (1, 2, 3)
                          for k in ("entropy", "js")])
    got = _per_loop(heads, ["a-s0", "a-s1"], 3, layer=0, head=1, metric="js")
    np.testing.assert_allclose(got, [[1.1, 1.2, 1.3], [2.1, 2.2, 2.3]])
    layers = pl.DataFrame([{"model": m, "split": "test", "layer": la, "loop": t, "metric": "rel_step", "eps": None,
                            "estimate": 0.5 ** t * (2 if la is None else 1)} for m in ("a-s0", "a-s1")
                           for la in (0, None) for t in (1, 2, 3)])
    np.testing.assert_allclose(_per_loop(layers, ["a-s1"], 3, layer=None), [[1.0, 0.5, 0.25]])
    inp = Inputs(meta=meta, layers=layers, heads=heads)
    assert fig_heads(inp, tmp_path, 60).name == "heads.png" and fig_layers(inp, tmp_path, 60).name == "layers.png"
    assert fig_heads(Inputs(meta=meta), tmp_path, 60) is None and fig_layers(Inputs(meta=meta), tmp_path, 60) is None
