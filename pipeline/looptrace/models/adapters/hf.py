"""Hugging Face looped language models through the model interface (:mod:`looptrace.models.interface`).

Five kinds of checkpoint, each loaded from a local directory only (``local_files_only=True``):

- ``dory`` — transformers' native ``DoryForCausalLM`` (prelude / recurrent / coda, ``n_recurrent_loops``).
  Loop t runs ``h ← R(norm(h) + norm(prelude))`` through the recurrent layers; h_t is the output of the
  last recurrent layer after pass t, h_0 the prelude output. Exit at loop t = coda layers + final L2
  norm + ``DoryLMHead`` (with its per-token logit scale) applied to h_t.
- ``inkling2loop`` — transformers' native ``Inkling2LoopForCausalLM`` (layers
  ``[loop_layer_index_start, loop_layer_index_end)`` run ``loop_num_passes`` times; every pass restarts
  from the pre-loop state and receives messages from the previous pass). Its layers read *block
  attention residuals* — a stack of block summaries that the coda reads too — so the state after pass t
  is (h_t, block_states_t): h_t is stored, and the exit at loop t replays the coda on (h_t,
  block_states_t) of the same batch (kept from the last :meth:`states` call), then ``final_input`` +
  norm + head + logit softcap.
- ``retrofit`` — any standard decoder (Llama / Qwen / Mistral style: ``model.model.layers``,
  ``model.model.norm``, ``model.lm_head``) with the contiguous block of layers ``[start, end)`` run
  ``n_loops`` times (RecurTrace's setup, [RT]); h_t = block output after pass t, h_0 = the block's input.
  Exit = layers ``[end, L)`` + final norm + head. Loop 1 is the unmodified model.
- ``ouro`` — Ouro (remote code ``modeling_ouro.py``, ``trust_remote_code``): ``model.model(...)`` returns the
  per-step hidden states (normed; each feeds the next step) and per-step exit-gate logits; the gate is stored
  (``gate_logit``) so Ouro's Q-exit (SPEC §4) is evaluated. Exit at loop t = ``lm_head(h_t)``, the model's own
  ``forward(exit_at_step=t−1)``.
- ``huginn`` — Huginn / Raven (remote code ``raven_modeling_minimal.py``): ``embed_inputs`` →
  ``initialize_state`` → ``iterate_one_step(current_step=t)`` × T; h_t is the raw core-block output, the exit
  ``predict_from_latents(h_t)`` (ln_f → coda → ln_f → head) = the model's ``forward(num_steps=t)``. h_0 and the
  test-time noise come from a stream seeded per sequence (:func:`sequence_seed`).

Both remote-code kinds load through :mod:`looptrace.models.adapters.compat`, which runs the published code under
the installed transformers (5.x) without touching the checkpoint; load failures with a known cause are one-line
:class:`~looptrace.models.adapters.compat.CheckpointLoadError` s.

How states are captured without re-implementing a model: the model's *own* forward runs with forward
hooks on the layer whose output is the loop state, while the layers after the loop (the coda) are
swapped for recorders that log their exact call arguments (attention masks, position embeddings,
relative distances...) and pass the state through unchanged — so the forward costs prelude + loops only,
and each per-loop readout replays the real coda layers with the recorded arguments. ``retrofit`` replays
the block layers the same way for passes 2..k.

``verify_exit`` (default on): on the first batch the adapter checks that its exit path reproduces the
model's own logits (at the last loop; at loop 1 for ``retrofit``) and fails with a one-line error otherwise
(docs/adapters.md).
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from looptrace.config import ConfigError, InputError, from_dict, to_dict
from looptrace.models.adapters import compat
from looptrace.models.adapters.compat import CheckpointLoadError
from looptrace.models.adapters.registry import adapter_kind, adapter_kinds, register_adapter
from looptrace.models.interface import AdapterInfo, LoopedModelAdapter, States, file_sha256

MODEL_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


@dataclass(frozen=True)
class AdapterConfig:
    """``dump.adapter`` section: which checkpoint to run and how to loop it.

    Attributes:
        kind: ``dory`` | ``inkling2loop`` | ``retrofit`` | ``ouro`` | ``huginn``.
        path: local checkpoint directory (config.json + weights; the tokenizer for text dumps).
        name: run name ``<model>`` of the artifacts (default: the directory name).
        dtype: weights/compute dtype: ``float32`` | ``bfloat16`` | ``float16`` | ``auto`` (the checkpoint's).
        n_loops: T. Native kinds: overrides the checkpoint's loop count (dory ``n_recurrent_loops``,
            inkling2loop ``loop_num_passes``, ouro ``total_ut_steps``, huginn ``mean_recurrence``); null keeps
            it. ``retrofit``: passes through the block (required).
        block: ``retrofit`` only: ``[start, end)`` layer indices of the looped block (0 < start < end ≤ L
            is not required: start may be 0, end may be L).
        trust_remote_code: run the checkpoint directory's own modeling code (required for ouro / huginn;
            the code is read from the local directory only).
        attn_implementation: transformers attention backend (``eager``, ``sdpa``...); null = the default.
        verify_exit: check the exit path against the model's own forward logits on the first batch.
        seed: base seed of Huginn's random streams (initial state, test-time noise): each sequence draws from its
            own stream, :func:`sequence_seed` (seed, its token ids); other kinds are deterministic.
    """

    kind: str
    path: str
    name: str | None = None
    dtype: str = "float32"
    n_loops: int | None = None
    block: tuple[int, ...] | None = None
    trust_remote_code: bool = False
    attn_implementation: str | None = None
    verify_exit: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        kinds = adapter_kinds()
        if self.kind not in kinds:
            raise ConfigError(f"dump.adapter.kind must be one of {', '.join(kinds)}, got {self.kind!r}")
        entry = kinds[self.kind]
        if self.dtype not in (*MODEL_DTYPES, "auto"):
            raise ConfigError(f"dump.adapter.dtype must be one of {', '.join(MODEL_DTYPES)}, auto; got {self.dtype!r}")
        if self.n_loops is not None and self.n_loops < 1:
            raise ConfigError(f"dump.adapter.n_loops must be >= 1, got {self.n_loops}")
        if entry.needs_block:
            if self.block is None or len(self.block) != 2 or not 0 <= self.block[0] < self.block[1]:
                raise ConfigError(f"dump.adapter.block: {self.kind} needs [start, end) with 0 <= start < end, "
                                  f"got {self.block!r}")
            if self.n_loops is None:
                raise ConfigError(f"dump.adapter.n_loops: {self.kind} needs the number of passes through the block")
        elif self.block is not None:
            blocks = [k for k, e in kinds.items() if e.needs_block]
            raise ConfigError(f"dump.adapter.block is only for kind {', '.join(blocks)} (kind is {self.kind})")
        if entry.remote and not self.trust_remote_code:
            raise ConfigError(f"dump.adapter.trust_remote_code: kind {self.kind} runs the checkpoint's own "
                              "modeling code; set it to true (the code is read from the local directory only)")

    @property
    def run_name(self) -> str:
        return self.name or Path(self.path).resolve().name


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------

def checkpoint_hash(path: Path | str) -> str:
    """sha256 over the weight files of a checkpoint directory (name + content hash of each, sorted)."""
    path = Path(path)
    files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in WEIGHT_SUFFIXES)
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + b"\0" + file_sha256(f).encode() + b"\n")
    return h.hexdigest()


def _model_config_dict(config) -> dict:
    try:
        return json.loads(config.to_json_string(use_diff=False))
    except (TypeError, ValueError):
        return {"model_type": getattr(config, "model_type", None)}


def load_hf_model(cfg: AdapterConfig, device: str = "cpu") -> nn.Module:
    """Load the causal LM of ``cfg.path`` (local files only) in ``cfg.dtype``, in eval mode on ``device``.

    ``ouro`` / ``huginn`` checkpoints carrying their remote code load through the compatibility shim
    (:mod:`looptrace.models.adapters.compat`); the patches in force are kept in ``model._looptrace_compat_patches``.

    Raises:
        CheckpointLoadError: one line naming the directory, what failed and the fix (missing directory or
            config.json, unknown architecture, missing weights, remote code that does not fit the installed
            transformers); an unexpected error propagates with its traceback.
    """
    # lazy: transformers: a multi-second import, only once a checkpoint is loaded
    from transformers.utils import logging as hf_logging

    path = Path(cfg.path)
    if not path.is_dir():
        raise CheckpointLoadError(f"dump.adapter.path '{path}' is not a directory; point it at a local checkpoint "
                                  "directory (config.json + weights)")
    if not (path / "config.json").is_file():
        raise CheckpointLoadError(f"dump.adapter.path '{path}' has no config.json; it must be a save_pretrained "
                                  "directory")
    dtype = "auto" if cfg.dtype == "auto" else MODEL_DTYPES[cfg.dtype]
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # the dump has its own progress bar; keep stage output to one line
    try:
        if adapter_kind(cfg.kind).remote and compat.read_auto_map(path):
            over = {"total_ut_steps": cfg.n_loops} if cfg.kind == "ouro" and cfg.n_loops is not None else {}
            model, patches = compat.load_remote_model(path, cfg.kind, dtype, cfg.attn_implementation, over)
            model._looptrace_compat_patches = patches
        else:
            model = _load_auto(cfg, path, dtype)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    return model.to(device).eval()


def _load_auto(cfg: AdapterConfig, path: Path, dtype) -> nn.Module:
    """transformers' Auto classes (native architectures, or remote code the shim does not know)."""
    # lazy: transformers: a multi-second import, only once a checkpoint is loaded
    from transformers import AutoConfig, AutoModelForCausalLM

    kw: dict[str, Any] = {"local_files_only": True, "trust_remote_code": cfg.trust_remote_code, "dtype": dtype}
    if cfg.attn_implementation:
        kw["attn_implementation"] = cfg.attn_implementation
    try:
        hf_cfg = AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=cfg.trust_remote_code)
        auto: type[Any] = AutoModelForCausalLM  # or the multimodal wrapper's Auto class, below
        if getattr(hf_cfg, "model_type", None) == "inkling2_loop":  # the released multimodal wrapper
            # lazy: transformers: a multi-second import, only once a checkpoint is loaded
            from transformers import AutoModelForImageTextToText as auto
        return auto.from_pretrained(path, **kw)
    except (OSError, ValueError, KeyError) as exc:
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointLoadError(f"dump.adapter.path '{path}': cannot load the checkpoint ({msg})") from None
    except Exception as exc:
        if cfg.trust_remote_code and compat.is_incompatibility(exc):
            raise CheckpointLoadError(compat.describe_failure(path, cfg.kind, exc)) from exc
        raise


def load_adapter(spec: AdapterConfig | dict, device: str = "cpu") -> LoopedModelAdapter:
    """The adapter of one checkpoint: ``spec`` (an :class:`AdapterConfig` or its mapping) → a
    :class:`~looptrace.models.interface.LoopedModelAdapter`.

    Args:
        spec: the ``dump.adapter`` section.
        device: torch device of the model (``base.device``).
    """
    if isinstance(spec, dict):
        spec = from_dict(AdapterConfig, spec, "dump.adapter")
    kind = adapter_kind(spec.kind)
    with compat.quiet_transformers() if kind.remote else contextlib.nullcontext():
        return kind.adapter(load_hf_model(spec, device), spec, device)


# ---------------------------------------------------------------------------------------------
# Recording the coda's call arguments
# ---------------------------------------------------------------------------------------------

Call = tuple[tuple, dict]  # (positional args, keyword args) of one layer call


def _hidden_of(args: tuple, kwargs: dict) -> torch.Tensor:
    return args[0] if args else kwargs["hidden_states"]


class _Recorder(nn.Module):
    """Stands in for a decoder layer during :meth:`states`: logs the call and returns the state unchanged."""

    def __init__(self, layer: nn.Module, log: list[Call]):
        super().__init__()
        self._log = log
        for attr in ("attention_type", "is_block_boundary", "layer_idx", "is_sliding"):
            if hasattr(layer, attr):  # read by the model's forward between layer calls
                setattr(self, attr, getattr(layer, attr))

    def forward(self, *args, **kwargs):
        self._log.append((args, kwargs))
        return _hidden_of(args, kwargs)


@contextlib.contextmanager
def _recording(layers: nn.ModuleList, indices: range, log: list[Call]):
    """Swap ``layers[i]`` (i in ``indices``) for recorders; restore them whatever happens."""
    saved = {i: layers[i] for i in indices}
    try:
        for i in indices:
            layers[i] = _Recorder(saved[i], log)
        yield
    finally:
        for i, layer in saved.items():
            layers[i] = layer


@contextlib.contextmanager
def _hooks(*handles):
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _replay(layer: nn.Module, call: Call, h: torch.Tensor, block: torch.Tensor | None = None) -> torch.Tensor:
    """Call ``layer`` with a recorded call's arguments, the state replaced by ``h`` (and block states)."""
    args, kwargs = call
    kwargs = dict(kwargs)
    if args:
        args = (h, *args[1:])
    else:
        kwargs["hidden_states"] = h
    if block is not None:
        if len(args) > 1:
            args = (args[0], block, *args[2:])
        else:
            kwargs["block_states"] = block
    out = layer(*args, **kwargs)
    return out[0] if isinstance(out, tuple) else out


def _stripped(args: tuple, kwargs: dict) -> Call:
    """A recorded call without its state (``_replay`` puts one back): the log then keeps masks and position
    embeddings alive, not every intermediate state of the batch."""
    if args:
        return (None, *args[1:]), dict(kwargs)
    return (), {k: v for k, v in kwargs.items() if k != "hidden_states"}


def _normal(x: Any, memo: dict[int, torch.Tensor] | None = None) -> Any:
    """``x`` with every inference-mode tensor cloned outside inference mode (tuples, lists, dicts walked; a tensor
    shared by several recorded calls — the mask, the rotary tables — is cloned once).

    :meth:`HFAdapter.states` runs under ``torch.inference_mode``, so what it keeps for the loop step (the
    injection, recorded masks, rotary tables) are inference tensors, which autograd may not save for backward."""
    memo = {} if memo is None else memo
    if isinstance(x, torch.Tensor):
        if not x.is_inference():
            return x
        if id(x) not in memo:
            with torch.inference_mode(False):
                memo[id(x)] = x.clone()
        return memo[id(x)]
    if isinstance(x, tuple | list):
        return type(x)(_normal(v, memo) for v in x)
    if isinstance(x, dict):
        return {k: _normal(v, memo) for k, v in x.items()}
    return x


def _recording_calls(layers: list[nn.Module], log: list[Call]):
    """Forward pre-hooks that log every call of ``layers`` (state stripped), in call order."""
    def pre(_module, args, kwargs):
        log.append(_stripped(args, kwargs))
    return _hooks(*(layer.register_forward_pre_hook(pre, with_kwargs=True) for layer in layers))


@dataclass
class _Context:
    """What the per-loop readout needs from the last :meth:`states` call (same batch)."""

    shape: tuple[int, int]
    coda: list[Call]
    hidden: torch.Tensor | None = None        # [batch, seq, loop, d_model] (content check)
    blocks: list[torch.Tensor] | None = None  # Inkling2Loop: block states after each pass
    step: dict[str, Any] | None = None        # what the loop step needs (loop_step; normal tensors on first use)


# ---------------------------------------------------------------------------------------------
# Adapters
# ---------------------------------------------------------------------------------------------

class HFAdapter(LoopedModelAdapter):
    """Shared plumbing: info, device/dtype, per-batch context, exit-path verification."""

    kind = ""

    def __init__(self, model: nn.Module, cfg: AdapterConfig, device: str = "cpu"):
        self.model = model
        self.cfg = cfg
        self._device = torch.device(device)
        self.dtype = next(model.parameters()).dtype
        self._ctx: _Context | None = None
        self._verified = not cfg.verify_exit
        n_loops, d_model, vocab = self._shape()
        self.info = AdapterInfo(
            name=cfg.run_name, n_loops=n_loops, d_model=d_model, vocab_size=vocab, loop_group=[0] * n_loops,
            has_gate=self.has_gate, config={"adapter": to_dict(cfg), "model": _model_config_dict(model.config)},
            checkpoint_hash=checkpoint_hash(cfg.path),
            extra={"adapter": cfg.kind, "path": str(Path(cfg.path).resolve()), "dtype": str(self.dtype).split(".")[-1],
                   "model_type": getattr(model.config, "model_type", None), "architecture": type(model).__name__},
        )
        patches = getattr(model, "_looptrace_compat_patches", None)
        if patches is not None:  # remote code loaded through the compatibility shim (provenance)
            # lazy: transformers: a multi-second import, only once a checkpoint is loaded
            import transformers

            self.info.extra["compat_patches"] = list(patches)
            self.info.extra["transformers"] = transformers.__version__

    has_gate = False

    # -- to implement ------------------------------------------------------------------------
    def _shape(self) -> tuple[int, int, int]:
        """(T, d_model, vocab)."""
        raise NotImplementedError

    def _states(self, ids: torch.Tensor) -> States:
        raise NotImplementedError

    def _readout(self, h: torch.Tensor, loop: int) -> torch.Tensor:
        raise NotImplementedError

    def _reference(self, ids: torch.Tensor) -> tuple[int, torch.Tensor]:
        """(0-based loop, the model's own forward logits [batch, seq, vocab]) for the exit-path check."""
        return self.info.n_loops - 1, self.model(input_ids=ids, use_cache=False).logits

    # -- the loop step (contraction, interventions) and the loop block's layers (dump.layers) ------------------
    # A kind that implements loop_step / loop_layers defines them itself (the dump checks whether the class
    # overrides the interface's), with what states() recorded of the batch in self._ctx.step.

    def loop_step_layers(self, h: torch.Tensor, h0: torch.Tensor, loop: int
                         ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """:meth:`loop_step` and the outputs of every layer of the loop block during it, in order (each
        [batch, seq, d_model]; differentiable like the step)."""
        outs: list[torch.Tensor] = []

        def record(_module, _inputs, output) -> None:
            outs.append(output[0] if isinstance(output, tuple) else output)

        with _hooks(*(layer.register_forward_hook(record) for layer in self.loop_layers(0))):
            out = self.loop_step(h, h0, loop)
        return out, outs

    def _step_context(self, h: torch.Tensor, loop: int) -> dict[str, Any]:
        """What :meth:`states` kept of the batch for the loop step, as normal (non-inference) tensors.

        Raises:
            ValueError: no states() yet, another batch's shape, or a loop out of range.
        """
        ctx = self._ctx
        if ctx is None or ctx.step is None or tuple(h.shape[:2]) != ctx.shape:
            raise ValueError(f"adapter '{self.info.name}': loop_step needs the states() of the same batch first "
                             f"(got h of shape {tuple(h.shape)})")
        if not 0 <= loop < self.info.n_loops:
            raise ValueError(f"loop {loop} out of range 0..{self.info.n_loops - 1}")
        if not ctx.step.get("_normal"):
            ctx.step = {**_normal(ctx.step), "_normal": True}
        return ctx.step

    # -- interface ---------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self._device

    @torch.inference_mode()
    def states(self, input_ids: torch.Tensor) -> States:
        """Run every loop on [batch, seq] token ids: hidden [batch, seq, loop, d_model] in the model dtype."""
        ids = input_ids.to(self._device)
        with self._remote_code_errors():
            st = self._states(ids)
            T = self.info.n_loops
            if st.hidden.shape[2] != T:
                raise InputError(f"adapter '{self.info.name}' ({self.kind}): the model ran {st.hidden.shape[2]} "
                                 f"loops, expected {T}")
            if not self._verified:
                self._verify(ids, st)
        return st

    @contextlib.contextmanager
    def _remote_code_errors(self):
        """Remote code that fails inside itself or transformers with an interface error (a revision the shim does
        not cover) is a one-line :class:`CheckpointLoadError`; anything else keeps its traceback."""
        if not adapter_kind(self.cfg.kind).remote:
            yield
            return
        try:
            with compat.quiet_transformers():
                yield
        except Exception as exc:
            if compat.is_incompatibility(exc, remote_only=True):
                raise CheckpointLoadError(compat.describe_failure(self.cfg.path, self.cfg.kind, exc,
                                                                  "run")) from exc
            raise

    @torch.inference_mode()
    def readout(self, h: torch.Tensor, loop: int) -> torch.Tensor:
        """Logits [batch, seq, vocab] (float32) of an exit after loop ``loop`` (0-based) of the last batch."""
        if not 0 <= loop < self.info.n_loops:
            raise ValueError(f"loop {loop} out of range 0..{self.info.n_loops - 1}")
        ctx = self._ctx
        if ctx is None or tuple(h.shape[:2]) != ctx.shape:
            raise ValueError(f"adapter '{self.info.name}': readout needs the states() of the same batch first "
                             f"(got h of shape {tuple(h.shape)})")
        return self._readout(h.to(self._device, self.dtype), loop).float()

    def _verify(self, ids: torch.Tensor, st: States) -> None:
        loop, ref = self._reference(ids)
        got = self.readout(st.hidden[:, :, loop], loop)
        self._check_close(got, ref.float(), loop)
        self._verified = True

    def _check_close(self, got: torch.Tensor, ref: torch.Tensor, loop: int) -> None:
        tol = (1e-3 if self.dtype == torch.float32 else 3e-2) * (1.0 + float(ref.abs().max()))
        err = float((got - ref).abs().max())
        if not err <= tol:  # NaN-safe
            raise InputError(
                f"adapter '{self.info.name}' ({self.kind}): the per-loop exit path does not reproduce the model's "
                f"own logits at loop {loop + 1} (max |diff| {err:.3g} > {tol:.3g}); the checkpoint's code differs "
                "from the interface this adapter implements (docs/adapters.md) — set dump.adapter.verify_exit: "
                "false only if you accept that")


@register_adapter("dory")
class DoryAdapter(HFAdapter):
    """``DoryForCausalLM``: prelude → recurrent section × ``n_recurrent_loops`` → coda (see module doc)."""

    def __init__(self, model, cfg, device="cpu"):
        base = model.model
        if cfg.n_loops is not None:
            base.config.n_recurrent_loops = cfg.n_loops
        c = base.config
        self.P, self.R, self.C = c.n_input_layers, c.n_recurrent_layers, c.n_output_layers
        if self.R < 1:
            raise InputError(f"dump.adapter.path '{cfg.path}': Dory checkpoint has no recurrent layers")
        super().__init__(model, cfg, device)

    def _shape(self):
        return self.model.model.config.n_recurrent_loops, self.model.config.hidden_size, self.model.lm_head.out_features

    def _states(self, ids):
        base = self.model.model
        L = len(base.layers)
        loops: list[torch.Tensor] = []
        init: list[torch.Tensor] = []
        coda: list[Call] = []
        last = base.layers[self.P + self.R - 1]
        first = base.layers[self.P - 1] if self.P > 0 else base.embed_tokens
        calls: list[Call] = []  # the recurrent layers' calls, every loop (the loop step replays them)
        with _hooks(last.register_forward_hook(lambda m, a, o: loops.append(o)),
                    first.register_forward_hook(lambda m, a, o: init.append(o) if not init else None)), \
                _recording_calls(self.loop_layers(0), calls), _recording(base.layers, range(L - self.C, L), coda):
            base(input_ids=ids, use_cache=False)
        hidden = torch.stack(loops, dim=2)
        self._ctx = _Context(tuple(ids.shape), coda, step={"calls": calls})
        return States(hidden=hidden, hidden_init=init[0])

    def loop_layers(self, group: int) -> list[nn.Module]:
        """The recurrent layers ``[P, P + R)``."""
        base: Any = self.model.model  # transformers' DoryModel (attributes mypy cannot see through nn.Module)
        return list(base.layers[self.P:self.P + self.R])

    def loop_step(self, h: torch.Tensor, h0: torch.Tensor, loop: int) -> torch.Tensor:
        """``DoryModel``'s loop: h ← R(norm(h) + norm(h_0)) (h_0 the prelude output), the recurrent layers called
        with the arguments the model's own forward gave them at this loop."""
        calls = self._step_context(h, loop)["calls"]
        base: Any = self.model.model
        x = base.norm(h) + base.norm(h0)
        for layer, call in zip(self.loop_layers(0), calls[loop * self.R:(loop + 1) * self.R], strict=True):
            x = _replay(layer, call, x)
        return x

    def _readout(self, h, loop):
        base = self.model.model
        L = len(base.layers)
        for i, call in zip(range(L - self.C, L), self._ctx.coda, strict=True):
            h = _replay(base.layers[i], call, h)
        return self.model.lm_head(base.norm(h))


@register_adapter("retrofit", needs_block=True)
class RetrofitAdapter(HFAdapter):
    """A standard decoder with layers ``[start, end)`` looped ``n_loops`` times ([RT]'s retrofit)."""

    def __init__(self, model, cfg, device="cpu"):
        base = getattr(model, "model", None)
        if base is None or not hasattr(base, "layers") or not hasattr(base, "norm") or \
                model.get_output_embeddings() is None:
            raise InputError(f"dump.adapter.path '{cfg.path}': kind retrofit needs a decoder with model.layers, "
                             f"model.norm and an lm_head ({type(model).__name__} has not)")
        L = len(base.layers)
        self.start, self.end = int(cfg.block[0]), int(cfg.block[1])
        if self.end > L:
            raise ConfigError(f"dump.adapter.block [{self.start}, {self.end}) exceeds the model's {L} layers")
        self.softcap = getattr(model.config, "final_logit_softcapping", None)
        super().__init__(model, cfg, device)

    def _shape(self):
        return self.cfg.n_loops, self.model.config.hidden_size, self.model.get_output_embeddings().out_features

    def _states(self, ids):
        base = self.model.model
        L = len(base.layers)
        calls: list[Call] = []
        with _recording(base.layers, range(self.start, L), calls):
            base(input_ids=ids, use_cache=False)
        if len(calls) != L - self.start:
            raise InputError(f"adapter '{self.info.name}': expected {L - self.start} calls of layers "
                             f"{self.start}..{L - 1}, saw {len(calls)}")
        h0 = _hidden_of(*calls[0])
        block = calls[: self.end - self.start]
        h, loops = h0, []
        for _ in range(self.cfg.n_loops):
            for i, call in zip(range(self.start, self.end), block, strict=True):
                h = _replay(base.layers[i], call, h)
            loops.append(h)
        self._ctx = _Context(tuple(ids.shape), calls[self.end - self.start:],
                             step={"calls": [_stripped(*c) for c in block]})
        return States(hidden=torch.stack(loops, dim=2), hidden_init=h0)

    def loop_layers(self, group: int) -> list[nn.Module]:
        """The looped block ``[start, end)``."""
        base: Any = self.model.model  # a decoder's base model (model.layers)
        return list(base.layers[self.start:self.end])

    def loop_step(self, h: torch.Tensor, h0: torch.Tensor, loop: int) -> torch.Tensor:
        """One pass through the block, each layer called with the arguments of its call in the model's forward
        (exactly what :meth:`states` replays)."""
        calls = self._step_context(h, loop)["calls"]
        for layer, call in zip(self.loop_layers(0), calls, strict=True):
            h = _replay(layer, call, h)
        return h

    def _readout(self, h, loop):
        base = self.model.model
        L = len(base.layers)
        for i, call in zip(range(self.end, L), self._ctx.coda, strict=True):
            h = _replay(base.layers[i], call, h)
        logits = self.model.get_output_embeddings()(base.norm(h)).float()
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def _reference(self, ids):
        return 0, self.model(input_ids=ids, use_cache=False).logits  # pass 1 = the unlooped model


@register_adapter("inkling2loop", no_decoder="its layers read whole-pass block states")
class Inkling2LoopAdapter(HFAdapter):
    """``Inkling2LoopForCausalLM`` (or the multimodal wrapper's language model), see module doc."""

    def __init__(self, model, cfg, device="cpu"):
        self.text = getattr(model.model, "language_model", model.model)
        c = self.text.config
        if cfg.n_loops is not None:
            c.loop_num_passes = cfg.n_loops
        self.s, self.e, self.L = c.loop_layer_index_start, c.loop_layer_index_end, c.num_hidden_layers
        super().__init__(model, cfg, device)

    def _shape(self):
        c = self.text.config
        return c.loop_num_passes, c.hidden_size, self.model.lm_head.out_features

    def _states(self, ids):
        tm = self.text
        loops: list[torch.Tensor] = []
        blocks: list[torch.Tensor] = []
        init: list[torch.Tensor] = []
        coda: list[Call] = []

        def on_loop_end(mod, args, kwargs, out):
            # the model appends a block summary *after* a boundary layer (its input state): mirror that so
            # blocks[t] is exactly the block_states the coda would see after pass t
            h_in = _hidden_of(args, kwargs)
            b_in = args[1] if len(args) > 1 else kwargs["block_states"]
            blocks.append(torch.cat([b_in, h_in.unsqueeze(-2)], dim=-2) if mod.is_block_boundary else b_in)
            loops.append(out)

        with _hooks(tm.layers[self.e - 1].register_forward_hook(on_loop_end, with_kwargs=True),
                    tm.layers[self.s - 1].register_forward_hook(lambda m, a, o: init.append(o))), \
                _recording(tm.layers, range(self.e, self.L), coda):
            tm(input_ids=ids, use_cache=False)
        hidden = torch.stack(loops, dim=2)
        self._ctx = _Context(tuple(ids.shape), coda, hidden=hidden, blocks=blocks)
        return States(hidden=hidden, hidden_init=init[0])

    def _readout(self, h, loop):
        ctx, tm = self._ctx, self.text
        if not torch.equal(h, ctx.hidden[:, :, loop]):
            raise InputError(f"adapter '{self.info.name}' (inkling2loop): the exit reads the block states of the "
                             "pass, so readout(h, t) only accepts the h_t of the last states() call")
        block = ctx.blocks[loop]
        for i, call in zip(range(self.e, self.L), ctx.coda, strict=True):
            layer = tm.layers[i]
            new = _replay(layer, call, h, block)
            if layer.is_block_boundary:
                block = torch.cat([block, h.unsqueeze(-2)], dim=-2)
            h = new
        h = tm.final_input(block, h)[0]
        h = tm.norm(h).to(tm.embed_tokens.weight.dtype)
        return self.model.logit_softcap(self.model.lm_head(h).float())

    def _reference(self, ids):
        return self.info.n_loops - 1, self.model(input_ids=ids, use_cache=False).logits


def _ouro_set_steps(model: nn.Module, n: int) -> None:
    """Run ``n`` recurrent steps: ``OuroModel`` copies ``total_ut_steps`` into an instance attribute at
    construction and its forward loops over that attribute, so the configs alone are not enough."""
    base: Any = model.model  # OuroModel (remote code): total_ut_steps is a plain int attribute
    c: Any  # the remote code's configs (attributes of their own)
    for c in {id(model.config): model.config, id(base.config): base.config}.values():
        c.total_ut_steps = n
    if hasattr(base, "total_ut_steps"):
        base.total_ut_steps = n


@register_adapter("ouro", remote_class="modeling_ouro.OuroForCausalLM",
                  tied_source="model.embed_tokens.weight")
class OuroAdapter(HFAdapter):
    """Ouro (remote code, ``modeling_ouro.py``): ``model.model(...)`` → (``BaseModelOutputWithPast``, [h_1..h_T],
    [gate_1..gate_T]); each h_t is already normed (``OuroModel`` applies ``norm`` after every step and feeds the
    normed state to the next), so the exit at loop t is ``lm_head(h_t)``; gate_t is ``[batch, seq, 1]``."""

    has_gate = True

    def __init__(self, model, cfg, device="cpu"):
        if cfg.n_loops is not None:
            _ouro_set_steps(model, cfg.n_loops)
        super().__init__(model, cfg, device)

    def _shape(self):
        c = self.model.config
        T = getattr(self.model.model, "total_ut_steps", None) or getattr(c, "total_ut_steps", None)
        if T is None:
            raise InputError(f"dump.adapter.path '{self.cfg.path}': Ouro config has no total_ut_steps; "
                             "set dump.adapter.n_loops")
        return int(T), c.hidden_size, self.model.get_output_embeddings().out_features

    @staticmethod
    def _split(out) -> tuple[list, list]:
        if isinstance(out, tuple | list) and len(out) >= 3:
            return list(out[1]), list(out[2])
        raise InputError("ouro adapter: model.model(...) did not return (output, hidden_states_list, gate_list) as "
                         f"Ouro's modeling_ouro.OuroModel does (got {type(out).__name__})")

    def _states(self, ids):
        init: list[torch.Tensor] = []
        calls: list[Call] = []  # every layer call of every step (the loop step replays them)
        emb = self.model.get_input_embeddings()
        with _hooks(emb.register_forward_hook(lambda m, a, o: init.append(o) if not init else None)), \
                _recording_calls(self.loop_layers(0), calls):
            out = self.model.model(input_ids=ids, use_cache=False)
        hs, gates = self._split(out)
        g = torch.stack([x.reshape(*x.shape[:2], -1)[..., 0].float() for x in gates], dim=2)  # exact for bf16/fp16
        self._ctx = _Context(tuple(ids.shape), [], step={"calls": calls})
        return States(hidden=torch.stack(hs, dim=2), hidden_init=init[0], gate_logits=g)

    def loop_layers(self, group: int) -> list[nn.Module]:
        """``OuroModel.layers[:num_hidden_layers]`` (every step runs them all)."""
        base: Any = self.model.model  # OuroModel (remote code)
        return list(base.layers[: base.config.num_hidden_layers])

    def loop_step(self, h: torch.Tensor, h0: torch.Tensor, loop: int) -> torch.Tensor:
        """``OuroModel``'s step ``current_ut = loop``: its layers, each called with the arguments (masks, rotary
        tables, ``current_ut``...) the model's own forward gave it at this step, then ``norm`` (the normed state
        is both h_t and the next step's input)."""
        calls = self._step_context(h, loop)["calls"]
        layers = self.loop_layers(0)
        L = len(layers)
        if len(calls) != L * self.info.n_loops:
            raise InputError(f"adapter '{self.info.name}' (ouro): the forward made {len(calls)} layer calls, expected "
                             f"{L} layers x {self.info.n_loops} steps; the checkpoint's code loops differently")
        for layer, call in zip(layers, calls[loop * L:(loop + 1) * L], strict=True):
            h = _replay(layer, call, h)
        base: Any = self.model.model
        return base.norm(h)

    def _readout(self, h, loop):
        return self.model.get_output_embeddings()(h)

    def _reference(self, ids):
        # The plain forward is not the last step: with config.early_exit_threshold (1.0 by default) it takes Ouro's
        # Q-exit path, where the running CDF, computed in the model dtype, can reach the threshold before step T.
        T = self.info.n_loops
        kw = {"exit_at_step": T - 1} if "exit_at_step" in inspect.signature(self.model.forward).parameters else {}
        return T - 1, self.model(input_ids=ids, use_cache=False, **kw).logits


def sequence_seed(seed: int, ids: torch.Tensor) -> int:
    """The random-stream seed of one sequence: the first 63 bits of sha256(``seed`` as 8 bytes little-endian ‖
    the sequence's token ids as int64 little-endian). A function of the sequence itself, so its trajectory does
    not depend on the batch it is in, its position there or a resume point."""
    h = hashlib.sha256(int(seed).to_bytes(8, "little", signed=True))
    h.update(ids.detach().to("cpu", torch.int64).contiguous().numpy().astype("<i8").tobytes())
    return int.from_bytes(h.digest()[:8], "little") & ((1 << 63) - 1)


@register_adapter("huginn", remote_class="raven_modeling_minimal.RavenForCausalLM",
                  tied_source="transformer.wte.weight")
class HuginnAdapter(HFAdapter):
    """Huginn / Raven (remote code, ``raven_modeling_minimal.py``): ``embed_inputs`` → ``initialize_state`` →
    ``iterate_one_step(current_step=t)`` × T; h_t is the raw core-block output, the exit at loop t is
    ``predict_from_latents(h_t)`` (ln_f → coda → ln_f → lm_head).

    Randomness: h_0 (``initialize_state``) and the test-time noise (``config.test_time_noise > 0``, one draw per
    step) come from torch's global stream. Each sequence gets its own stream, seeded by :func:`sequence_seed`,
    and draws in the order the model's own ``forward(num_steps=T)`` does on that sequence alone: h_0, then the
    noise of steps 0..T−1. Without noise h_0 is drawn per sequence and the steps run batched; with noise every
    sequence runs alone (the noise of a step is drawn for the whole batch at once)."""

    METHODS = ("embed_inputs", "initialize_state", "iterate_one_step", "predict_from_latents")

    def __init__(self, model, cfg, device="cpu"):
        missing = [m for m in self.METHODS if not callable(getattr(model, m, None))]
        if missing:
            raise InputError(f"dump.adapter.path '{cfg.path}': {type(model).__name__} lacks {', '.join(missing)} "
                             f"(kind huginn expects Huginn's raven_modeling_minimal interface: {', '.join(self.METHODS)})")
        super().__init__(model, cfg, device)

    def _shape(self):
        c = self.model.config
        T = self.cfg.n_loops or getattr(c, "mean_recurrence", None)
        if T is None:
            raise InputError(f"dump.adapter.path '{self.cfg.path}': no mean_recurrence in config; set dump.adapter.n_loops")
        d = getattr(c, "n_embd", None) or getattr(c, "hidden_size", None)
        return int(T), int(d), self.model.get_output_embeddings().out_features

    def sequence_seeds(self, ids: torch.Tensor) -> list[int]:
        """:func:`sequence_seed` of every row of ``ids``."""
        return [sequence_seed(self.cfg.seed, ids[i]) for i in range(ids.shape[0])]

    @contextlib.contextmanager
    def _stream(self, seed: int):
        """torch's global stream seeded with ``seed``, restored afterwards."""
        devices = [self._device] if self._device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            yield

    def _noisy(self) -> bool:
        return float(getattr(self.model.config, "test_time_noise", 0) or 0) > 0

    def _iterate(self, e, x, block_idx):
        loops, self._block_idx = [], []
        for t in range(self.info.n_loops):
            self._block_idx.append(block_idx.clone())  # the step's block_idx input (the loop step passes it again)
            x, block_idx, _ = self.model.iterate_one_step(e, x, block_idx=block_idx.clone(), current_step=t)
            loops.append(x)
        return torch.stack(loops, dim=2)

    def _states(self, ids):
        m = self.model
        e, block_idx = m.embed_inputs(ids)
        h0, rows = [], []
        for i, seed in enumerate(self.sequence_seeds(ids)):
            with self._stream(seed):
                h0.append(m.initialize_state(e[i:i + 1]))
                if self._noisy():  # the step noise follows h_0 in the sequence's own stream
                    rows.append(self._iterate(e[i:i + 1], h0[-1], block_idx))
        h0 = torch.cat(h0, dim=0)
        hidden = torch.cat(rows, dim=0) if rows else self._iterate(e, h0, block_idx)
        self._ctx = _Context(tuple(ids.shape), [], step=None if rows else {"e": e, "block_idx": self._block_idx})
        self._h0 = h0
        return States(hidden=hidden, hidden_init=h0)

    def loop_step_refusal(self) -> str | None:
        if self._noisy():
            return (f"adapter '{self.info.name}' (huginn): with test_time_noise > 0 every loop adds a fresh random "
                    "draw, so the loop map is not a function of the state alone (no Jacobian to take); set the "
                    "checkpoint's test_time_noise to 0")
        return None

    def loop_layers(self, group: int) -> list[nn.Module]:
        """``transformer.core_block`` (refused with test-time noise: then every sequence runs alone, and a layer's
        k-th call is not the batch's k-th loop)."""
        if self._noisy():
            raise NotImplementedError(f"adapter '{self.info.name}' (huginn): with test_time_noise > 0 the sequences "
                                      "run one at a time, so a layer's k-th call is not the batch's loop k; set the "
                                      "checkpoint's test_time_noise to 0 for dump.layers")
        m: Any = self.model  # RavenForCausalLM (remote code)
        return list(m.transformer.core_block)

    def loop_step(self, h: torch.Tensor, h0: torch.Tensor, loop: int) -> torch.Tensor:
        """Huginn's own ``iterate_one_step(e, h, block_idx, current_step=loop)`` — the body of the published method
        without its ``@torch.no_grad`` (``__wrapped__``), so that JVPs and VJPs flow — with the prelude output e and
        the block index :meth:`states` used for this batch. ``h0`` must be that call's ``hidden_init`` (Huginn's
        random initial state is not the injection: e is, and it is kept from the same call).

        Raises:
            ConfigError: test-time noise (:meth:`loop_step_refusal`).
            ValueError: ``h0`` is not the last :meth:`states` call's.
        """
        why = self.loop_step_refusal()
        if why:
            raise ConfigError(why)
        st = self._step_context(h, loop)
        if h0 is not self._h0 and not (h0.shape == self._h0.shape and torch.equal(h0, self._h0)):
            raise ValueError(f"adapter '{self.info.name}' (huginn): loop_step's h0 is not the hidden_init of the last "
                             "states() call (the injection e is kept from that call)")
        method: Any = type(self.model).iterate_one_step  # type: ignore[attr-defined]  # remote code's method
        step = getattr(method, "__wrapped__", method)
        x, _, _ = step(self.model, st["e"], h, block_idx=st["block_idx"][loop].clone(), current_step=loop)
        return x

    def _readout(self, h, loop):
        return self.model.predict_from_latents(h).logits

    def _reference(self, ids):
        """The model's own ``forward(num_steps=T)`` on each sequence alone, in that sequence's stream."""
        out = []
        for i, seed in enumerate(self.sequence_seeds(ids)):
            with self._stream(seed):
                out.append(self.model(input_ids=ids[i:i + 1], num_steps=self.info.n_loops).logits)
        return self.info.n_loops - 1, torch.cat(out, dim=0)


__all__ = ["AdapterConfig", "CheckpointLoadError", "DoryAdapter", "HFAdapter", "HuginnAdapter",
           "Inkling2LoopAdapter", "OuroAdapter", "RetrofitAdapter", "checkpoint_hash", "load_adapter", "load_hf_model",
           "sequence_seed"]
