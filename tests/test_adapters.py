"""HF adapters on tiny random-weight checkpoints built here (nothing downloaded).

Independent references: the model's own ``output_hidden_states`` (per-loop states at the matching
layer-call indices), the model's own forward logits, and — for every intermediate exit — the same
checkpoint loaded with fewer loops (a T-loop run's first t loops are a t-loop run, so the t-loop model's
logits are what an exit after loop t must produce). Retrofit looping is checked against a plain Llama
whose layer list repeats the block (shared weights).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

from pipeline.adapters.hf import AdapterConfig, load_adapter
from pipeline.config import ConfigError
from tests import hf_helpers as H

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {"dory": H.build_dory(root / "dory"), "inkling": H.build_inkling(root / "inkling"),
            "llama": H.build_llama(root / "llama"), "ouro": H.build_fake_ouro(root / "ouro"),
            "huginn": H.build_fake_huginn(root / "huginn")}


def _ids(b=2, s=12, v=H.VOCAB - 4, seed=0):
    return torch.randint(0, v, (b, s), generator=torch.Generator().manual_seed(seed))


def close(a, b, tol=1e-5):
    torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol)


def test_dory_states_and_every_exit_match_the_model(ckpts):
    from transformers import DoryForCausalLM

    a = load_adapter(AdapterConfig(kind="dory", path=str(ckpts["dory"])))
    assert (a.info.n_loops, a.info.d_model, a.info.vocab_size, a.info.has_gate) == (3, 32, H.VOCAB, False)
    ids = _ids()
    st = a.states(ids)
    ref = DoryForCausalLM.from_pretrained(ckpts["dory"], local_files_only=True).eval()
    with torch.no_grad():
        hs = ref(ids, output_hidden_states=True).hidden_states
    P, R = 1, 2  # hidden_states = (embeddings, prelude, loop 1 layers, loop 2 layers, ..., coda)
    assert len(hs) == 1 + P + 3 * R + 2
    close(st.hidden_init, hs[P])
    for t in range(3):
        close(st.hidden[:, :, t], hs[P + (t + 1) * R])
        fewer = DoryForCausalLM.from_pretrained(ckpts["dory"], local_files_only=True, n_recurrent_loops=t + 1).eval()
        with torch.no_grad():
            close(a.readout(st.hidden[:, :, t], t), fewer(ids).logits)
    # the loop count is a parameter: 5 loops = the checkpoint run with n_recurrent_loops=5
    a5 = load_adapter(AdapterConfig(kind="dory", path=str(ckpts["dory"]), n_loops=5))
    st5 = a5.states(ids)
    five = DoryForCausalLM.from_pretrained(ckpts["dory"], local_files_only=True, n_recurrent_loops=5).eval()
    with torch.no_grad():
        close(a5.readout(st5.hidden[:, :, 4], 4), five(ids).logits)
    close(st5.hidden[:, :, :3], st.hidden)  # the first 3 loops do not depend on T


def test_inkling2loop_states_and_every_exit_match_the_model(ckpts):
    from transformers.models.inkling2_loop import Inkling2LoopForCausalLM

    a = load_adapter(AdapterConfig(kind="inkling2loop", path=str(ckpts["inkling"])))
    assert (a.info.n_loops, a.info.d_model, a.info.vocab_size) == (3, 32, H.VOCAB - 4)
    ids = _ids()
    st = a.states(ids)
    ref = Inkling2LoopForCausalLM.from_pretrained(ckpts["inkling"], local_files_only=True).eval()
    with torch.no_grad():
        hs = ref(ids, output_hidden_states=True).hidden_states
    s, R = 2, 2
    assert len(hs) == 1 + 6 + 2 * R
    close(st.hidden_init, hs[s])
    for t in range(3):
        close(st.hidden[:, :, t], hs[s + (t + 1) * R])
        fewer = Inkling2LoopForCausalLM.from_pretrained(ckpts["inkling"], local_files_only=True,
                                                        loop_num_passes=t + 1).eval()
        with torch.no_grad():
            close(a.readout(st.hidden[:, :, t], t), fewer(ids).logits)
    # the exit reads the pass's block states: any other h is refused rather than read out wrongly
    with pytest.raises(ValueError, match="block states"):
        a.readout(st.hidden[:, :, 0] + 1, 0)


def _repeated_llama(path, block, passes):
    from transformers import LlamaForCausalLM

    m = LlamaForCausalLM.from_pretrained(path, local_files_only=True).eval()
    layers = list(m.model.layers)
    s, e = block
    m.model.layers = nn.ModuleList(layers[:s] + layers[s:e] * passes + layers[e:])
    m.config = copy.deepcopy(m.config)
    m.config.num_hidden_layers = m.model.config.num_hidden_layers = len(m.model.layers)
    return m  # call with use_cache=False: a shared layer would otherwise attend to its own earlier keys


def test_retrofit_loops_a_block_like_a_repeated_layer_stack(ckpts):
    path = str(ckpts["llama"])
    ids = _ids()
    # one pass = the unmodified model
    a1 = load_adapter(AdapterConfig(kind="retrofit", path=path, block=(1, 3), n_loops=1))
    st1 = a1.states(ids)
    plain = _repeated_llama(path, (1, 3), 1)
    with torch.no_grad():
        o = plain(ids, output_hidden_states=True, use_cache=False)
    close(st1.hidden_init, o.hidden_states[1])
    close(st1.hidden[:, :, 0], o.hidden_states[3])
    close(a1.readout(st1.hidden[:, :, 0], 0), o.logits)
    # three passes through layers 1..2 = the layer stack [0, 1, 2, 1, 2, 1, 2, 3]
    a = load_adapter(AdapterConfig(kind="retrofit", path=path, block=(1, 3), n_loops=3))
    st = a.states(ids)
    rep = _repeated_llama(path, (1, 3), 3)
    with torch.no_grad():
        hs = rep(ids, output_hidden_states=True, use_cache=False).hidden_states
    for t in range(3):
        close(st.hidden[:, :, t], hs[1 + 2 * (t + 1)])
        with torch.no_grad():
            close(a.readout(st.hidden[:, :, t], t), _repeated_llama(path, (1, 3), t + 1)(ids, use_cache=False).logits)


def test_ouro_interface_stores_per_step_states_and_gates(ckpts):
    a = load_adapter(AdapterConfig(kind="ouro", path=str(ckpts["ouro"]), trust_remote_code=True))
    assert (a.info.n_loops, a.info.has_gate) == (4, True)
    ids = _ids(s=9)
    st = a.states(ids)
    with torch.no_grad():
        _, hs, gates = a.model.model(input_ids=ids)
        emb = a.model.model.embed_tokens(ids)
    close(st.hidden_init, emb)
    close(st.gate_logits, torch.cat(gates, dim=-1))
    for t in range(4):
        close(st.hidden[:, :, t], hs[t])
        close(a.readout(st.hidden[:, :, t], t), a.model.lm_head(hs[t]))
    assert a._norm_exit is False  # the per-step states are normed: the exit is the head alone


def test_huginn_interface_seeded_initial_state_and_steps(ckpts):
    a = load_adapter(AdapterConfig(kind="huginn", path=str(ckpts["huginn"]), trust_remote_code=True, seed=7))
    assert a.info.n_loops == 5
    ids = _ids(s=9)
    st, again = a.states(ids), a.states(ids)
    close(st.hidden, again.hidden, tol=0)  # deterministic: the same seed for every call
    m = a.model
    with torch.no_grad():
        e, _ = m.embed_inputs(ids)
        torch.manual_seed(7)
        x = torch.randn_like(e)  # init_std 1.0
        close(st.hidden_init, x)
        for t in range(5):
            x = x + torch.tanh(m.core(m.adapter(torch.cat([x, e], dim=-1))))
            close(st.hidden[:, :, t], x)
        close(a.readout(st.hidden[:, :, 4], 4), m.lm_head(m.ln_f(torch.tanh(m.coda(x)))))


def test_exit_path_check_and_config_errors(ckpts, tmp_path):
    a = load_adapter(AdapterConfig(kind="dory", path=str(ckpts["dory"])))
    a._verified = False
    a._reference = lambda ids: (2, torch.zeros(*ids.shape, H.VOCAB))
    with pytest.raises(ValueError, match="does not reproduce the model's own logits at loop 3"):
        a.states(_ids())
    with pytest.raises(ConfigError, match="kind must be one of"):
        AdapterConfig(kind="lstm", path="x")
    with pytest.raises(ConfigError, match="block"):
        AdapterConfig(kind="retrofit", path="x", n_loops=2)
    with pytest.raises(ConfigError, match="trust_remote_code"):
        AdapterConfig(kind="ouro", path="x")
    with pytest.raises(ConfigError, match="exceeds the model's 4 layers"):
        load_adapter(AdapterConfig(kind="retrofit", path=str(ckpts["llama"]), block=(1, 9), n_loops=2))
    with pytest.raises(ValueError, match="is not a directory"):
        load_adapter(AdapterConfig(kind="dory", path=str(tmp_path / "missing")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        load_adapter(AdapterConfig(kind="dory", path=str(tmp_path / "empty")))


def test_checkpoint_hash_follows_the_weights(ckpts, tmp_path):
    from pipeline.adapters.hf import checkpoint_hash
    from pipeline.interface import file_sha256

    d = ckpts["llama"]
    files = sorted(p for p in d.iterdir() if p.suffix == ".safetensors")
    assert files
    import hashlib

    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + b"\0" + file_sha256(f).encode() + b"\n")
    assert checkpoint_hash(d) == h.hexdigest()
    assert np.unique([checkpoint_hash(ckpts[k]) for k in ("dory", "llama", "inkling")]).size == 3
