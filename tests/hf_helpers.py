"""Tiny random-weight Hugging Face checkpoints for the adapter and text tests (nothing is downloaded).

Every builder saves a ``save_pretrained`` directory with a small byte-level BPE tokenizer trained here,
so ``AutoTokenizer`` and ``AutoModelForCausalLM`` load both from the directory with ``local_files_only``.
The vocabulary is 300 > ``dump.full_logits_max_vocab`` (256), so the default dump runs in top-k mode.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import yaml

REPO = Path(__file__).resolve().parents[1]

VOCAB = 300
CORPUS = [
    "The cat sat on the mat, and then it ran to the door.",
    "In 1999 there were 42 cats in the house; each of them was hungry!",
    "A quick brown fox jumps over the lazy dog 3 times before noon.",
    "She said that it would rain, but we walked to the park anyway.",
    "Numbers like 3.14 and 2,718 appear in the text: they are numbers.",
]


def tokenizer(vocab: int = 280):
    """A byte-level BPE ``PreTrainedTokenizerFast`` (bos/eos/unk specials) trained on :data:`CORPUS`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def _jitter(model, std: float = 0.02, seed: int = 0) -> None:
    # several parameters start at exactly 0 or 1 (block-attention queries, gates): perturb all of them so
    # that every path of the model is exercised by the equality checks
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.dtype) * std)


def _save(model, path: Path, tok=None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    (tok or tokenizer()).save_pretrained(path)
    return path


def dory_config(**over):
    from transformers import DoryConfig

    kw = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=5, num_attention_heads=2,
              num_key_value_heads=1, head_dim=16, n_input_layers=1, n_output_layers=2, n_recurrent_loops=3,
              sliding_window=4, max_position_embeddings=128, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    kw.update(over)
    return DoryConfig(**kw)


def build_dory(path: Path, dtype=torch.float32, **over) -> Path:
    """Dory: 1 prelude, 2 recurrent × 3 loops, 2 coda layers, d_model 32."""
    from transformers import DoryForCausalLM

    torch.manual_seed(0)
    model = DoryForCausalLM(dory_config(**over)).eval()
    _jitter(model)
    return _save(model.to(dtype), path)


def inkling_config(**over):
    from transformers.models.inkling2_loop import Inkling2LoopTextConfig

    kw = dict(vocab_size=VOCAB, unpadded_vocab_size=VOCAB - 4, hidden_size=32, num_hidden_layers=6,
              num_attention_heads=2, num_key_value_heads=1, head_dim=16, swa_num_attention_heads=2,
              swa_num_key_value_heads=1, swa_head_dim=16, sliding_window_size=4, d_rel=4, rel_extent=8,
              moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2, n_layers_per_attn_res_block=2,
              loop_layer_index_start=2, loop_layer_index_end=4, loop_num_passes=3, loop_gate_rank=4,
              max_position_embeddings=128, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    kw.update(over)
    return Inkling2LoopTextConfig(**kw)


def build_inkling(path: Path, **over) -> Path:
    """Inkling2Loop (text): layers [2, 4) looped 3 times, block-attention residual blocks of 2 layers."""
    from transformers.models.inkling2_loop import Inkling2LoopForCausalLM

    torch.manual_seed(0)
    model = Inkling2LoopForCausalLM(inkling_config(**over)).eval()
    _jitter(model)
    return _save(model, path)


def build_llama(path: Path, dtype=torch.float32, n_layers: int = 4) -> Path:
    """A plain 4-layer Llama (d_model 32) for the retrofit adapter."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=n_layers,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = LlamaForCausalLM(cfg).eval()
    return _save(model.to(dtype), path)


# ---------------------------------------------------------------------------------------------
# Stand-ins for the remote-code models (their code is not on this machine): minimal modules that
# implement the interfaces the adapters are written against (docs/adapters.md), loaded through the real
# trust_remote_code + local_files_only path.
# ---------------------------------------------------------------------------------------------

_OURO_CONFIG = '''
from transformers import PretrainedConfig


class FakeOuroConfig(PretrainedConfig):
    model_type = "fake_ouro"

    def __init__(self, vocab_size=300, hidden_size=16, num_hidden_layers=2, total_ut_steps=4, **kw):
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.num_hidden_layers, self.total_ut_steps = num_hidden_layers, total_ut_steps
        super().__init__(**kw)
'''

_OURO_MODEL = '''
import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from .configuration_fake_ouro import FakeOuroConfig


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, h):
        return h + self.down(torch.tanh(self.up(self.norm(h))))


class FakeOuroModel(PreTrainedModel):
    config_class = FakeOuroConfig

    def __init__(self, config):
        super().__init__(config)
        d = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, d)
        self.layers = nn.ModuleList([Block(d) for _ in range(config.num_hidden_layers)])
        self.norm = nn.LayerNorm(d)
        self.early_exit_gate = nn.Linear(d, 1)
        self.post_init()

    def forward(self, input_ids=None, use_cache=None, **kw):
        h = self.embed_tokens(input_ids)
        hidden_states_list, gate_list = [], []
        for _ in range(self.config.total_ut_steps):
            for layer in self.layers:
                h = layer(h)
            h = self.norm(h)
            hidden_states_list.append(h)
            gate_list.append(self.early_exit_gate(h))
        return BaseModelOutputWithPast(last_hidden_state=h), hidden_states_list, gate_list


class FakeOuroForCausalLM(PreTrainedModel):
    config_class = FakeOuroConfig

    def __init__(self, config):
        super().__init__(config)
        self.model = FakeOuroModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, input_ids=None, use_cache=None, **kw):
        out, hs, gates = self.model(input_ids=input_ids)
        return CausalLMOutputWithPast(logits=self.lm_head(hs[-1]))
'''

_HUGINN_CONFIG = '''
from transformers import PretrainedConfig


class FakeRavenConfig(PretrainedConfig):
    model_type = "fake_huginn_raven"

    def __init__(self, vocab_size=300, n_embd=16, mean_recurrence=5, init_std=1.0, **kw):
        self.vocab_size, self.n_embd, self.mean_recurrence, self.init_std = vocab_size, n_embd, mean_recurrence, init_std
        super().__init__(**kw)
'''

_HUGINN_MODEL = '''
import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_fake_huginn import FakeRavenConfig


class FakeRavenForCausalLM(PreTrainedModel):
    config_class = FakeRavenConfig

    def __init__(self, config):
        super().__init__(config)
        d = config.n_embd
        self.wte = nn.Embedding(config.vocab_size, d)
        self.prelude = nn.Linear(d, d)
        self.adapter = nn.Linear(2 * d, d)
        self.core = nn.Linear(d, d)
        self.coda = nn.Linear(d, d)
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, config.vocab_size, bias=False)
        self.post_init()

    def get_output_embeddings(self):
        return self.lm_head

    def embed_inputs(self, input_ids, **kw):
        return torch.tanh(self.prelude(self.wte(input_ids))), 0

    def initialize_state(self, input_embeds, scale=1.0):
        return torch.randn_like(input_embeds) * self.config.init_std * scale

    def iterate_one_step(self, input_embeds, x, block_idx=0, **kw):
        x = x + torch.tanh(self.core(self.adapter(torch.cat([x, input_embeds], dim=-1))))
        return x, block_idx + 1, None

    def predict_from_latents(self, latents, **kw):
        return CausalLMOutputWithPast(logits=self.lm_head(self.ln_f(torch.tanh(self.coda(latents)))))

    def forward(self, input_ids=None, num_steps=None, **kw):
        e, idx = self.embed_inputs(input_ids)
        x = self.initialize_state(e)
        for _ in range(num_steps or self.config.mean_recurrence):
            x, idx, _ = self.iterate_one_step(e, x, block_idx=idx)
        return self.predict_from_latents(x)
'''


def _remote(path: Path, name: str, cfg_src: str, model_src: str, cfg_cls: str, model_cls: str,
            config: dict) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / f"configuration_{name}.py").write_text(cfg_src)
    (path / f"modeling_{name}.py").write_text(model_src)
    config = {**config, "auto_map": {"AutoConfig": f"configuration_{name}.{cfg_cls}",
                                     "AutoModelForCausalLM": f"modeling_{name}.{model_cls}"}}
    (path / "config.json").write_text(json.dumps(config))
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        __import__("transformers").AutoConfig.from_pretrained(path, trust_remote_code=True, local_files_only=True),
        trust_remote_code=True)
    model.save_pretrained(path)
    # save_pretrained rewrites config.json: keep the auto_map that points at the local code
    saved = json.loads((path / "config.json").read_text())
    saved["auto_map"] = config["auto_map"]
    (path / "config.json").write_text(json.dumps(saved))
    tokenizer().save_pretrained(path)
    return path


def build_fake_ouro(path: Path) -> Path:
    """A remote-code stand-in with Ouro's interface: 2 shared blocks × 4 steps, per-step norm and exit gate."""
    return _remote(path, "fake_ouro", _OURO_CONFIG, _OURO_MODEL, "FakeOuroConfig", "FakeOuroForCausalLM",
                   {"model_type": "fake_ouro", "vocab_size": VOCAB, "hidden_size": 16, "num_hidden_layers": 2,
                    "total_ut_steps": 4})


def build_fake_huginn(path: Path) -> Path:
    """A remote-code stand-in with Huginn's step API (random initial state, 5 recurrence steps)."""
    return _remote(path, "fake_huginn", _HUGINN_CONFIG, _HUGINN_MODEL, "FakeRavenConfig", "FakeRavenForCausalLM",
                   {"model_type": "fake_huginn_raven", "vocab_size": VOCAB, "n_embd": 16, "mean_recurrence": 5})


# ---------------------------------------------------------------------------------------------
# A corpus and the LM profile for tiny runs
# ---------------------------------------------------------------------------------------------

def corpus(path, n=60, seed=0):
    """A JSONL corpus of ``n`` short documents of :data:`CORPUS` words (each ends with its index: distinct)."""
    rng = np.random.default_rng(seed)
    words = " ".join(CORPUS).split()
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"text": " ".join(rng.choice(words, size=int(rng.integers(8, 20)))) + f" {i}."}) + "\n")
    return path


def lm_params(tmp_path, ckpt, corpus_path, **adapter):
    """The repository's LM profile (params.yaml + profiles/lm/params.yaml, merged into one file) with paths and
    sizes for a tiny run."""
    from looptrace.config import read_params

    p = read_params([REPO / "params.yaml", REPO / "profiles" / "lm" / "params.yaml"])
    p["base"]["threads"] = 1
    p["dump"]["adapter"].update(path=str(ckpt), dtype="float32", name="tiny", **adapter)
    p["dump"]["text"].update(path=str(corpus_path), seq_len=16)
    p["dump"].update(sequences={"fit": 4, "val": 4, "test": 4}, batch_size=3, chunk_tokens=20)
    out = tmp_path / "params-lm.yaml"
    out.write_text(yaml.safe_dump(p, sort_keys=False))
    return out
