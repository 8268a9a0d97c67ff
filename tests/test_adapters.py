"""HF adapters on tiny random-weight checkpoints built here (nothing downloaded).

Independent references: the model's own ``output_hidden_states`` (per-loop states at the matching
layer-call indices), the model's own forward logits, and — for every intermediate exit — the same
checkpoint loaded with fewer loops (a T-loop run's first t loops are a t-loop run, so the t-loop model's
logits are what an exit after loop t must produce). Retrofit looping is checked against a plain Llama
whose layer list repeats the block (shared weights).
"""

from __future__ import annotations

import copy
import re

import numpy as np
import pytest
import torch
from torch import nn

from looptrace.config import ConfigError
from looptrace.models.adapters.loading import AdapterConfig, load_adapter
from tests import hf_helpers as H
from tests.conftest import REPO

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {"dory": H.build_dory(root / "dory"), "inkling": H.build_inkling(root / "inkling"),
            "llama": H.build_llama(root / "llama"), "ouro": H.build_ouro(root / "ouro"),
            "huginn": H.build_huginn(root / "huginn")}


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


# (the ouro / huginn adapters: tests/test_remote_adapters.py)


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
    from looptrace.models.adapters.loading import checkpoint_hash
    from looptrace.models.interface import file_sha256

    d = ckpts["llama"]
    files = sorted(p for p in d.iterdir() if p.suffix == ".safetensors")
    assert files
    import hashlib

    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + b"\0" + file_sha256(f).encode() + b"\n")
    assert checkpoint_hash(d) == h.hexdigest()
    assert np.unique([checkpoint_hash(ckpts[k]) for k in ("dory", "llama", "inkling")]).size == 3


# ----------------------------------------------------------------------------- through the dump


def _text_batch(path, n=4, seq_len=10):
    from looptrace.tasks import TaskBatch

    ids = _ids(b=n, s=seq_len + 1, seed=3).numpy()
    tokens, targets = ids[:, :-1], ids[:, 1:]
    return TaskBatch(tokens, targets, np.full_like(tokens, -1), np.zeros_like(tokens))


def test_topk_stats_equal_full_logit_stats_and_full_logits(ckpts):
    from looptrace.capture.dump import DumpConfig, dump_split
    from looptrace.io.store.location import memory_store

    a = load_adapter(AdapterConfig(kind="inkling2loop", path=str(ckpts["inkling"])))
    assert a.info.vocab_size == 296 > DumpConfig().full_logits_max_vocab
    data = _text_batch(ckpts["inkling"])
    topk = dump_split(a, data, memory_store(), DumpConfig(batch_size=3, chunk_tokens=16, hidden_dtype="float32"))
    full = dump_split(a, data, memory_store(), DumpConfig(batch_size=3, chunk_tokens=16, hidden_dtype="float32",
                                                           full_logits_max_vocab=1000))
    assert "topk_ids" in topk and "logits" not in topk and "logits" in full
    from looptrace.io.store.schema import STAT_NAMES

    for s in STAT_NAMES:  # exact either way: both computed from the full logits at dump time
        np.testing.assert_array_equal(topk.read(s), full.read(s))
    z = torch.from_numpy(full.read("logits"))
    top = z.topk(16, dim=-1)
    np.testing.assert_array_equal(topk.read("topk_ids"), top.indices.numpy())
    np.testing.assert_array_equal(topk.read("topk_logits"), top.values.numpy())
    # and the full logits are the model's own exits: loop T = the model's forward
    with torch.no_grad():
        ref = a.model(torch.from_numpy(data.tokens)).logits.reshape(-1, 296)
    close(z[:, -1], ref)


def test_bf16_model_states_stored_exactly_as_bfloat16_bits(tmp_path):
    from looptrace.capture.dump import DumpConfig, dump_split
    from looptrace.io.store.location import memory_store

    path = H.build_dory(tmp_path / "dory-bf16", dtype=torch.bfloat16)
    a = load_adapter(AdapterConfig(kind="dory", path=str(path), dtype="auto"))
    assert a.dtype == torch.bfloat16 and a.info.extra["dtype"] == "bfloat16"
    data = _text_batch(path, n=2)
    st = dump_split(a, data, memory_store(), DumpConfig(batch_size=2, chunk_tokens=8, hidden_dtype="auto"))
    assert st.attrs["dtypes"]["hidden"] == st.attrs["dtypes"]["hidden_init"] == "bfloat16"
    ref = a.states(torch.from_numpy(data.tokens))
    np.testing.assert_array_equal(st.read("hidden"), ref.hidden.float().reshape(-1, 3, 32).numpy())
    np.testing.assert_array_equal(st.read("hidden_init"), ref.hidden_init.float().reshape(-1, 32).numpy())


def test_float16_overflow_is_refused_not_stored_as_inf(ckpts):
    from looptrace.capture.dump import DumpConfig, dump_split
    from looptrace.io.store.location import memory_store
    from looptrace.io.store.schema import StoreError

    a = load_adapter(AdapterConfig(kind="retrofit", path=str(ckpts["llama"]), block=(1, 3), n_loops=2))
    with torch.no_grad():
        a.model.model.embed_tokens.weight.mul_(1e8)  # embeddings ~1e6 (init std 0.02): beyond float16
    a._verified = True
    data = _text_batch(ckpts["llama"], n=2)
    with pytest.raises((StoreError, ValueError), match="beyond float16's largest finite value 65504"):
        dump_split(a, data, memory_store(), DumpConfig(batch_size=2, chunk_tokens=8, hidden_dtype="float16"))
    st = dump_split(a, data, memory_store(), DumpConfig(batch_size=2, chunk_tokens=8, hidden_dtype="float32"))
    assert st.attrs["nan_count"] == 0 and np.abs(st.read("hidden")).max() > 65504


def test_cli_dumps_every_kind_and_ouro_gate_reaches_q_exit(ckpts, tmp_path, monkeypatch):
    import builtins

    import polars as pl
    from typer.testing import CliRunner

    from looptrace.cli import app
    from looptrace.io.store.reader import open_store

    prompts = []  # bug 6: the tokenizer of a remote-code directory asked "Do you wish to run ...? [y/N]"
    monkeypatch.setattr(builtins, "input", lambda *a, **k: prompts.append(a) or "n")  # (transformers swallows raises)
    text = H.corpus(tmp_path / "corpus.jsonl")
    run = CliRunner().invoke
    art = tmp_path / "artifacts"
    for kind, key, extra in (("inkling2loop", "inkling", {}), ("retrofit", "llama", {"block": [1, 3], "n_loops": 2}),
                             ("ouro", "ouro", {"trust_remote_code": True}),
                             ("huginn", "huginn", {"trust_remote_code": True})):
        d = tmp_path / kind
        d.mkdir()
        params = H.lm_params(d, ckpts[key], text, kind=kind, **extra)
        r = run(app, ["dump", "--params", str(params), "--out", str(art / kind / "dump")])
        assert r.exit_code == 0, (kind, r.output)
        assert not prompts, (kind, prompts)
        st = open_store(art / kind / "dump" / "tiny" / "test.zarr")
        assert st.attrs["model"]["extra"]["adapter"] == kind and st.n_loops == {"inkling2loop": 3, "retrofit": 2,
                                                                                   "ouro": 4, "huginn": 4}[kind]
    # Ouro: the native gate is stored and the readouts stage evaluates its Q-exit
    st = open_store(art / "ouro" / "dump" / "tiny" / "val.zarr")
    assert st.has_gate
    a = load_adapter(AdapterConfig(kind="ouro", path=str(ckpts["ouro"]), trust_remote_code=True))
    seq, pos = st.read("sequence"), st.read("position")
    from looptrace.tasks.text import TextConfig, text_splits

    b = text_splits(TextConfig(path=str(text), seq_len=16), {"val": 4}, ckpts["ouro"], H.VOCAB, True)["val"]
    g = a.states(torch.from_numpy(b.tokens)).gate_logits.numpy()  # (sequence, position, loop)
    assert g.shape[:2] == b.tokens.shape and len(seq) > 0  # rows whose prefix is scored in fit/test are unscored
    np.testing.assert_allclose(st.read("gate_logit"), g[seq, pos], rtol=1e-6, atol=1e-6)
    d = tmp_path / "ouro"
    for cmd in (["geometry", "--model", "tiny", "--dump-root", str(art / "ouro" / "dump"), "--out",
                 str(art / "ouro" / "geometry")],
                ["readouts", "--model", "tiny", "--geometry-root", str(art / "ouro" / "geometry"), "--out",
                 str(art / "ouro" / "readouts")]):
        r = run(app, [*cmd, "--params", str(d / "params-lm.yaml")])
        assert r.exit_code == 0, (cmd[0], r.output)
    ops = pl.read_parquet(art / "ouro" / "readouts" / "tiny" / "operating_points.parquet")
    assert "q_exit" in set(ops["rule"].unique())
    # Ouro's own Q-exit arithmetic (model dtype) is a named rule beside the exact float64 q_exit
    import yaml

    p = yaml.safe_load((d / "params-lm.yaml").read_text())
    p["readouts"]["rules"] = ["fixed", "q_exit", "q_exit_float32"]
    (d / "params-q.yaml").write_text(yaml.safe_dump(p, sort_keys=False))
    r = run(app, ["readouts", "--model", "tiny", "--geometry-root", str(art / "ouro" / "geometry"), "--out",
                  str(art / "ouro" / "readouts-q"), "--params", str(d / "params-q.yaml")])
    assert r.exit_code == 0, r.output
    ops = pl.read_parquet(art / "ouro" / "readouts-q" / "tiny" / "operating_points.parquet")
    assert set(ops["rule"].unique()) == {"fixed", "q_exit", "q_exit_float32"}
    assert set(ops.filter(pl.col("rule") == "q_exit_float32")["kind"].unique()) == {"native"}


# ---------------------------------------------------------------------------------------------- the kind registry

PROBE = """
from looptrace.models.adapters.base import HFAdapter


class ProbeAdapter(HFAdapter):
    remote_class = "modeling_probe.ProbeForCausalLM"
    tied_source = "wte.weight"
    no_decoder = "a probe"

    def __init__(self, model, spec, device):
        self.model, self.spec, self.cfg = model, spec, spec
"""


@pytest.mark.parametrize("how", ["table line", "entry point"])
def test_every_list_of_adapter_kinds_derives_from_the_registry(tmp_path, monkeypatch, how):
    """A kind added as one module and one table line (or an installed package's entry point) is accepted by the
    config, built by load_adapter, known to the shim when it runs remote code, listed by the help, and refused by
    hf_decoder while it has no decoder; a module that is not an adapter is one line."""
    from looptrace.cli import vocabulary
    from looptrace.models.adapters import compat, loading
    from looptrace.models.adapters.decoding import hf_decoder
    from looptrace.models.adapters.kinds import ENTRY_POINT_GROUP, KINDS
    from looptrace.models.decode import DecodeUnsupported
    from looptrace.registry import RegistryError

    (tmp_path / "probe_adapter.py").write_text(PROBE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(KINDS, "_table", dict(KINDS._table))
    monkeypatch.setattr(KINDS, "_loaded", dict(KINDS._loaded))
    if how == "table line":
        KINDS.add("probe_kind", "probe_adapter:ProbeAdapter")
    else:
        dist = tmp_path / "probe_adapter-0.1.dist-info"
        dist.mkdir()
        (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: probe-adapter\nVersion: 0.1\n")
        (dist / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\nprobe_kind = probe_adapter:ProbeAdapter\n")
    assert "probe_kind" in KINDS.names() and "probe_kind" in vocabulary("adapters")
    with pytest.raises(ConfigError, match="trust_remote_code"):
        AdapterConfig(kind="probe_kind", path="x")
    spec = AdapterConfig(kind="probe_kind", path="x", trust_remote_code=True)
    monkeypatch.setattr(loading, "load_hf_model", lambda spec, device: "the model")
    adapter = load_adapter(spec)
    assert type(adapter).__name__ == "ProbeAdapter" and adapter.model == "the model"
    assert compat.family_classes()["probe_kind"] == "modeling_probe.ProbeForCausalLM"
    assert compat.family_of({"AutoModelForCausalLM": "modeling_probe.ProbeForCausalLM"}) == "probe_kind"
    with pytest.raises(DecodeUnsupported, match="no loop-by-loop decoder \\(a probe\\)"):
        hf_decoder(adapter, "share")
    for ref, why in (("probe_adapter:NOTHING", "has no attribute 'NOTHING'"),
                     ("probe_adapter:HFAdapter.kind", "is not an adapter class"), ("no_such_mod:X", "cannot import")):
        KINDS.add("not_a_kind", ref, replace=True)
        with pytest.raises(RegistryError, match="adapter kind 'not_a_kind'") as info:
            AdapterConfig(kind="not_a_kind", path="x")
        assert why in str(info.value) and "\n" not in str(info.value), str(info.value)
    with pytest.raises(ValueError, match="registered twice"):
        KINDS.add("dory", "probe_adapter:ProbeAdapter")


def test_docs_table_lists_every_registered_kind():
    from looptrace.models.adapters.kinds import KINDS

    text = (REPO / "docs" / "adapters.md").read_text().split("## Adapter kinds", 1)[1].split("\n### ", 1)[0]
    assert sorted(re.findall(r"^\| `(\w+)` \|", text, re.M)) == sorted(KINDS)
