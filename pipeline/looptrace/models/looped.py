"""The looped (recurrent-depth) transformer, in one readable file (nanoGPT style).

Architecture, in order:

    tokens -> embedding + positions -> prelude (n_prelude layers, run once)      => h_0 (= e, the injection)
    for each looped group g, for t in 1..loops_g:
        h <- one loop of group g (``loop_form``, below)                                  => h_t
    readout of every loop: coda(h_t) -> shared final LayerNorm -> shared head          => z_t
    optional halting gate on the normed state: g(ln_f(h_t)) -> gate logit              => gate_t

Loop forms (``ModelConfig.loop_form``; R_g = the group's layers):

- ``add``: h <- R_g(h + e) (``reinject``; R_g(h) without). Nothing bounds the carried state, so its norm grows
  loop after loop; the form of looptrace's checkpoints before ``loop_form`` existed (their config lacks the
  field and loads as ``add``).
- ``norm_add`` (Dory): h <- R_g(N_h(h) + N_e(e)), N_h and N_e two unit-sphere projections N(x) = g ⊙ x / ‖x‖₂
  (:class:`L2Norm`), one for the carried state and one for the injection, each with a learned gain g (init 1).
  Dory (transformers ``models/dory/modeling_dory.py``, ``DoryModel.forward``: ``input_hidden_states =
  self.norm(h_prelude)``; every loop ``hidden_states = self.norm(hidden_states) + input_hidden_states``, ``norm`` a
  parameter-free ``DoryL2Norm``) is this form with g = 1; the gains let the model weigh state against injection.
  Unit norm, not RMS 1: with RMS-1 norms (‖x‖ = sqrt(d_model)) the loop's own update starts ~50× smaller than the
  carried state and the default models learnt far less (running parity, old splits: 81 % val accuracy vs 100 % for
  ``add``; with unit norms 99.6 % on token-level splits; docs/train.md).
- ``adapter`` (Huginn, Geiping et al. 2025; seal-rg/recurrent-pretraining ``recpre/raven_modeling_minimal.py``,
  ``core_block_forward`` and ``SandwichBlock``): h <- R_g(A [N_h(h); N_e(e)]), A a Linear 2·d_model -> d_model
  (no bias) over the concatenation, and every layer a sandwich layer x <- n_2(x + attn(n_1(x))),
  x <- n_4(x + mlp(n_3(x))) (RMSNorms), so the carried state leaves each loop normalised. Huginn carries an
  already-normalised state (its blocks end in n_4) and starts it from noise; here h starts at e (deterministic
  dumps), hence the explicit N_h, and prelude and coda layers are sandwich layers too. Huginn's randomised
  loop count and truncated backpropagation are training choices, not part of the form.

Loop memory (``ModelConfig.loop_memory``, [RT]'s Loop Memory Attention; off by default): every layer j of a looped
block gets one more residual sublayer between its self-attention and its MLP,

    x <- x + attn(ln_1(x))                                        (over positions, as without memory)
    x <- x + MemAttn(ln_m(x), ln_m(o_j^1), ..., ln_m(o_j^{t-1}))   (over loop time, same position)
    x <- x + mlp(ln_2(x))

where o_j^s is layer j's own output at iteration s < t of the same group and the same position (causal in loop
time: iteration t never sees iterations ≥ t; at the group's first iteration the sublayer is skipped, there is
nothing to attend to). The memory restarts at every group (another group has other layers). The state h_t, the
readout and the gate are unchanged in form, but h_{t+1} now depends on (h_t, e, memory): docs/SPEC.md §1
"Trajectories with loop memory". :meth:`LoopedTransformer.step` takes the memory explicitly (a tuple of per-layer
[batch, seq, m, d_model] tensors, :meth:`~LoopedTransformer.empty_memory` / :meth:`~LoopedTransformer.extend_memory`),
so one loop stays a pure function of (h, e, memory).

All loops of all groups are flattened onto one ``loop`` axis (t = 1..T, T = sum of the groups'
loop counts); ``loop_group`` maps each loop index to its group. The coda is applied to every h_t
because that is exactly what an early exit at t would run (and what the last loop runs anyway).

Token-by-token decoding (``looptrace.models.decode``, the ``generate`` stage) passes a cache to ``embed`` /
``step`` / ``readout``: every attention layer then stores the new positions' keys/values in it and attends to
the cached ones (one slot per prelude layer, per (loop, layer) of the looped block, per coda layer). Without a
cache the code path, and so every number of the full-sequence forward, is unchanged.

Dimension vocabulary used throughout looptrace: ``batch``, ``seq`` (positions), ``loop``,
``d_model``, ``vocab``. A checkpoint carries its own :class:`ModelConfig`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Protocol, cast

import torch
import torch.nn as nn
from torch.nn import functional as F

from looptrace.config import Check, CheckpointLoadError, ConfigError, MissingInputError
from looptrace.models.invariant import Linear, inference_kernels, sdpa

#: ``ModelConfig.loop_form`` values (module docstring).
LOOP_FORMS = ("add", "norm_add", "adapter")


def rms_norm(d: int) -> nn.RMSNorm:
    """The RMSNorm of the sandwich layers and the ``adapter`` form (learned gains, eps 1e-5 as the LayerNorms)."""
    return nn.RMSNorm(d, eps=1e-5)


class L2Norm(nn.Module):
    """Projection onto the sphere with a learned per-channel gain: x / sqrt(‖x‖₂² + eps) ⊙ weight (Dory's
    ``DoryL2Norm``, eps 1e-6, plus the gain, init 1)."""

    def __init__(self, d: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + self.eps) * self.weight


#: One attention layer's view of a decoding cache: ``kv(k, v)`` stores the keys/values of the positions being
#: decoded ([batch, heads, seq, head_dim]) and returns every key/value they attend to.
KV = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class KVCache(Protocol):
    """What :meth:`LoopedTransformer.embed` / :meth:`~LoopedTransformer.step` / :meth:`~LoopedTransformer.readout`
    need from a decoding cache (``looptrace.models.kv.LoopKVCache``): the :data:`KV` of one layer,
    ``layer("prelude", i)``, ``layer("loop", t, j)`` or ``layer("coda", i)``."""

    def layer(self, kind: str, *index: int) -> KV: ...


@dataclass(frozen=True)
class GroupConfig:
    """One looped group: a block of ``n_layer`` layers applied ``loops`` times."""

    n_layer: Annotated[int, Check(ge=1, why="layers of the looped block")] = 1
    loops: Annotated[int, Check(ge=1, why="loops of the group")] = 6


@dataclass(frozen=True)
class ModelConfig:
    """Full description of a :class:`LoopedTransformer` (stored in every checkpoint).

    Attributes:
        vocab_size: number of token ids.
        block_size: maximum sequence length (learned positions).
        d_model: residual width.
        n_head: attention heads (d_model must be divisible by it).
        n_prelude: layers run once before the loop.
        groups: looped groups applied in sequence, each with its own loop count.
        n_coda: layers applied to every loop's state before the shared norm and head.
        causal: causal attention (running tasks, LMs) or bidirectional.
        reinject: add h_0 to the state before every loop (input injection, as in Huginn).
        gate: halting gate on the normed state: ``none``, ``linear`` or ``mlp`` (2 layers).
        gate_hidden: hidden width of the MLP gate.
        tie_embeddings: share the token embedding and the head weight.
        mlp_ratio: MLP hidden width / d_model.
        loop_form: ``add`` (h <- R(h + e)), ``norm_add`` (Dory: h <- R(N_h(h) + N_e(e))) or ``adapter``
            (Huginn: h <- R(A [N_h(h); N_e(e)]) with sandwich-norm layers); see the module docstring.
        loop_memory: [RT] loop memory attention in every looped layer (module docstring). Left out of
            :meth:`to_dict` when false, so checkpoints and stores of models without it keep their bytes.
    """

    vocab_size: int
    block_size: int
    d_model: int = 64
    n_head: int = 4
    n_prelude: int = 0
    groups: tuple[GroupConfig, ...] = field(default_factory=lambda: (GroupConfig(),))
    n_coda: int = 0
    causal: bool = True
    reinject: bool = True
    gate: str = "none"
    gate_hidden: int = 64
    tie_embeddings: bool = False
    mlp_ratio: int = 4
    loop_form: str = "add"
    loop_memory: bool = False

    def __post_init__(self) -> None:
        if self.loop_memory and self.loop_form == "adapter":
            raise ConfigError("model.loop_memory is defined for loop_form add and norm_add (pre-norm layers), not "
                              "adapter (sandwich layers); set loop_memory false or another loop_form")
        if self.loop_form not in LOOP_FORMS:
            raise ConfigError(f"model.loop_form must be one of {', '.join(LOOP_FORMS)}, got {self.loop_form!r}")
        if self.loop_form == "adapter" and not self.reinject:
            raise ConfigError("model.loop_form adapter concatenates the injection: it needs model.reinject true")
        if self.d_model % self.n_head:
            raise ConfigError(f"model.d_model={self.d_model} is not divisible by model.n_head={self.n_head}")
        if self.gate not in ("none", "linear", "mlp"):
            raise ConfigError(f"model.gate must be none, linear or mlp, got {self.gate!r}")
        if not self.groups or any(g.loops < 1 or g.n_layer < 1 for g in self.groups):
            raise ConfigError("model.groups needs at least one group with n_layer >= 1 and loops >= 1")

    @property
    def n_loops(self) -> int:
        """T: total loops over all groups."""
        return sum(g.loops for g in self.groups)

    @property
    def loop_group(self) -> list[int]:
        """Group index of each loop t = 1..T (list of length T)."""
        return [gi for gi, g in enumerate(self.groups) for _ in range(g.loops)]

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        if not self.loop_memory:  # the form of every checkpoint before loop memory existed: same bytes
            del d["loop_memory"]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        d = dict(d)
        d["groups"] = tuple(GroupConfig(**g) for g in d.get("groups", ()))
        return cls(**d)


class SelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.causal = cfg.causal
        self.qkv = Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor, kv: KV | None = None) -> torch.Tensor:
        B, S, D = x.shape
        q, k, v = self.qkv(x).split(D, dim=2)  # 3 x [B, S, D]
        q = q.view(B, S, self.n_head, D // self.n_head).transpose(1, 2)  # [B, H, S, D/H]
        k = k.view(B, S, self.n_head, D // self.n_head).transpose(1, 2)
        v = v.view(B, S, self.n_head, D // self.n_head).transpose(1, 2)
        if kv is None:  # the full-sequence forward
            y = sdpa(q, k, v, is_causal=self.causal)  # [B, H, S, D/H]
        else:  # decoding: the cache stores this call's keys/values and returns every visible one
            k, v = kv(k, v)  # [B, H, S_k, D/H]
            S_k = k.shape[2]
            if S > 1 and S_k != S and self.causal:
                # a chunk of S positions after S_k − S cached ones (speculative verification): query i sits at
                # position S_k − S + i and sees the keys up to it (torch's is_causal aligns top-left, so the
                # offset needs an explicit mask; the batch-invariant attention gives each query the result it
                # has when decoded alone)
                mask = torch.ones(S, S_k, dtype=torch.bool, device=q.device).tril(diagonal=S_k - S)
                y = sdpa(q, k, v, attn_mask=mask)
            else:
                y = sdpa(q, k, v, is_causal=self.causal and S > 1)
        y = y.transpose(1, 2).contiguous().view(B, S, D)  # [B, S, D]
        return self.proj(y)


#: A looped block's loop memory: one [batch, seq, m, d_model] tensor per layer j of the block, layer j's outputs
#: o_j^1..o_j^m at the group's m earlier iterations (oldest first).
Memory = tuple[torch.Tensor, ...]


class LoopMemoryAttention(nn.Module):
    """[RT] Loop Memory Attention: each position attends over its own earlier-iteration entries (loop time).

    Multi-head attention with the layer's heads; the query is the position's current (normed) stream, keys and
    values its m memory entries. No mask: the memory only ever holds earlier iterations (causal in loop time).
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.q = Linear(cfg.d_model, cfg.d_model)
        self.kv = Linear(cfg.d_model, 2 * cfg.d_model)
        self.proj = Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor, mem: torch.Tensor) -> torch.Tensor:
        """x: [batch, seq, d_model] (normed); mem: [batch, seq, m ≥ 1, d_model] (normed) -> [batch, seq, d_model]."""
        B, S, D = x.shape
        m, H = mem.shape[2], self.n_head
        q = self.q(x).view(B * S, 1, H, D // H).transpose(1, 2)  # [B·S, H, 1, D/H]
        k, v = self.kv(mem).split(D, dim=3)  # 2 x [B, S, m, D]
        k = k.reshape(B * S, m, H, D // H).transpose(1, 2)  # [B·S, H, m, D/H]
        v = v.reshape(B * S, m, H, D // H).transpose(1, 2)
        y = sdpa(q, k, v)  # [B·S, H, 1, D/H]
        return self.proj(y.transpose(1, 2).reshape(B, S, D))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.fc = Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.proj = Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Layer(nn.Module):
    """Pre-norm transformer layer; with ``memory`` (a looped layer of a ``loop_memory`` model) a loop-memory
    sublayer sits between attention and MLP (module docstring)."""

    def __init__(self, cfg: ModelConfig, memory: bool = False):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model)
        self.attn = SelfAttention(cfg)
        if memory:  # built only with loop memory: models without it keep their parameters and init draws
            self.ln_m = nn.LayerNorm(cfg.d_model)
            self.mem_attn = LoopMemoryAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, kv: KV | None = None, memory: torch.Tensor | None = None) -> torch.Tensor:
        """x: [batch, seq, d_model]; memory: [batch, seq, m, d_model] this layer's earlier outputs (m = 0 or None:
        no memory sublayer)."""
        x = x + self.attn(self.ln_1(x), kv)
        if memory is not None and memory.shape[2] > 0:
            x = x + self.mem_attn(self.ln_m(x), self.ln_m(memory))
        return x + self.mlp(self.ln_2(x))


class SandwichLayer(nn.Module):
    """Huginn's sandwich layer (``SandwichBlock``): x <- n_2(x + attn(n_1(x))); x <- n_4(x + mlp(n_3(x)))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm_1, self.norm_2 = rms_norm(cfg.d_model), rms_norm(cfg.d_model)
        self.norm_3, self.norm_4 = rms_norm(cfg.d_model), rms_norm(cfg.d_model)
        self.attn = SelfAttention(cfg)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, kv: KV | None = None) -> torch.Tensor:
        x = self.norm_2(x + self.attn(self.norm_1(x), kv))
        return self.norm_4(x + self.mlp(self.norm_3(x)))


class Gate(nn.Module):
    """Halting gate: a scalar logit per (token, loop), linear or a 2-layer MLP."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.net: nn.Module
        if cfg.gate == "linear":
            self.net = Linear(cfg.d_model, 1)
        else:
            self.net = nn.Sequential(Linear(cfg.d_model, cfg.gate_hidden), nn.GELU(), Linear(cfg.gate_hidden, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).squeeze(-1)


@dataclass
class LoopOutput:
    """Everything one forward pass produces.

    Attributes:
        hidden: [batch, seq, loop, d_model] states h_1..h_T (after each loop, before the coda).
        hidden_init: [batch, seq, d_model] h_0, the state entering the first loop.
        logits: [batch, seq, loop, vocab] per-loop readouts z_1..z_T (None if not requested).
        gate_logits: [batch, seq, loop] halting-gate logits, or None when the model has no gate.
    """

    hidden: torch.Tensor
    hidden_init: torch.Tensor
    logits: torch.Tensor | None
    gate_logits: torch.Tensor | None


class LoopedTransformer(nn.Module):
    """Looped transformer with a shared readout at every loop (see module docstring)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.block_size, cfg.d_model)
        layer = SandwichLayer if cfg.loop_form == "adapter" else Layer
        self.prelude = nn.ModuleList([layer(cfg) for _ in range(cfg.n_prelude)])
        if cfg.loop_memory:
            self.blocks = nn.ModuleList(
                [nn.ModuleList([Layer(cfg, memory=True) for _ in range(g.n_layer)]) for g in cfg.groups])
        else:
            self.blocks = nn.ModuleList(
                [nn.ModuleList([layer(cfg) for _ in range(g.n_layer)]) for g in cfg.groups]
            )
        self.coda = nn.ModuleList([layer(cfg) for _ in range(cfg.n_coda)])
        if cfg.loop_form != "add":  # N_h (carried state) and N_e (injection), shared by all groups
            norm = L2Norm if cfg.loop_form == "norm_add" else rms_norm
            self.norm_h = norm(cfg.d_model)
            self.norm_e = norm(cfg.d_model) if cfg.reinject else None
        self.adapter = Linear(2 * cfg.d_model, cfg.d_model, bias=False) if cfg.loop_form == "adapter" else None
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.wte.weight
        self.gate = Gate(cfg) if cfg.gate != "none" else None
        self.apply(self._init_weights)
        # GPT-2 scaled init of residual projections; depth counts every applied layer.
        n_applied = cfg.n_prelude + cfg.n_coda + sum(g.n_layer * g.loops for g in cfg.groups)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_applied))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    @property
    def n_loops(self) -> int:
        return self.cfg.n_loops

    @inference_kernels
    def embed(self, idx: torch.Tensor, start: int = 0, cache: KVCache | None = None) -> torch.Tensor:
        """h_0: [batch, seq] token ids -> [batch, seq, d_model] (embedding, positions, prelude).

        Decoding (``looptrace.models.decode``): ``idx`` holds positions ``start..start+seq−1`` and the prelude's
        attention reads and extends ``cache`` (layer ``("prelude", i)``)."""
        S = idx.shape[1]
        if start + S > self.cfg.block_size:
            raise ValueError(f"sequence length {start + S} exceeds model.block_size={self.cfg.block_size}")
        pos = torch.arange(start, start + S, device=idx.device)
        h = self.wte(idx) + self.wpe(pos)  # [B, S, D]
        for i, layer in enumerate(self.prelude):
            h = layer(h, None if cache is None else cache.layer("prelude", i))
        return h

    def step(self, h: torch.Tensor, h0: torch.Tensor, group: int, cache: KVCache | None = None,
             loop: int = 0, memory: Memory | None = None) -> torch.Tensor:
        """One loop of group ``group`` (``cfg.loop_form``): [batch, seq, d_model] -> [batch, seq, d_model].

        Decoding: loop ``loop`` (0-based over all groups) of the new positions, its layer j's attention reading
        and extending ``cache`` layer ``("loop", loop, j)``. ``memory``: the group's loop memory (models with
        ``loop_memory`` only; :meth:`step_outputs`)."""
        return self.step_outputs(h, h0, group, cache, loop, memory)[0]

    @inference_kernels
    def step_outputs(self, h: torch.Tensor, h0: torch.Tensor, group: int, cache: KVCache | None = None,
                     loop: int = 0, memory: Memory | None = None) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """:meth:`step`, also returning every block layer's output (what :meth:`extend_memory` appends).

        Args:
            h: [batch, seq, d_model] the carried state h_{t−1}.
            h0: [batch, seq, d_model] the injection e.
            group: looped group index.
            cache, loop: decoding (:meth:`step`).
            memory: models with ``loop_memory``: layer j's outputs at the group's earlier iterations
                (:data:`Memory`; :meth:`empty_memory` at the group's first iteration). Must be None otherwise.

        Returns:
            (h_t [batch, seq, d_model], per-layer outputs, each [batch, seq, d_model]; the last one is h_t).
        """
        layers = cast(nn.ModuleList, self.blocks[group])
        if self.cfg.loop_memory:
            if memory is None or len(memory) != len(layers):
                raise ValueError(f"this model has loop memory: step needs memory= one tensor per block layer "
                                 f"({len(layers)}), from empty_memory / extend_memory")
        elif memory is not None:
            raise ValueError("memory= given to a model without loop memory (model.loop_memory is false)")
        form = self.cfg.loop_form
        if form == "add":
            x = h + h0 if self.cfg.reinject else h
        elif form == "norm_add":
            if self.cfg.reinject:
                assert self.norm_e is not None  # built when reinject
                x = self.norm_h(h) + self.norm_e(h0)
            else:
                x = self.norm_h(h)
        else:
            assert self.adapter is not None and self.norm_e is not None  # built for loop_form adapter (reinject)
            x = self.adapter(torch.cat([self.norm_h(h), self.norm_e(h0)], dim=-1))
        outputs = []
        for j, layer in enumerate(layers):
            kv = None if cache is None else cache.layer("loop", loop, j)
            x = layer(x, kv) if memory is None else layer(x, kv, memory[j])
            outputs.append(x)
        return x, tuple(outputs)

    def empty_memory(self, group: int, like: torch.Tensor) -> Memory | None:
        """The loop memory at a group's first iteration (no entries): one [batch, seq, 0, d_model] tensor per block
        layer, shaped and typed as ``like`` [batch, seq, d_model]; None for models without ``loop_memory``."""
        if not self.cfg.loop_memory:
            return None
        B, S, D = like.shape
        return tuple(like.new_zeros(B, S, 0, D) for _ in range(self.cfg.groups[group].n_layer))

    @staticmethod
    def extend_memory(memory: Memory, outputs: tuple[torch.Tensor, ...]) -> Memory:
        """The memory after one more iteration: each layer's entries [batch, seq, m, D] + its output [batch, seq, D]."""
        return tuple(torch.cat([m, o.unsqueeze(2)], dim=2) for m, o in zip(memory, outputs, strict=True))

    @inference_kernels
    def readout(self, h: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """Exit path at any loop: coda -> shared norm -> head. [..., seq, d_model] -> [..., seq, vocab].

        Decoding: the coda's attention reads and extends ``cache`` layer ``("coda", i)``."""
        for i, layer in enumerate(self.coda):
            h = layer(h, None if cache is None else cache.layer("coda", i))
        return self.head(self.ln_f(h))

    @inference_kernels
    def gate_logit(self, h: torch.Tensor, stop_gradient: bool = False) -> torch.Tensor:
        """Halting-gate logit on the normed state: [..., d_model] -> [...].

        ``stop_gradient``: the same values, with no gradient into the state or the shared norm (only the gate's own
        weights learn; RecurTrace's decoupled head, ``looptrace.models.regimes``)."""
        assert self.gate is not None
        if stop_gradient:
            ln = self.ln_f
            return self.gate(F.layer_norm(h.detach(), ln.normalized_shape, ln.weight.detach(), ln.bias.detach(),
                                          ln.eps))
        return self.gate(self.ln_f(h))

    @inference_kernels
    def forward(self, idx: torch.Tensor, with_logits: bool = True) -> LoopOutput:
        """Run all T loops.

        Args:
            idx: [batch, seq] token ids.
            with_logits: also read out every loop (skip for state-only capture).

        Returns:
            :class:`LoopOutput` with per-loop states, readouts and gate logits.
        """
        h0 = self.embed(idx)  # [B, S, D]
        h = h0
        states = []
        for g, group in enumerate(self.cfg.groups):
            memory = self.empty_memory(g, h0)  # None without loop memory
            for _ in range(group.loops):
                h, outputs = self.step_outputs(h, h0, g, memory=memory)  # [B, S, D]
                if memory is not None:
                    memory = self.extend_memory(memory, outputs)
                states.append(h)
        hidden = torch.stack(states, dim=2)  # [B, S, T, D]
        logits = None
        if with_logits:
            # The coda attends over positions, so read out loop by loop: [B, S, D] each. unbind, not T selects:
            # its backward stacks the T gradients into one [B, S, T, D] tensor, where each select's would fill
            # a zero tensor of that size and the T of them be summed (8 % of a default training step; same bits).
            logits = torch.stack([self.readout(h_t) for h_t in hidden.unbind(2)], dim=2)  # [B, S, T, V]
        gate_logits = self.gate_logit(hidden) if self.gate is not None else None  # [B, S, T]
        return LoopOutput(hidden=hidden, hidden_init=h0, logits=logits, gate_logits=gate_logits)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


def save_checkpoint(path, model: LoopedTransformer, **meta) -> None:
    """Write a checkpoint that carries its own config: weights, model config and ``meta``
    (task, regime, seed, metrics, versions...). Written to a temp file and renamed, so an
    interrupted save never leaves a truncated ``model.pt``.

    Everything but the tensors must be plain values (dict, list, tuple, str, int, float, bool, None): the file is
    read back with ``torch.load(weights_only=True)`` (:func:`load_checkpoint`), which refuses any other object.
    """
    import json
    import os
    from pathlib import Path

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    # Through JSON and back: pickle writes an object met twice as a back-reference, so the bytes (the checkpoint
    # hash every store records) would depend on which values share an object, not only on the values (a resumed
    # run rebuilds its history from its resume state, equal but unshared).
    plain = json.loads(json.dumps(meta))
    torch.save({"model_config": model.cfg.to_dict(), "state_dict": model.state_dict(), **plain}, tmp)
    os.replace(tmp, path)


def rebuild_hint(path) -> str:
    """How to rebuild the checkpoint at ``path`` (``<train_root>/<model>/model.pt`` or ``.../checkpoints/*.pt``)."""
    from pathlib import Path

    path = Path(path)
    model_dir = path.parent.parent if path.parent.name == "checkpoints" else path.parent
    return f"rebuild it with `dvc repro train` (or `looptrace train` for model '{model_dir.name}')"


#: What a checkpoint that :func:`load_checkpoint` reads is.
_EXPECTED = "expected a looptrace model.pt written by `looptrace train`"


def load_checkpoint(path, map_location: str = "cpu", name: str | None = None) -> tuple[LoopedTransformer, dict]:
    """Load a checkpoint written by :func:`save_checkpoint`; returns (model in eval mode, full dict).

    ``name``, when given, is the model the caller looks for (the ``<model>`` of ``<train_root>/<model>/model.pt``): a
    checkpoint that records another model's name (copied or renamed under this one) is refused, since every
    number a stage derives from it would be credited to the wrong model.

    Read with ``torch.load(weights_only=True)``: tensors and plain values only, so a tampered file cannot run code
    (checkpoints travel between people through DVC remotes).

    Raises:
        MissingInputError: no file at ``path``.
        CheckpointLoadError: the file is truncated, not a torch checkpoint, or not a looptrace model (one line:
            the file, what was expected, how to rebuild it).
    """
    import pickle
    import zipfile
    from pathlib import Path

    path = Path(path)
    if not path.is_file():
        raise MissingInputError(f"checkpoint '{path}' not found; {rebuild_hint(path)}")
    if not zipfile.is_zipfile(path):  # torch.save writes a zip archive; a cut or foreign file has no directory
        raise CheckpointLoadError(f"checkpoint '{path}' ({path.stat().st_size} bytes) is truncated or not a torch "
                                  f"checkpoint (not a zip archive); {_EXPECTED}; {rebuild_hint(path)}")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        if "weights only" in str(exc).lower():  # a global other than tensors and plain values: never run it
            raise CheckpointLoadError(f"checkpoint '{path}' holds objects other than tensors and plain values "
                                      f"(refused: loading it could run code; {_first_line(exc)}); {_EXPECTED}; "
                                      f"{rebuild_hint(path)}") from None
        raise CheckpointLoadError(f"checkpoint '{path}' ({path.stat().st_size} bytes) is truncated or not a torch "
                                  f"checkpoint ({_first_line(exc)}); {_EXPECTED}; {rebuild_hint(path)}") from None
    except Exception as exc:  # noqa: BLE001 - whatever fails while parsing the file is the file's problem
        raise CheckpointLoadError(f"checkpoint '{path}' ({path.stat().st_size} bytes) is truncated or not a torch "
                                  f"checkpoint ({_first_line(exc)}); {_EXPECTED}; {rebuild_hint(path)}") from None
    if not isinstance(ckpt, dict) or not {"model_config", "state_dict"} <= set(ckpt):
        raise CheckpointLoadError(f"checkpoint '{path}' has no model_config/state_dict; {_EXPECTED}; "
                                  f"{rebuild_hint(path)}")
    if name is not None and ckpt.get("name") not in (None, name):
        raise CheckpointLoadError(f"checkpoint '{path}' is model '{ckpt.get('name')}', not '{name}' (another "
                                  f"model's checkpoint under this name?); {rebuild_hint(path)}")
    try:
        model = LoopedTransformer(ModelConfig.from_dict(ckpt["model_config"]))
        model.load_state_dict(ckpt["state_dict"])
    except (TypeError, ValueError, KeyError, RuntimeError, AttributeError) as exc:
        raise CheckpointLoadError(f"checkpoint '{path}': its weights do not match its model_config "
                                  f"({_first_line(exc)}); {_EXPECTED}; {rebuild_hint(path)}") from None
    model.eval()
    return model, ckpt


def _first_line(exc: BaseException) -> str:
    msg = str(exc).strip()
    return (msg.splitlines()[0] if msg else type(exc).__name__)[:160]
