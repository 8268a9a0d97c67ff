"""What every adapter kind shares: capturing a Hugging Face model's loop states with its own forward, and reading
out an exit after any loop by replaying its own layers.

No model is re-implemented. :meth:`HFAdapter.states` runs the model's *own* forward with forward hooks on the layer
whose output is the loop state, while the layers after the loop (the coda) are swapped for recorders
(:func:`recording`) that log their exact call arguments (attention masks, position embeddings, relative
distances...) and pass the state through unchanged — so the forward costs prelude + loops only — and each per-loop
readout replays the real coda layers with the recorded arguments (:func:`replay`). A kind that loops a block of a
standard decoder replays the block layers the same way.

A kind is a subclass in its own module (:mod:`looptrace.models.adapters.kinds` lists them): it implements
``_shape``, ``_states`` and ``_readout`` (and, where it has them, ``loop_step`` / ``loop_layers``), and says with class
attributes what it needs (:class:`HFAdapter`). ``verify_exit`` (default on): on the first batch the adapter checks that
its exit path reproduces the model's own logits (``_reference``) and fails with a one-line error otherwise
(docs/adapters.md).
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from looptrace.config import CheckpointLoadError, InputError, to_dict
from looptrace.models.adapters import compat
from looptrace.models.adapters.loading import AdapterConfig, checkpoint_hash
from looptrace.models.interface import AdapterInfo, LoopedModelAdapter, States


def _model_config_dict(config) -> dict:
    try:
        return json.loads(config.to_json_string(use_diff=False))
    except (TypeError, ValueError):
        return {"model_type": getattr(config, "model_type", None)}


# ---------------------------------------------------------------------------------------------
# Recording the coda's call arguments
# ---------------------------------------------------------------------------------------------

Call = tuple[tuple, dict]  # (positional args, keyword args) of one layer call


def hidden_of(args: tuple, kwargs: dict) -> torch.Tensor:
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
        return hidden_of(args, kwargs)


@contextlib.contextmanager
def recording(layers: nn.ModuleList, indices: range, log: list[Call]):
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
def hooks(*handles):
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def replay(layer: nn.Module, call: Call, h: torch.Tensor, block: torch.Tensor | None = None) -> torch.Tensor:
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


def stripped(args: tuple, kwargs: dict) -> Call:
    """A recorded call without its state (``replay`` puts one back): the log then keeps masks and position
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


def recording_calls(layers: list[nn.Module], log: list[Call]):
    """Forward pre-hooks that log every call of ``layers`` (state stripped), in call order."""
    def pre(_module, args, kwargs):
        log.append(stripped(args, kwargs))
    return hooks(*(layer.register_forward_pre_hook(pre, with_kwargs=True) for layer in layers))


@dataclass
class Context:
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
    """Shared plumbing: info, device/dtype, per-batch context, exit-path verification.

    A kind subclasses it and says with class attributes what it needs (the defaults: a transformers-native causal LM
    looped by its own config, no decoder).
    """

    #: ``module.Class`` of the checkpoint's own modeling code (``auto_map["AutoModelForCausalLM"]``) when the kind
    #: runs remote code (``trust_remote_code``, loaded through :mod:`~looptrace.models.adapters.compat`); None for a
    #: transformers-native architecture.
    remote_class: ClassVar[str | None] = None
    #: Remote code only: the input embedding an untied-in-4.x ``lm_head.weight`` is tied to (compat).
    tied_source: ClassVar[str | None] = None
    #: Remote code only: the compatibility patches its published code needs, in the order they are applied.
    patches: ClassVar[tuple[compat.Patch, ...]] = ()
    #: The kind loops a block of a standard decoder (``dump.adapter.block`` and ``n_loops`` required).
    needs_block: ClassVar[bool] = False
    #: ``model_type`` -> the transformers Auto class of a checkpoint that is not a plain causal LM (a wrapper).
    auto_classes: ClassVar[dict[str, str]] = {}
    #: Its loop-by-loop decoder class (``decoder(adapter, policy, **options)``), None when it has none.
    decoder: ClassVar[type | None] = None
    #: Why it has no decoder (one line, said when generation asks for one).
    no_decoder: ClassVar[str | None] = None

    @classmethod
    def config_overrides(cls, cfg: AdapterConfig) -> dict[str, Any]:
        """Attributes set on a remote-code model's config before it is built (none by default)."""
        return {}

    @property
    def kind(self) -> str:
        """``dump.adapter.kind``."""
        return self.cfg.kind

    def __init__(self, model: nn.Module, cfg: AdapterConfig, device: str = "cpu"):
        self.model = model
        self.cfg = cfg
        self._device = torch.device(device)
        self.dtype = next(model.parameters()).dtype
        self._ctx: Context | None = None
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

        with hooks(*(layer.register_forward_hook(record) for layer in self.loop_layers(0))):
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
        if self.remote_class is None:
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



__all__ = ["Call", "Context", "HFAdapter", "hidden_of", "hooks", "recording", "recording_calls", "replay", "stripped"]
