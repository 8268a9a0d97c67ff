"""Looped model: shapes, loop groups, readout path, step API equals forward, checkpoint round trip."""

import pytest
import torch

from looptrace.models.looped import (
    GroupConfig,
    LoopedTransformer,
    ModelConfig,
    load_checkpoint,
    save_checkpoint,
)


def _cfg(**kw):
    base = dict(vocab_size=7, block_size=10, d_model=16, n_head=2, groups=(GroupConfig(1, 3),))
    base.update(kw)
    return ModelConfig(**base)


def test_shapes_and_groups():
    torch.manual_seed(0)
    cfg = _cfg(n_prelude=1, groups=(GroupConfig(1, 2), GroupConfig(2, 3)), n_coda=1, gate="mlp", gate_hidden=8)
    m = LoopedTransformer(cfg).eval()
    out = m(torch.randint(0, 7, (2, 10)))
    assert out.hidden.shape == (2, 10, 5, 16) and out.hidden_init.shape == (2, 10, 16)
    assert out.logits.shape == (2, 10, 5, 7) and out.gate_logits.shape == (2, 10, 5)
    assert cfg.loop_group == [0, 0, 1, 1, 1] and cfg.n_loops == 5


def test_step_api_reproduces_forward():
    """h_t = block_g(h_{t-1} + h_0) and z_t = head(ln_f(coda(h_t))), written out by hand."""
    torch.manual_seed(1)
    cfg = _cfg(groups=(GroupConfig(1, 2), GroupConfig(1, 2)), n_coda=1)
    m = LoopedTransformer(cfg).eval()
    idx = torch.randint(0, 7, (3, 10))
    with torch.no_grad():
        out = m(idx)
        h0 = m.wte(idx) + m.wpe(torch.arange(10))
        h = h0
        for t, g in enumerate(cfg.loop_group):
            x = h + h0
            for layer in m.blocks[g]:
                x = layer(x)
            h = x
            assert torch.allclose(out.hidden[:, :, t], h, atol=1e-6)
            z = m.head(m.ln_f(m.coda[0](h)))
            assert torch.allclose(out.logits[:, :, t], z, atol=1e-5)


def test_causality():
    torch.manual_seed(2)
    m = LoopedTransformer(_cfg(causal=True)).eval()
    a = torch.randint(0, 7, (1, 10))
    b = a.clone()
    b[0, 7:] = (b[0, 7:] + 1) % 7
    with torch.no_grad():
        ha, hb = m(a).hidden, m(b).hidden
    assert torch.allclose(ha[:, :7], hb[:, :7], atol=1e-6)
    assert not torch.allclose(ha[:, 7:], hb[:, 7:])


def test_checkpoint_carries_config(tmp_path):
    torch.manual_seed(3)
    m = LoopedTransformer(_cfg(gate="linear", tie_embeddings=True))
    save_checkpoint(tmp_path / "m.pt", m, task={"kind": "x"}, seed=3)
    m2, ck = load_checkpoint(tmp_path / "m.pt")
    assert m2.cfg == m.cfg and ck["seed"] == 3 and ck["task"] == {"kind": "x"}
    idx = torch.randint(0, 7, (2, 10))
    with torch.no_grad():
        assert torch.equal(m.eval()(idx).logits, m2(idx).logits)
    assert m2.head.weight is m2.wte.weight


def _rms(x, w, eps=1e-5):
    """RMSNorm written out: x / sqrt(mean(x^2) + eps) * w."""
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _l2(x, w, eps=1e-6):
    """Dory's unit-sphere projection with a gain: x / sqrt(sum(x^2) + eps) * w."""
    return x / torch.sqrt(x.pow(2).sum(-1, keepdim=True) + eps) * w


def _randomise_gains(m):
    """Non-trivial norm gains, so that a test would see N_h and N_e swapped or a gain skipped."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(0.5 + torch.rand(p.shape, generator=g))


def test_add_form_is_the_plain_formula():
    """loop_form add: h_t = R(h_{t-1} + e) with re-injection, h_t = R(h_{t-1}) without, applied by hand."""
    torch.manual_seed(3)
    cfg = _cfg(groups=(GroupConfig(1, 2), GroupConfig(2, 2)), loop_form="add", n_prelude=1)
    m = LoopedTransformer(cfg).eval()
    idx = torch.randint(0, 7, (3, 10))
    with torch.no_grad():
        out = m(idx)
        e = m.prelude[0](m.wte(idx) + m.wpe(torch.arange(10)))
        h = e
        for t, g in enumerate(cfg.loop_group):
            x = h + e
            for layer in m.blocks[g]:
                x = x + layer.attn(layer.ln_1(x))
                x = x + layer.mlp(layer.ln_2(x))
            h = x
            torch.testing.assert_close(out.hidden[:, :, t], h, atol=1e-5, rtol=1e-5)
        # the readout of each loop is the shared final norm and head of h_t (no coda here)
        torch.testing.assert_close(out.logits[:, :, -1], m.head(m.ln_f(h)), atol=1e-5, rtol=1e-5)
    m2 = LoopedTransformer(_cfg(loop_form="add", reinject=False)).eval()
    with torch.no_grad():
        o = m2(idx)
        torch.testing.assert_close(o.hidden[:, :, 1], m2.blocks[0][0](o.hidden[:, :, 0]), atol=1e-5, rtol=1e-5)


def test_norm_add_form_is_dory_formula():
    """loop_form norm_add: h_t = R(N_h(h_{t-1}) + N_e(h_0)), N = unit-sphere projection with a gain (Dory),
    the norms and the layer applied by hand."""
    torch.manual_seed(4)
    cfg = _cfg(groups=(GroupConfig(1, 2), GroupConfig(2, 2)), loop_form="norm_add", n_prelude=1)
    m = LoopedTransformer(cfg).eval()
    _randomise_gains(m)
    idx = torch.randint(0, 7, (3, 10))
    with torch.no_grad():
        out = m(idx)
        e = m.prelude[0](m.wte(idx) + m.wpe(torch.arange(10)))
        h = e
        for t, g in enumerate(cfg.loop_group):
            x = _l2(h, m.norm_h.weight) + _l2(e, m.norm_e.weight)
            for layer in m.blocks[g]:  # pre-norm layers: x + attn(ln_1 x), then + mlp(ln_2 x)
                x = x + layer.attn(layer.ln_1(x))
                x = x + layer.mlp(layer.ln_2(x))
            h = x
            torch.testing.assert_close(out.hidden[:, :, t], h, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out.hidden_init, e)
    # without re-injection the state is still normalised before each loop
    m2 = LoopedTransformer(_cfg(loop_form="norm_add", reinject=False)).eval()
    assert m2.norm_e is None
    with torch.no_grad():
        o = m2(idx)
        x = m2.blocks[0][0](_l2(o.hidden[:, :, 0], m2.norm_h.weight))
        torch.testing.assert_close(o.hidden[:, :, 1], x, atol=1e-5, rtol=1e-5)


def test_adapter_form_is_huginn_formula():
    """loop_form adapter: h_t = R(A [N_h(h); N_e(e)]) with sandwich layers, applied by hand; the carried state
    leaves every loop RMS-normalised (unit gains at init), however many loops run."""
    torch.manual_seed(5)
    cfg = _cfg(groups=(GroupConfig(2, 3),), loop_form="adapter", n_coda=1)
    m = LoopedTransformer(cfg).eval()
    _randomise_gains(m)
    idx = torch.randint(0, 7, (2, 10))

    def sandwich(layer, x):
        x = _rms(x + layer.attn(_rms(x, layer.norm_1.weight)), layer.norm_2.weight)
        return _rms(x + layer.mlp(_rms(x, layer.norm_3.weight)), layer.norm_4.weight)

    with torch.no_grad():
        out = m(idx)
        e = m.wte(idx) + m.wpe(torch.arange(10))
        h = e
        for t in range(3):
            x = torch.cat([_rms(h, m.norm_h.weight), _rms(e, m.norm_e.weight)], dim=-1) @ m.adapter.weight.T
            for layer in m.blocks[0]:
                x = sandwich(layer, x)
            h = x
            torch.testing.assert_close(out.hidden[:, :, t], h, atol=1e-5, rtol=1e-5)
            z = m.head(m.ln_f(sandwich(m.coda[0], h)))
            torch.testing.assert_close(out.logits[:, :, t], z, atol=1e-5, rtol=1e-5)
    deep = LoopedTransformer(_cfg(groups=(GroupConfig(1, 30),), loop_form="adapter")).eval()
    with torch.no_grad():
        rms = deep(idx).hidden.pow(2).mean(-1).sqrt()  # [B, S, T]
    torch.testing.assert_close(rms, torch.ones_like(rms), atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="needs model.reinject"):
        _cfg(loop_form="adapter", reinject=False)
    with pytest.raises(ValueError, match="loop_form must be one of"):
        _cfg(loop_form="dory")


def test_old_checkpoints_load_as_the_add_form(tmp_path):
    """A checkpoint written before loop_form existed (no such key) loads as h <- R(h + e), bit for bit."""
    torch.manual_seed(6)
    m = LoopedTransformer(_cfg())
    save_checkpoint(tmp_path / "old.pt", m)
    ck = torch.load(tmp_path / "old.pt", weights_only=False)
    del ck["model_config"]["loop_form"]
    torch.save(ck, tmp_path / "old.pt")
    m2, _ = load_checkpoint(tmp_path / "old.pt")
    assert m2.cfg.loop_form == "add" and not hasattr(m2, "norm_h")
    idx = torch.randint(0, 7, (2, 10))
    with torch.no_grad():
        assert torch.equal(m.eval()(idx).hidden, m2(idx).hidden)
    for form in ("norm_add", "adapter"):  # the new forms round-trip too
        mf = LoopedTransformer(_cfg(loop_form=form))
        save_checkpoint(tmp_path / f"{form}.pt", mf)
        mf2, _ = load_checkpoint(tmp_path / f"{form}.pt")
        with torch.no_grad():
            assert torch.equal(mf.eval()(idx).logits, mf2(idx).logits)
