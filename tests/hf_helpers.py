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
# Stand-ins for the remote-code models (Ouro, Huginn, Nanbeige)
#
# The published code cannot be committed, so CI runs stand-ins written here that copy its *interfaces and
# traits*, not its text: the same file, class and method names, signatures, return types, cache classes, norm
# placement and random-number use (docs/adapters.md, "Stand-ins"), and the 4.x-era habits that break under
# transformers 5 (a list-valued ``_tied_weights_keys``, ``past_key_values=`` in an output dataclass, a config
# that passes ``tie_word_embeddings`` itself, ``ROPE_INIT_FUNCTIONS['default']``, ``create_causal_mask
# (input_embeds=...)``, no ``pad_token_id`` default, a cache whose ``get_mask_sizes`` takes a tensor; Nanbeige's
# ``rope_scaling["type"]``, a rotary buffer only its ``__init__`` computes, ``DynamicCache.from_legacy_cache``, a
# ``prepare_inputs_for_generation`` of the 4.x contract, no ``GenerationMixin`` base). Each trait is there because
# a looptrace bug or a load failure hid behind its absence (tests/test_adapters.py says which).
# The maths is small and random-weight; tests/test_real_code.py checks the adapters against the real code.
# ---------------------------------------------------------------------------------------------

_OURO_CONFIG = '''
from transformers import PretrainedConfig


class OuroConfig(PretrainedConfig):
    """Stand-in of Ouro's configuration_ouro.OuroConfig (same names and defaults that matter)."""

    model_type = "ouro"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(self, vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, hidden_act="silu", max_position_embeddings=128,
                 initializer_range=0.02, rms_norm_eps=1e-6, use_cache=True, tie_word_embeddings=False,
                 rope_theta=10000.0, rope_scaling=None, use_sliding_window=False, sliding_window=None,
                 max_window_layers=2, layer_types=None, attention_dropout=0.0, total_ut_steps=4,
                 early_exit_threshold=1.0, **kwargs):
        self.vocab_size, self.hidden_size, self.intermediate_size = vocab_size, hidden_size, intermediate_size
        self.num_hidden_layers, self.num_attention_heads = num_hidden_layers, num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.hidden_act, self.max_position_embeddings = hidden_act, max_position_embeddings
        self.initializer_range, self.rms_norm_eps, self.use_cache = initializer_range, rms_norm_eps, use_cache
        self.rope_theta, self.rope_scaling = rope_theta, rope_scaling
        self.use_sliding_window, self.max_window_layers = use_sliding_window, max_window_layers
        self.sliding_window = sliding_window if use_sliding_window else None
        self.attention_dropout = attention_dropout
        # read by OuroModel / OuroForCausalLM at construction (total_ut_steps is copied into the instance)
        self.total_ut_steps, self.early_exit_threshold = total_ut_steps, early_exit_threshold
        self.layer_types = layer_types or ["full_attention"] * num_hidden_layers
        # no pad_token_id here: transformers 4.x's PretrainedConfig defined it, 5.x does not
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
'''

_OURO_MODEL = '''
"""Stand-in of Ouro's modeling_ouro.py (interfaces of the published code; tests/hf_helpers.py)."""
from typing import Any

import torch
from torch import nn
from transformers.cache_utils import Cache
from transformers.generation import GenerationMixin
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.modeling_utils import PreTrainedModel

from .configuration_ouro import OuroConfig


class UniversalTransformerCache(Cache):
    """One key/value slot per (step, layer): slot current_ut * L + layer_idx, grown along the sequence."""

    def __init__(self, max_cache_size=None):
        # like the published cache: Cache.__init__ is not called (it assumes fixed layer storage)
        self.key_cache: list = []
        self.value_cache: list = []
        self.layers: list[Any] = []
        self._seen_tokens = 0
        self.max_cache_size = max_cache_size

    def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
        if self.max_cache_size is not None and layer_idx >= self.max_cache_size:
            raise IndexError(f"cache slot {layer_idx} >= max_cache_size {self.max_cache_size}")
        while len(self.key_cache) <= layer_idx:
            self.key_cache.append(None)
            self.value_cache.append(None)
        if self.key_cache[layer_idx] is None:
            self.key_cache[layer_idx], self.value_cache[layer_idx] = key_states, value_states
        else:
            self.key_cache[layer_idx] = torch.cat([self.key_cache[layer_idx], key_states], dim=2)
            self.value_cache[layer_idx] = torch.cat([self.value_cache[layer_idx], value_states], dim=2)
        self._seen_tokens = self.key_cache[layer_idx].shape[2]
        return self.key_cache[layer_idx], self.value_cache[layer_idx]

    def get_seq_length(self, layer_idx=0):
        layer_idx = layer_idx or 0
        if layer_idx >= len(self.key_cache) or self.key_cache[layer_idx] is None:
            return 0
        return self.key_cache[layer_idx].shape[2]

    def get_mask_sizes(self, cache_position, layer_idx=0):
        # the transformers-4.x signature: a cache_position tensor
        return self.get_seq_length(layer_idx) + cache_position.shape[0], 0

    def reorder_cache(self, beam_idx):
        for i, k in enumerate(self.key_cache):
            if k is not None:
                self.key_cache[i] = k.index_select(0, beam_idx.to(k.device))
                self.value_cache[i] = self.value_cache[i].index_select(0, beam_idx.to(k.device))

    def clear(self):
        self.key_cache, self.value_cache, self._seen_tokens = [], [], 0


def needs_universal_cache(cache, max_cache_size):
    return cache is None or (isinstance(cache, Cache) and not isinstance(cache, UniversalTransformerCache)
                             and getattr(cache, "layer_class_to_replicate", None) is None
                             and len(getattr(cache, "layers", [])) < (max_cache_size or 0)
                             and cache.get_seq_length() == 0)


class OuroRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        dtype = hidden_states.dtype
        h = hidden_states.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(dtype)


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


class OuroRotaryEmbedding(nn.Module):
    def __init__(self, config, device=None):
        super().__init__()
        scaling = getattr(config, "rope_scaling", None)
        self.rope_type = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else "default"
        self.config = config
        self.rope_init_fn = ROPE_INIT_FUNCTIONS[self.rope_type]  # transformers 5: no 'default' entry
        inv_freq, self.attention_scaling = self.rope_init_fn(self.config, device)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.original_inv_freq = self.inv_freq

    @torch.no_grad()
    def forward(self, x, position_ids):
        freqs = (self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
                 @ position_ids[:, None, :].float()).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


class OuroMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        d, i = config.hidden_size, config.intermediate_size
        self.gate_proj, self.up_proj = nn.Linear(d, i, bias=False), nn.Linear(d, i, bias=False)
        self.down_proj = nn.Linear(i, d, bias=False)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class OuroAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.n_heads, self.n_kv = config.num_attention_heads, config.num_key_value_heads
        self.q_proj = nn.Linear(config.hidden_size, self.n_heads * self.head_dim, bias=True)
        self.k_proj = nn.Linear(config.hidden_size, self.n_kv * self.head_dim, bias=True)
        self.v_proj = nn.Linear(config.hidden_size, self.n_kv * self.head_dim, bias=True)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, hidden_states, position_embeddings, attention_mask, past_key_value=None, cache_position=None,
                current_ut=0, **kwargs):
        B, S, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(B, S, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(B, S, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(B, S, -1, self.head_dim).transpose(1, 2)
        cos, sin = position_embeddings
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        if past_key_value is not None:  # one slot per (step, layer)
            k, v = past_key_value.update(k, v, current_ut * self.config.num_hidden_layers + self.layer_idx,
                                         {"cache_position": cache_position})
        rep = self.n_heads // self.n_kv
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        mask = attention_mask[:, :, :, : k.shape[-2]] if isinstance(attention_mask, torch.Tensor) else None
        out = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                         is_causal=mask is None and q.shape[2] == k.shape[2] > 1)
        return self.o_proj(out.transpose(1, 2).reshape(B, S, -1)), None


class OuroDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn, self.mlp = OuroAttention(config, layer_idx), OuroMLP(config)
        d, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm, self.input_layernorm_2 = OuroRMSNorm(d, eps), OuroRMSNorm(d, eps)
        self.post_attention_layernorm, self.post_attention_layernorm_2 = OuroRMSNorm(d, eps), OuroRMSNorm(d, eps)
        self.attention_type = config.layer_types[layer_idx]

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_value=None, use_cache=False,
                cache_position=None, position_embeddings=None, **kwargs):
        # sandwich norms; returns a Tensor (not a tuple)
        residual = hidden_states
        h, _ = self.self_attn(self.input_layernorm(hidden_states), position_embeddings, attention_mask,
                              past_key_value=past_key_value, cache_position=cache_position, **kwargs)
        hidden_states = residual + self.input_layernorm_2(h)
        residual = hidden_states
        h = self.mlp(self.post_attention_layernorm(hidden_states))
        return residual + self.post_attention_layernorm_2(h)


class OuroPreTrainedModel(PreTrainedModel):
    config_class = OuroConfig
    base_model_prefix = "model"
    _no_split_modules = ["OuroDecoderLayer"]
    _skip_keys_device_placement = ["past_key_values"]
    _supports_sdpa = True


class OuroModel(OuroPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.padding_idx = config.pad_token_id  # transformers 5: no such attribute unless the config sets it
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList([OuroDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = OuroRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = OuroRotaryEmbedding(config=config)
        self.has_sliding_layers = "sliding_attention" in config.layer_types
        self.total_ut_steps = getattr(config, "total_ut_steps", 4)  # copied once: later config edits do nothing
        self.early_exit_gate = nn.Linear(config.hidden_size, 1)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, use_cache=None, cache_position=None, **kwargs):
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache:
            size = self.config.num_hidden_layers * (getattr(self.config, "total_ut_steps", 1) or 1)
            if needs_universal_cache(past_key_values, size):
                past_key_values = UniversalTransformerCache(size)
        if cache_position is None:
            seen = past_key_values.get_seq_length() if past_key_values is not None else 0
            cache_position = torch.arange(seen, seen + inputs_embeds.shape[1], device=inputs_embeds.device)
        if position_ids is None:
            position_ids = cache_position.unsqueeze(0)
        mask_kwargs = {"config": self.config, "input_embeds": inputs_embeds, "attention_mask": attention_mask,
                       "cache_position": cache_position, "past_key_values": past_key_values,
                       "position_ids": position_ids}  # transformers-4.55 keyword names
        masks = {"full_attention": create_causal_mask(**mask_kwargs)}
        if self.has_sliding_layers:
            masks["sliding_attention"] = create_sliding_window_causal_mask(**mask_kwargs)
        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        hidden_states_list, gate_list = [], []
        for current_ut in range(self.total_ut_steps):
            for layer in self.layers[: self.config.num_hidden_layers]:
                hidden_states = layer(hidden_states, attention_mask=masks[layer.attention_type],
                                      position_ids=position_ids, past_key_value=past_key_values,
                                      use_cache=use_cache, cache_position=cache_position,
                                      position_embeddings=position_embeddings, current_ut=current_ut)
            hidden_states = self.norm(hidden_states)  # the normed state feeds the next step
            hidden_states_list.append(hidden_states)
            gate_list.append(self.early_exit_gate(hidden_states))
        out = BaseModelOutputWithPast(last_hidden_state=hidden_states,
                                      past_key_values=past_key_values if use_cache else None)
        return out, hidden_states_list, gate_list


class OuroForCausalLM(OuroPreTrainedModel, GenerationMixin):
    _tied_weights_keys = ["lm_head.weight"]  # transformers-4.x form

    def __init__(self, config):
        super().__init__(config)
        self.model = OuroModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.early_exit_step = getattr(config, "early_exit_step", None)
        self.early_exit_threshold = getattr(config, "early_exit_threshold", None)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache=None, cache_position=None, logits_to_keep=0,
                use_weighted_exit=False, exit_at_step=None, exit_threshold=None, **kwargs):
        exit_at_step = exit_at_step if exit_at_step is not None else self.early_exit_step
        exit_threshold = exit_threshold if exit_threshold is not None else self.early_exit_threshold
        outputs, hs, gates = self.model(input_ids=input_ids, attention_mask=attention_mask,
                                        position_ids=position_ids, past_key_values=past_key_values,
                                        inputs_embeds=inputs_embeds, use_cache=use_cache,
                                        cache_position=cache_position, **kwargs)
        keep = slice(-logits_to_keep, None)
        # exit pdf in the model dtype: p_t = lambda_t * remaining (t < T), the last step takes the remainder
        pdf, rem = [], torch.ones_like(gates[0].squeeze(-1))
        for t, g in enumerate(gates):
            lam = torch.sigmoid(g.squeeze(-1))
            if t < len(gates) - 1:
                pdf.append(lam * rem)
                rem = rem * (1.0 - lam)
            else:
                pdf.append(rem)
        pdf = torch.stack(pdf, dim=2)
        if labels is not None or (use_weighted_exit and exit_at_step is None and exit_threshold is None):
            logits = sum(self.lm_head(h[:, keep]) * pdf[:, keep, t, None].to(h.dtype) for t, h in enumerate(hs))
        elif exit_at_step is not None and 0 <= exit_at_step < len(hs):
            logits = self.lm_head(hs[exit_at_step][:, keep])
        elif exit_threshold is not None:  # Q-exit: first step whose CDF (model dtype) reaches the threshold
            hit = torch.cumsum(pdf, dim=2) >= exit_threshold
            step = torch.argmax(hit.float(), dim=2)
            step[~hit.any(dim=2)] = len(hs) - 1
            stacked = torch.stack(hs, dim=2)
            idx = step[..., None, None].expand(-1, -1, 1, stacked.shape[-1])
            logits = self.lm_head(torch.gather(stacked, 2, idx).squeeze(2)[:, keep])
        else:
            logits = self.lm_head(outputs.last_hidden_state[:, keep])
        loss = None
        if labels is not None:
            loss = nn.functional.cross_entropy(logits.float()[:, :-1].reshape(-1, logits.shape[-1]),
                                               labels[:, 1:].reshape(-1))
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=outputs.past_key_values)
'''

_HUGINN_CONFIG = '''
import math

from transformers import PretrainedConfig


class RavenConfig(PretrainedConfig):
    """Stand-in of Huginn's raven_config_minimal.RavenConfig."""

    model_type = "huginn_raven"
    keys_to_ignore_at_inference = ["past_key_values"]
    attribute_map = {"num_attention_heads": "n_heads", "hidden_size": "n_embd", "num_hidden_layers": "n_layers"}

    def __init__(self, n_embd=32, n_heads=2, n_layers=4, block_size=64, vocab_size=300, padding_multiple=4,
                 tie_embeddings=True, intermediate_size=64, bias=False, n_layers_in_recurrent_block=2,
                 mean_recurrence=4, sampling_scheme="poisson-lognormal-filling", mean_backprop_depth=2,
                 n_layers_in_prelude=1, n_layers_in_coda=1, qk_bias=True, rope_base=50000, norm_eps=1e-6,
                 test_time_noise=0, test_time_noise_type="fixed", **kwargs):
        self.n_embd, self.n_heads, self.head_dim = n_embd, n_heads, n_embd // n_heads
        self.n_layers, self.block_size, self.vocab_size = n_layers, block_size, vocab_size
        self.padded_vocab_size = vocab_size
        self.padding_multiple, self.tie_embeddings = padding_multiple, tie_embeddings
        self.intermediate_size, self.bias, self.qk_bias = intermediate_size, bias, qk_bias
        self.n_layers_in_recurrent_block, self.n_layers_in_prelude = n_layers_in_recurrent_block, n_layers_in_prelude
        self.n_layers_in_coda, self.mean_recurrence = n_layers_in_coda, mean_recurrence
        self.sampling_scheme, self.mean_backprop_depth = sampling_scheme, mean_backprop_depth
        self.rope_base, self.norm_eps = rope_base, norm_eps
        self.test_time_noise, self.test_time_noise_type = test_time_noise, test_time_noise_type
        self.effective_expected_depth = (n_layers_in_prelude + n_layers_in_coda
                                         + n_layers_in_recurrent_block * mean_recurrence)
        std = math.sqrt(2 / (5 * n_embd))
        self.init_values = {"std": std, "out_proj": std / math.sqrt(2 * self.effective_expected_depth),
                            "embedding": std, "embed_scale": math.sqrt(n_embd)}
        # like the published config: tie_word_embeddings passed here *and* any in **kwargs (a config.json saved by
        # transformers 5 carries it: "got multiple values for keyword argument 'tie_word_embeddings'")
        super().__init__(tie_word_embeddings=tie_embeddings, **kwargs)
'''

_HUGINN_MODEL = '''
"""Stand-in of Huginn's raven_modeling_minimal.py (interfaces of the published code; tests/hf_helpers.py)."""
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor, nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.utils import ModelOutput

from .raven_config_minimal import RavenConfig


@dataclass
class CausalLMOutputRecurrentLatents(ModelOutput):
    loss: Optional[torch.Tensor] = None
    log_ppl: Optional[torch.Tensor] = None
    logits: Optional[torch.Tensor] = None
    past_key_values: Optional[Cache] = None  # the 4.x field name (transformers 5 renames the keyword to cache)
    latent_states: Optional[torch.Tensor] = None
    hidden_states: Optional[torch.Tensor] = None
    attention_maps: Optional[dict] = None
    stats: Optional[dict] = None


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        h = x.float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


class HuginnDynamicCache(DynamicCache):
    """Keys/values per step index (prelude 0..P-1, core P + Lc*s + j, coda -1, -2...) and absolute position.
    Only the "full" lookup (attend to the positions present at this step) is implemented here."""

    def __init__(self, lookup_strategy="full"):
        super().__init__()
        self._seen_tokens = 0
        self.key_cache: dict = {}
        self.value_cache: dict = {}
        self.lookup_strategy = lookup_strategy

    def update(self, key_states, value_states, step_idx_tensor, lookup_strategy=None):
        step = int(step_idx_tensor)
        if step == 0:
            self._seen_tokens += key_states.shape[-2]
        keys, values = self.key_cache.setdefault(step, {}), self.value_cache.setdefault(step, {})
        start = self._seen_tokens - key_states.shape[-2]
        for i in range(key_states.shape[-2]):
            keys[start + i], values[start + i] = key_states[:, :, i], value_states[:, :, i]
        return torch.stack(list(keys.values()), dim=-2), torch.stack(list(values.values()), dim=-2)

    def get_seq_length(self, step_idx=0):
        return self._seen_tokens

    def reset(self):
        self._seen_tokens, self.key_cache, self.value_cache = 0, {}, {}


def precompute_freqs_cis(dim, end, theta=10000.0):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
    angles = torch.outer(torch.arange(end).float(), freqs)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)[None, :, None]  # [1, end, 1, dim/2, 2]


def apply_rotary_emb_complex_like(q, k, freqs_cis):
    def rot(x):
        x2 = x.float().reshape(*x.shape[:-1], -1, 2)
        c, s = freqs_cis[..., 0], freqs_cis[..., 1]
        out = torch.stack([x2[..., 0] * c - x2[..., 1] * s, x2[..., 0] * s + x2[..., 1] * c], dim=-1)
        return out.flatten(3).type_as(x)

    return rot(q), rot(k)


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.n_head, self.head_dim = config.n_heads, config.n_embd // config.n_heads
        self.Wqkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=False)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=False)
        if config.qk_bias:
            self.qk_bias = nn.Parameter(torch.zeros(2, 1, self.n_head, self.head_dim))

    def forward(self, x, freqs_cis, block_idx, mask=None, past_key_values=None):
        B, S, C = x.shape
        q, k, v = self.Wqkv(x).view(B, S, 3 * self.n_head, self.head_dim).chunk(3, dim=2)
        if hasattr(self, "qk_bias"):
            q, k = q + self.qk_bias[0], k + self.qk_bias[1]
        q, k = apply_rotary_emb_complex_like(q, k, freqs_cis)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, block_idx)
        Sk = k.shape[2]
        if S == Sk:
            y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=S > 1)
        else:  # queries are the last S positions (causal, lower-right aligned)
            allowed = torch.ones(S, Sk, dtype=torch.bool, device=q.device).tril(Sk - S)
            y = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        return self.proj(y.transpose(1, 2).reshape(B, S, C))


class GatedMLP(nn.Module):
    def __init__(self, config, in_features=0):
        super().__init__()
        self.fc = nn.Linear(in_features or config.n_embd, 2 * config.intermediate_size, bias=config.bias)
        self.proj = nn.Linear(config.intermediate_size, config.n_embd, bias=config.bias)
        self.nonlin = nn.SiLU()

    def forward(self, x):
        a, b = self.fc(x).chunk(2, dim=-1)
        return self.proj(self.nonlin(a) * b)


class SandwichBlock(nn.Module):
    def __init__(self, config, layer_id):
        super().__init__()
        d, eps = config.n_embd, config.norm_eps
        self.norm_1, self.attn, self.norm_2 = RMSNorm(d, eps), CausalSelfAttention(config), RMSNorm(d, eps)
        self.norm_3, self.mlp, self.norm_4 = RMSNorm(d, eps), GatedMLP(config), RMSNorm(d, eps)
        self.layer_id = layer_id

    def forward(self, x, freqs_cis, step_idx, mask=None, past_key_values=None):
        x = self.norm_2(self.attn(self.norm_1(x), freqs_cis, step_idx, mask, past_key_values) + x)
        return self.norm_4(self.mlp(self.norm_3(x)) + x)


class RavenPreTrainedModel(PreTrainedModel):
    config_class = RavenConfig
    base_model_prefix = "model"
    _no_split_modules = ["SandwichBlock"]
    _skip_keys_device_placement = ["past_key_values"]
    _tied_weights_keys = ["lm_head.weight"]  # transformers-4.x form
    _supports_sdpa = True

    @property
    def emb_scale(self):
        return self.config.init_values["embed_scale"]

    def _init_weights(self, module):
        pass  # the builder sets every weight; loading keeps the stored ones


class RavenForCausalLM(RavenPreTrainedModel, GenerationMixin):
    def __init__(self, config):
        super().__init__(config)
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.padded_vocab_size, config.n_embd),
            prelude=nn.ModuleList([SandwichBlock(config, i) for i in range(config.n_layers_in_prelude)]),
            adapter=nn.Linear(2 * config.n_embd, config.n_embd, bias=config.bias),
            core_block=nn.ModuleList([SandwichBlock(config, i) for i in range(config.n_layers_in_recurrent_block)]),
            coda=nn.ModuleList([SandwichBlock(config, i) for i in range(config.n_layers_in_coda)]),
            ln_f=RMSNorm(config.n_embd, eps=config.norm_eps),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.padded_vocab_size, bias=False)
        self.register_buffer("freqs_cis", precompute_freqs_cis(config.n_embd // config.n_heads, config.block_size,
                                                               config.rope_base), persistent=True)
        self.post_init()

    def get_input_embeddings(self):
        return self.transformer.wte

    def get_output_embeddings(self):
        return self.lm_head

    def _freqs(self, n, position_ids=None, cache_position=None):
        if position_ids is not None:
            return self.freqs_cis.index_select(1, position_ids.squeeze())
        if cache_position is not None:
            return self.freqs_cis[:, cache_position]
        return self.freqs_cis[:, :n]

    def forward(self, input_ids, input_embeds=None, input_states=None, attention_mask=None, position_ids=None,
                labels=None, num_steps=None, past_key_values=None,
                output_details={"return_logits": True, "return_latents": True, "return_head": False,  # noqa: B006
                                "return_stats": False},
                use_cache=False, cache_position=None, init_scale=1.0, **kwargs):
        freqs_cis = self._freqs(input_ids.shape[1], position_ids, cache_position)
        if input_embeds is None:
            input_embeds = self.transformer.wte(input_ids)
        input_embeds = input_embeds * self.emb_scale
        if use_cache and past_key_values is None:
            past_key_values = HuginnDynamicCache()
        block_idx = torch.tensor(-1, dtype=torch.long)
        for block in self.transformer.prelude:
            block_idx += 1
            input_embeds = block(input_embeds, freqs_cis, block_idx, None, past_key_values)
        x, block_idx = self.iterate_forward(input_embeds, input_states, freqs_cis, block_idx, None,
                                            past_key_values, num_steps, init_scale)
        latent_states = x.clone().detach()  # = ln_f(h_T)
        block_idx = torch.tensor(0, dtype=torch.long)
        for block in self.transformer.coda:
            block_idx -= 1
            x = block(x, freqs_cis, block_idx, None, past_key_values)
        logits = self.lm_head(self.transformer.ln_f(x)).float()
        loss = torch.as_tensor(0.0)
        if labels is not None:
            loss = nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1), ignore_index=-100)
        return CausalLMOutputRecurrentLatents(loss=loss, log_ppl=loss.clone().detach(), logits=logits,
                                              past_key_values=past_key_values, latent_states=latent_states)

    def iterate_forward(self, input_embeds, input_states, freqs_cis, block_idx, mask, past_key_values=None,
                        num_steps=None, init_scale=1.0):
        x = self.initialize_state(input_embeds, scale=init_scale) if input_states is None else input_states.clone()
        steps = self.config.mean_recurrence if num_steps is None else int(num_steps)
        with torch.no_grad():
            for step in range(steps):
                x, block_idx = self.core_block_forward(x, input_embeds, freqs_cis, mask, past_key_values,
                                                       block_idx, step)
        return self.transformer.ln_f(x), block_idx

    def core_block_forward(self, x, input_embeds, freqs_cis, mask, past_key_values, block_idx, current_step):
        block_idx = block_idx.detach().clone()
        x = self._maybe_inject_noise(x, current_step)
        x = self.transformer.adapter(torch.cat([x, input_embeds.to(x.device)], dim=-1))
        for block in self.transformer.core_block:
            block_idx += 1
            x = block(x, freqs_cis, block_idx, mask, past_key_values)
        return x, block_idx

    def initialize_state(self, input_embeds, scale=1.0):
        # two draws from the global stream, as the published code: randn_like, then a truncated normal
        x = torch.randn_like(input_embeds)
        std = self.config.init_values["std"] * scale
        if std > 0:
            torch.nn.init.trunc_normal_(x, mean=0.0, std=std, a=-3 * std, b=3 * std)
            x = x * self.emb_scale
        else:
            x.zero_()
        return x

    def _maybe_inject_noise(self, x, current_step, renorm=True):
        if self.config.test_time_noise > 0:
            n = self.config.test_time_noise * self.config.init_values["std"] * self.emb_scale
            if self.config.test_time_noise_type == "geom":
                n = n / torch.as_tensor(current_step + 1, device=x.device)
            elif self.config.test_time_noise_type != "fixed":
                raise ValueError(f"stand-in: noise type {self.config.test_time_noise_type} not implemented")
            x = x * (1 - n) + torch.randn_like(x) * n  # one draw per step, from the global stream
            if renorm:
                x = self.transformer.core_block[-1].norm_4(x)
        return x

    @torch.no_grad()
    def iterate_one_step(self, input_embeds, input_states, position_ids=None, cache_position=None,
                         block_idx=torch.tensor(0, dtype=torch.long), attention_mask=None,  # noqa: B008
                         past_key_values=None, current_step=0):
        freqs_cis = self._freqs(input_embeds.shape[1], position_ids, cache_position)
        x, block_idx = self.core_block_forward(input_states, input_embeds, freqs_cis, attention_mask,
                                               past_key_values, block_idx, current_step=current_step)
        return x, block_idx, current_step + 1

    def predict_from_latents(self, latents, attention_mask=None, position_ids=None, cache_position=None,
                             past_key_values=None):
        freqs_cis = self._freqs(latents.shape[1], position_ids, cache_position)
        x = self.transformer.ln_f(latents)
        block_idx = torch.tensor(0, dtype=torch.long)
        for block in self.transformer.coda:
            block_idx -= 1
            x = block(x, freqs_cis, block_idx, attention_mask, past_key_values)
        x = self.transformer.ln_f(x)
        return CausalLMOutputRecurrentLatents(loss=torch.as_tensor(0.0), log_ppl=torch.as_tensor(0.0),
                                              logits=self.lm_head(x).float(), past_key_values=past_key_values,
                                              latent_states=x)

    def embed_inputs(self, input_ids, attention_mask=None, position_ids=None, past_key_values=None,
                     use_cache=False, cache_position=None, **kwargs):
        freqs_cis = self._freqs(input_ids.shape[1], position_ids, cache_position)
        input_embeds = self.transformer.wte(input_ids) * self.emb_scale
        if use_cache and past_key_values is None:
            past_key_values = HuginnDynamicCache()
        block_idx = torch.tensor(-1, dtype=torch.long)
        for block in self.transformer.prelude:
            block_idx += 1
            input_embeds = block(input_embeds, freqs_cis, block_idx, None, past_key_values)
        return input_embeds, block_idx
'''

_NANBEIGE_CONFIG = '''
from transformers import PretrainedConfig


class NanbeigeConfig(PretrainedConfig):
    """Stand-in of Nanbeige's configuration_nanbeige.NanbeigeConfig (the names and defaults that matter)."""

    model_type = "nanbeige"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(self, vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=None, head_dim=None, hidden_act="silu",
                 max_position_embeddings=128, initializer_range=0.02, rms_norm_eps=1e-6, use_cache=True,
                 pad_token_id=None, bos_token_id=1, eos_token_id=2, pretraining_tp=1, tie_word_embeddings=False,
                 rope_theta=10000.0, rope_scaling=None, attention_bias=False, attention_dropout=0.0, mlp_bias=False,
                 qk_layernorm=False, emb_neighbor_num=None, insert_ngram_layer_idx=None,
                 ngram_insert_all_layers=False, num_loops=1, loop_loss_weights=None, skip_loop_final_norm=False,
                 enable_double_loop_split=False, enable_hyper_connection=False, enable_mhc=False,
                 enable_depth_attention=False, **kwargs):
        self.vocab_size, self.hidden_size, self.intermediate_size = vocab_size, hidden_size, intermediate_size
        self.num_hidden_layers, self.num_attention_heads = num_hidden_layers, num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        # head_dim need not be hidden_size / heads (the published 3B: 128 against 3072 / 48 = 64)
        self.head_dim = head_dim or hidden_size // num_attention_heads
        self.hidden_act, self.max_position_embeddings = hidden_act, max_position_embeddings
        self.initializer_range, self.rms_norm_eps, self.use_cache = initializer_range, rms_norm_eps, use_cache
        self.pretraining_tp, self.attention_bias, self.mlp_bias = pretraining_tp, attention_bias, mlp_bias
        self.attention_dropout, self.qk_layernorm = attention_dropout, qk_layernorm
        # assigned before PretrainedConfig.__init__ (transformers 5 then standardises rope_scaling into a dict)
        self.rope_theta, self.rope_scaling = rope_theta, rope_scaling
        self.emb_neighbor_num, self.insert_ngram_layer_idx = emb_neighbor_num, insert_ngram_layer_idx or []
        self.ngram_insert_all_layers = ngram_insert_all_layers
        # the loop: the whole stack num_loops times (len(loop_loss_weights) + 1 when that list is not empty)
        self.num_loops, self.loop_loss_weights = num_loops, loop_loss_weights or []
        self.skip_loop_final_norm = skip_loop_final_norm
        self.enable_double_loop_split, self.enable_hyper_connection = enable_double_loop_split, enable_hyper_connection
        self.enable_mhc, self.enable_depth_attention = enable_mhc, enable_depth_attention
        super().__init__(pad_token_id=pad_token_id, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                         tie_word_embeddings=tie_word_embeddings, **kwargs)
'''

_NANBEIGE_MODEL = '''
"""Stand-in of Nanbeige's modeling_nanbeige.py (interfaces of the published code; tests/hf_helpers.py)."""
import math

import torch
from torch import nn
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import PreTrainedModel

from .configuration_nanbeige import NanbeigeConfig


class NanbeigeRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        dtype = hidden_states.dtype
        h = hidden_states.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(dtype)


class NanbeigeRotaryEmbedding(nn.Module):
    def __init__(self, dim, max_position_embeddings=2048, base=10000, device=None):
        super().__init__()
        self.dim, self.max_position_embeddings, self.base = dim, max_position_embeddings, base
        # computed here into a buffer the checkpoint does not hold (transformers 5 leaves it to _init_weights)
        exponent = torch.arange(0, dim, 2, dtype=torch.int64).float().to(device) / dim
        self.register_buffer("inv_freq", 1.0 / (base ** exponent), persistent=False)

    @torch.no_grad()
    def forward(self, x, position_ids):
        freqs = (self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
                 @ position_ids[:, None, :].float()).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


class NanbeigeLinearScalingRotaryEmbedding(NanbeigeRotaryEmbedding):
    def __init__(self, dim, max_position_embeddings=2048, base=10000, device=None, scaling_factor=1.0):
        super().__init__(dim, max_position_embeddings, base, device)
        self.scaling_factor = scaling_factor

    def forward(self, x, position_ids):
        return super().forward(x, position_ids.float() / self.scaling_factor)


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class NanbeigeMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        d, i, b = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj, self.up_proj = nn.Linear(d, i, bias=b), nn.Linear(d, i, bias=b)
        self.down_proj = nn.Linear(i, d, bias=b)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class NanbeigeAttention(nn.Module):
    def __init__(self, config, layer_idx=None):
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        self.num_heads, self.num_key_value_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        d, b = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(d, self.num_heads * self.head_dim, bias=b)
        self.k_proj = nn.Linear(d, self.num_key_value_heads * self.head_dim, bias=b)
        self.v_proj = nn.Linear(d, self.num_key_value_heads * self.head_dim, bias=b)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, d, bias=b)
        norm = config.qk_layernorm
        self.q_layernorm = NanbeigeRMSNorm(self.head_dim, config.rms_norm_eps) if norm else None
        self.k_layernorm = NanbeigeRMSNorm(self.head_dim, config.rms_norm_eps) if norm else None
        self._init_rope()

    def _init_rope(self):
        # the transformers-4.x contract: rope_scaling is None or {"type": ..., "factor": ...}
        scaling = self.config.rope_scaling
        args = (self.head_dim, self.config.max_position_embeddings, self.config.rope_theta)
        if scaling is None:
            self.rotary_emb = NanbeigeRotaryEmbedding(*args)
        elif scaling["type"] == "linear":
            self.rotary_emb = NanbeigeLinearScalingRotaryEmbedding(*args, scaling_factor=scaling["factor"])
        else:
            raise ValueError(f"Unknown RoPE scaling type {scaling['type']}")

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_value=None,
                output_attentions=False, use_cache=False, cache_position=None, **kwargs):
        loop_idx = kwargs.pop("loop_idx", 0)
        B, S, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(B, S, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(B, S, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(B, S, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        if self.q_layernorm is not None:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        cos, sin = self.rotary_emb(v, position_ids)
        c, s = cos.unsqueeze(1), sin.unsqueeze(1)
        q, k = q * c + rotate_half(q) * s, k * c + rotate_half(k) * s
        if past_key_value is not None:  # one slot per (loop, layer)
            slot = self.layer_idx + loop_idx * self.config.num_hidden_layers
            k, v = past_key_value.update(k, v, slot, {"sin": sin, "cos": cos, "cache_position": cache_position})
        rep = self.num_heads // self.num_key_value_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores = q @ k.transpose(2, 3) / math.sqrt(self.head_dim)
        if attention_mask is not None:
            scores = scores + attention_mask[:, :, :, : k.shape[-2]]
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = (probs @ v).transpose(1, 2).reshape(B, S, self.num_heads * self.head_dim)
        return self.o_proj(out), (probs if output_attentions else None), past_key_value


class NanbeigeDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.hidden_size, self.layer_idx = config.hidden_size, layer_idx
        self.self_attn, self.mlp = NanbeigeAttention(config, layer_idx), NanbeigeMLP(config)
        self.input_layernorm = NanbeigeRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = NanbeigeRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_value=None,
                output_attentions=False, use_cache=False, cache_position=None, loop_idx=0, **kwargs):
        # pre-norm; returns a tuple: (hidden, [attention weights], [cache])
        h, weights, cache = self.self_attn(self.input_layernorm(hidden_states), attention_mask, position_ids,
                                           past_key_value, output_attentions, use_cache, cache_position,
                                           loop_idx=loop_idx)
        hidden_states = hidden_states + h
        hidden_states = hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))
        out = (hidden_states,)
        if output_attentions:
            out += (weights,)
        if use_cache:
            out += (cache,)
        return out


class NanbeigePreTrainedModel(PreTrainedModel):
    config_class = NanbeigeConfig
    base_model_prefix = "model"
    _no_split_modules = ["NanbeigeDecoderLayer"]
    _skip_keys_device_placement = ["past_key_values"]

    def _supports_default_dynamic_cache(self):
        # a looped model caches one slot per (loop, layer): generate must not size a cache per layer
        return self.config.num_loops == 1 and super()._supports_default_dynamic_cache()

    def _init_weights(self, module):
        # Linear and Embedding weights only: the rotary buffers keep what their __init__ computed
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            module.weight.data.normal_(mean=0.0, std=std)
            if module.bias is not None:
                module.bias.data.zero_()
        elif isinstance(module, nn.Embedding):
            module.weight.data.normal_(mean=0.0, std=std)
            if module.padding_idx is not None:
                module.weight.data[module.padding_idx].zero_()


class NanbeigeModel(NanbeigePreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.padding_idx, self.vocab_size = config.pad_token_id, config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.ngram_embeddings = None
        self.layers = nn.ModuleList([NanbeigeDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.ngram_layer_fusion = nn.ModuleDict()
        self.norm = NanbeigeRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def _get_num_loops(self):
        weights = self.config.loop_loss_weights or []
        return len(weights) + 1 if weights else self.config.num_loops

    def _get_cache_seq_length(self, cache):
        # the longest of the loops' first slots
        if cache is None:
            return 0
        L = self.config.num_hidden_layers
        return max(cache.get_seq_length(t * L) for t in range(self._get_num_loops()))

    def _causal_mask(self, attention_mask, inputs_embeds, cache_position):
        # additive [batch, 1, query, key]: key j is visible to query i when j <= cache_position[i] (and not padding)
        B, S = inputs_embeds.shape[:2]
        width = int(cache_position[-1]) + 1
        if attention_mask is not None:
            width = max(width, attention_mask.shape[-1])
        low = torch.finfo(inputs_embeds.dtype).min
        keys = torch.arange(width, device=inputs_embeds.device)
        mask = torch.zeros(S, width, dtype=inputs_embeds.dtype, device=inputs_embeds.device)
        mask = mask.masked_fill(keys[None, :] > cache_position[:, None], low)[None, None].expand(B, 1, S, width)
        if attention_mask is not None:
            pad = torch.zeros(B, width, dtype=torch.bool, device=mask.device)
            pad[:, : attention_mask.shape[-1]] = attention_mask == 0
            mask = mask.masked_fill(pad[:, None, None, :], low)
        return mask

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, use_cache=None, output_attentions=None, output_hidden_states=None,
                return_dict=None, cache_position=None):
        use_cache = self.config.use_cache if use_cache is None else use_cache
        legacy = False
        if use_cache and not isinstance(past_key_values, Cache):  # the transformers-4.x conversion
            legacy = True
            past_key_values = DynamicCache.from_legacy_cache(past_key_values)
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if cache_position is None:
            seen = self._get_cache_seq_length(past_key_values)
            cache_position = torch.arange(seen, seen + inputs_embeds.shape[1], device=inputs_embeds.device)
        if position_ids is None:
            position_ids = cache_position.unsqueeze(0)
        mask = self._causal_mask(attention_mask, inputs_embeds, cache_position)
        hidden_states, per_layer = inputs_embeds, None
        for loop_idx in range(self._get_num_loops()):
            per_layer = () if output_hidden_states else None  # the last loop's (as the published forward)
            for layer in self.layers:
                if per_layer is not None:
                    per_layer += (hidden_states,)
                hidden_states = layer(hidden_states, attention_mask=mask, position_ids=position_ids,
                                      past_key_value=past_key_values, output_attentions=bool(output_attentions),
                                      use_cache=use_cache, cache_position=cache_position, loop_idx=loop_idx)[0]
            if not self.config.skip_loop_final_norm:
                hidden_states = self.norm(hidden_states)  # the normed state feeds the next loop
            if per_layer is not None:
                per_layer += (hidden_states,)
        if self.config.skip_loop_final_norm:
            hidden_states = self.norm(hidden_states)
            if per_layer is not None:  # the last entry becomes the normed output
                per_layer = per_layer[:-1] + (hidden_states,)
        cache = past_key_values if use_cache else None
        if legacy and cache is not None:
            cache = cache.to_legacy_cache()
        return BaseModelOutputWithPast(last_hidden_state=hidden_states, past_key_values=cache, hidden_states=per_layer)


class NanbeigeForCausalLM(NanbeigePreTrainedModel):
    # transformers-4.x habits: a list _tied_weights_keys; no GenerationMixin base (4.x PreTrainedModel had it)
    _tied_weights_keys = ["lm_head.weight"]

    def __init__(self, config):
        super().__init__(config)
        self.model = NanbeigeModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def get_output_embeddings(self):
        return self.lm_head

    def get_decoder(self):
        return self.model

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache=None, output_attentions=None, output_hidden_states=None,
                return_dict=None, cache_position=None):
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
                         output_attentions=output_attentions, output_hidden_states=output_hidden_states,
                         cache_position=cache_position)
        logits = self.lm_head(out.last_hidden_state).float()
        loss = None
        if labels is not None:
            loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=out.past_key_values,
                                      hidden_states=out.hidden_states)

    def generate(self, *args, **kwargs):
        # a looped model gets a cache of its own (num_loops x L slots), not one sized by transformers
        if kwargs.get("use_cache", True) and self.config.num_loops > 1 and kwargs.get("past_key_values") is None:
            kwargs["past_key_values"] = DynamicCache()
        return super().generate(*args, **kwargs)

    def _get_cache_seq_length(self, cache):
        return self.model._get_cache_seq_length(cache)

    def prepare_inputs_for_generation(self, input_ids, past_key_values=None, attention_mask=None,
                                      inputs_embeds=None, cache_position=None, use_cache=True, **kwargs):
        # the transformers-4.x contract: the cache arrives as past_key_values, get_max_length() is None when unbounded,
        # position_ids come from the attention mask (a given position_ids is used as it is)
        past = 0
        if past_key_values is not None:
            past = int(cache_position[0]) if cache_position is not None else self._get_cache_seq_length(past_key_values)
            limit = past_key_values.get_max_length()
            if past < input_ids.shape[1]:
                input_ids = input_ids[:, past:]
            if limit is not None and attention_mask is not None and past + input_ids.shape[1] > limit:
                attention_mask = attention_mask[:, -limit:]
        position_ids = kwargs.get("position_ids")
        if attention_mask is not None and position_ids is None:
            position_ids = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)
            position_ids = position_ids[:, -input_ids.shape[1]:]
        n = position_ids.shape[-1] if position_ids is not None else input_ids.shape[-1]
        if cache_position is None:
            cache_position = torch.arange(past, past + n, device=input_ids.device)
        return {"input_ids": input_ids.contiguous(), "position_ids": position_ids, "cache_position": cache_position,
                "past_key_values": past_key_values, "use_cache": use_cache, "attention_mask": attention_mask}
'''

#: Names of the stand-ins' files (those of the published code) and their auto_map.
OURO_AUTO_MAP = {"AutoConfig": "configuration_ouro.OuroConfig", "AutoModel": "modeling_ouro.OuroModel",
                 "AutoModelForCausalLM": "modeling_ouro.OuroForCausalLM"}
HUGINN_AUTO_MAP = {"AutoConfig": "raven_config_minimal.RavenConfig",
                   "AutoModelForCausalLM": "raven_modeling_minimal.RavenForCausalLM"}
NANBEIGE_AUTO_MAP = {"AutoConfig": "configuration_nanbeige.NanbeigeConfig",
                     "AutoModel": "modeling_nanbeige.NanbeigeModel", "AutoModelForCausalLM": "modeling_nanbeige.NanbeigeForCausalLM"}


def _write_remote(path: Path, files: dict[str, str], config: dict, variant: str) -> None:
    """The code files (``variant`` goes into a comment: a distinct text is a distinct module for transformers'
    dynamic-module cache, so a test can load code no other test has patched) and a transformers-4.x-style
    config.json (as the published checkpoints carry: no ``tie_word_embeddings`` / ``rope_parameters`` keys)."""
    path.mkdir(parents=True, exist_ok=True)
    for name, src in files.items():
        (path / name).write_text(f"# looptrace stand-in{' ' + variant if variant else ''}\n{src}")
    (path / "config.json").write_text(json.dumps(config, indent=2))


def _build_remote(path: Path, kind: str, jitter: float, edit=None, dtype=torch.float32) -> Path:
    """Instantiate the stand-in from its own files (through the shim, which the build needs under
    transformers 5 like any load), set random weights, save the weights only (config.json stays as written)."""
    from looptrace.models.adapters import compat

    rc = compat.remote_code(path, kind)
    config = rc.config_cls.from_pretrained(str(path), local_files_only=True)
    torch.manual_seed(0)
    model = rc.model_cls(config).eval()
    _jitter(model, std=jitter)
    if edit is not None:
        edit(model)
    written = (path / "config.json").read_text()
    model.to(dtype).save_pretrained(path)
    (path / "config.json").write_text(written)
    for extra in ("generation_config.json",):
        (path / extra).unlink(missing_ok=True)
    tokenizer().save_pretrained(path)
    return path


def ouro_config(**over) -> dict:
    """config.json of the Ouro stand-in (what a checkpoint saved under transformers 4.55 holds)."""
    cfg = {"architectures": ["OuroForCausalLM"], "auto_map": OURO_AUTO_MAP, "model_type": "ouro",
           "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_act": "silu", "max_position_embeddings": 128,
           "rms_norm_eps": 1e-6, "use_cache": True, "tie_word_embeddings": False, "rope_theta": 10000.0,
           "rope_scaling": None, "layer_types": ["full_attention", "full_attention"], "total_ut_steps": 4,
           "early_exit_threshold": 1.0, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
           "transformers_version": "4.55.4"}
    cfg.update(over)
    return cfg


def build_ouro(path: Path, gate_bias: float = -1.0, gate_std: float = 0.5, variant: str = "",
               dtype=torch.float32, **config) -> Path:
    """The Ouro stand-in: 2 shared layers × 4 steps (GQA 4/2 heads), per-step norm and exit gate.

    ``gate_bias`` / ``gate_std`` set the exit gate (weights ~ N(0, gate_std²)): the default spreads the exit
    steps; ``gate_bias=7`` makes σ(g) round to 1 in bf16 (a confident gate).
    """
    _write_remote(path, {"configuration_ouro.py": _OURO_CONFIG, "modeling_ouro.py": _OURO_MODEL},
                  ouro_config(**config), variant)

    def gate(model):
        with torch.no_grad():
            model.model.early_exit_gate.weight.normal_(0.0, gate_std)
            model.model.early_exit_gate.bias.fill_(gate_bias)

    return _build_remote(path, "ouro", 0.05, gate, dtype)


def huginn_config(**over) -> dict:
    """config.json of the Huginn stand-in (transformers-4.55 style: no ``tie_word_embeddings`` key)."""
    cfg = {"architectures": ["RavenForCausalLM"], "auto_map": HUGINN_AUTO_MAP, "model_type": "huginn_raven",
           "n_embd": 32, "n_heads": 2, "n_layers": 4, "block_size": 64, "vocab_size": VOCAB,
           "intermediate_size": 64, "n_layers_in_prelude": 1, "n_layers_in_recurrent_block": 2,
           "n_layers_in_coda": 1, "mean_recurrence": 4, "mean_backprop_depth": 2, "qk_bias": True,
           "rope_base": 50000, "norm_eps": 1e-6, "tie_embeddings": True, "test_time_noise": 0,
           "test_time_noise_type": "fixed", "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
           "torch_dtype": "float32", "transformers_version": "4.55.4"}
    cfg.update(over)
    return cfg


def build_huginn(path: Path, variant: str = "", dtype=torch.float32, **config) -> Path:
    """The Huginn stand-in: prelude 1, core 2 × mean_recurrence 4, coda 1, d 32, tied embeddings."""
    _write_remote(path, {"raven_config_minimal.py": _HUGINN_CONFIG, "raven_modeling_minimal.py": _HUGINN_MODEL},
                  huginn_config(**config), variant)
    return _build_remote(path, "huginn", 0.1, None, dtype)


def own_forward_at(m, loops: int, ids, **kw):
    """A Nanbeige model's own forward (no cache) with ``config.num_loops = loops``, which it reads at every forward;
    the config is restored afterwards."""
    T = m.config.num_loops
    m.config.num_loops = loops
    try:
        with torch.no_grad():
            return m(input_ids=ids, use_cache=False, **kw)
    finally:
        m.config.num_loops = T


def nanbeige_config(**over) -> dict:
    """config.json of the Nanbeige stand-in (the published 3B's keys at a tiny shape: GQA, head_dim 16 against
    d_model 32 / 4 heads = 8, the whole stack looped twice, the final norm after every loop)."""
    cfg = {"architectures": ["NanbeigeForCausalLM"], "auto_map": NANBEIGE_AUTO_MAP, "model_type": "nanbeige",
           "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "hidden_act": "silu",
           "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "rope_scaling": None,
           "attention_bias": False, "attention_dropout": 0.0, "num_loops": 2, "loop_loss_weights": [],
           "skip_loop_final_norm": False, "pretraining_tp": 1, "tie_word_embeddings": False, "pad_token_id": 0,
           "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32", "transformers_version": "4.55.4"}
    cfg.update(over)
    return cfg


def build_nanbeige(path: Path, variant: str = "", dtype=torch.float32, **config) -> Path:
    """The Nanbeige stand-in: the whole 3-layer stack × num_loops 2 (GQA 4/2 heads, head_dim 16), d_model 32."""
    _write_remote(path, {"configuration_nanbeige.py": _NANBEIGE_CONFIG, "modeling_nanbeige.py": _NANBEIGE_MODEL},
                  nanbeige_config(**config), variant)
    return _build_remote(path, "nanbeige", 0.05, None, dtype)


def copy_checkpoint(src: Path, dst: Path, variant: str, config: dict | None = None) -> Path:
    """A copy of a stand-in checkpoint whose code is a fresh module (``variant``), config.json updated."""
    import shutil

    shutil.copytree(src, dst)
    for f in dst.glob("*.py"):
        f.write_text(f"# variant {variant}\n{f.read_text()}")
    if config:
        cfg = json.loads((dst / "config.json").read_text())
        cfg.update(config)
        (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


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
