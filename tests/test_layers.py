"""Per-layer states inside the loop (``dump.layers``): equal to the layer outputs computed by hand from the model's
own modules, stored and sized by the dump, absent by default; geometry per layer against direct formulas."""

import numpy as np
import pytest
import torch

from looptrace.capture.dump import DumpConfig, dump_split
from looptrace.capture.layers import layer_states
from looptrace.config import ConfigError
from looptrace.diagnose.layer_geometry import layer_geometry, layer_metrics
from looptrace.io.store.location import memory_store
from looptrace.models.interface import LoopedTransformerAdapter
from looptrace.models.invariant import BatchInvariant
from looptrace.models.looped import GroupConfig, LoopedTransformer, ModelConfig
from looptrace.tasks import IGNORE
from tests.builders import tiny_adapter_and_data


def _by_hand(model, ids):
    """Every loop-block layer's output, written out from the model's modules (form ``add`` with reinjection), in the
    kernels the model's inference passes use (looptrace.models.invariant)."""
    with torch.no_grad(), BatchInvariant(key_length=model.cfg.block_size):
        h0 = model.embed(ids)
        h, out = h0, []
        for g, group in enumerate(model.cfg.groups):
            for _ in range(group.loops):
                x = h + h0
                per = []
                for layer in model.blocks[g]:
                    x = layer(x)
                    per.append(x)
                out.append(per)
                h = x
    return out  # [loop][layer] -> [B, S, D]


def test_layer_states_equal_the_layer_outputs_of_the_models_own_forward():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=7, block_size=6, d_model=16, n_head=2, groups=(GroupConfig(3, 2), GroupConfig(2, 2)))
    model = LoopedTransformer(cfg).eval()
    ad = LoopedTransformerAdapter(model, "t")
    ids = torch.randint(0, 7, (3, 6))
    got = layer_states(ad, ids, [1, 0])
    want = _by_hand(model, ids)
    assert got.shape == (3, 6, 4, 2, 16)
    for t in range(4):
        torch.testing.assert_close(got[:, :, t, 0], want[t][1], rtol=0, atol=0)
        torch.testing.assert_close(got[:, :, t, 1], want[t][0], rtol=0, atol=0)
    # layer 1 is the last of group 1's block: at its loops (3, 4) it is the loop output the store keeps as `hidden`
    torch.testing.assert_close(got[:, :, 2:, 0], ad.states(ids).hidden[:, :, 2:], rtol=0, atol=0)


def test_dump_stores_them_says_the_size_and_leaves_default_stores_alone(capsys):
    adapter, data = tiny_adapter_and_data(n_seq=9, unscored=True)
    plain = dump_split(adapter, data, memory_store(), DumpConfig(batch_size=4, chunk_tokens=16, hidden_dtype="float32"))
    assert "layer_hidden" not in plain and "layers" not in plain.attrs["params"]
    capsys.readouterr()
    st = dump_split(adapter, data, memory_store(),
                    DumpConfig(batch_size=4, chunk_tokens=16, hidden_dtype="float32", layers=(0,)))
    n, T, D = st.n_tokens, st.n_loops, st.d_model
    assert f"layer_hidden [{n}, {T}, 1, {D}] float32 = " in capsys.readouterr().err
    mask = torch.from_numpy(data.targets != IGNORE)
    want = layer_states(adapter, torch.from_numpy(data.tokens), [0])[mask].numpy()
    np.testing.assert_allclose(st.read("layer_hidden"), want, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(st.read("layer_hidden")[:, :, 0], st.read("hidden"))  # 1-layer block
    for name in plain.names:
        np.testing.assert_array_equal(st.read(name), plain.read(name), err_msg=name)
    with pytest.raises(ConfigError, match="layer 3 is not in every looped block"):
        dump_split(adapter, data, memory_store(), DumpConfig(layers=(3,)))


def test_layer_geometry_against_direct_formulas():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 3, 2, 4)).astype(np.float32)
    h0 = rng.standard_normal((5, 4)).astype(np.float32)
    m = layer_metrics(x, h0)
    prev = np.concatenate([h0[:, None], x[:, :-1, 1]], axis=1)  # layer 1 across loops, h_0 before loop 1
    np.testing.assert_allclose(m["step_norm"][:, :, 1], np.linalg.norm(x[:, :, 1] - prev, axis=-1), rtol=1e-5)
    cos = (x[:, :, 1] * x[:, :, 0]).sum(-1) / np.linalg.norm(x[:, :, 1], axis=-1) / np.linalg.norm(x[:, :, 0], axis=-1)
    np.testing.assert_allclose(m["within_cos"][:, :, 1], cos, rtol=1e-5)
    assert np.isnan(m["within_norm"][:, :, 0]).all()
    table = layer_geometry(x, h0, [2, 3])
    row = table.filter((table["layer"] == 3) & (table["loop"] == 2) & (table["metric"] == "step_norm")).row(0, named=True)
    assert row["median"] == pytest.approx(float(np.median(m["step_norm"][:, 1, 1])), rel=1e-6)
