"""Looped model: shapes, loop groups, readout path, step API equals forward, checkpoint round trip."""

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
