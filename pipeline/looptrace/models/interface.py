"""The model interface the ``dump`` stage uses: any looped model, ours or a real checkpoint's.

A :class:`LoopedModelAdapter` runs a batch of token sequences and returns the per-loop states; it
reads out any loop's state on request. The dump never touches a model's internals, so adapters
for real checkpoints (``looptrace.models.adapters``) plug in without changing the store or the stages.

Readout is per loop (``readout(hidden[:, :, t], t)``) rather than all loops at once so that a
large vocabulary never needs [batch, seq, loop, vocab] in memory.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import torch

from looptrace.models.looped import LoopedTransformer, load_checkpoint


@dataclass
class States:
    """Per-loop states of one batch.

    Attributes:
        hidden: [batch, seq, loop, d_model] h_1..h_T.
        hidden_init: [batch, seq, d_model] h_0.
        gate_logits: [batch, seq, loop] native halting-gate logits, or None.
    """

    hidden: torch.Tensor
    hidden_init: torch.Tensor
    gate_logits: torch.Tensor | None = None


@dataclass
class AdapterInfo:
    """What the store records about the model (group attributes).

    Attributes:
        name: run name (``<task>-<regime>`` for synthetic models).
        n_loops: T.
        d_model: state width.
        vocab_size: readout width.
        loop_group: [T] looped group of each loop.
        has_gate: whether :meth:`LoopedModelAdapter.states` returns gate logits.
        config: the model's configuration (JSON-able).
        checkpoint_hash: sha256 of the weights file(s).
        extra: anything else worth recording (task, regime, seeds, adapter kind...).
    """

    name: str
    n_loops: int
    d_model: int
    vocab_size: int
    loop_group: list[int]
    has_gate: bool
    config: dict
    checkpoint_hash: str
    extra: dict = field(default_factory=dict)


class LoopedModelAdapter(ABC):
    """A looped model seen through the dump's eyes."""

    info: AdapterInfo

    @abstractmethod
    def states(self, input_ids: torch.Tensor) -> States:
        """Run all loops on [batch, seq] token ids (no gradient)."""

    @abstractmethod
    def readout(self, h: torch.Tensor, loop: int) -> torch.Tensor:
        """Logits of an exit at loop ``loop`` (0-based): [batch, seq, d_model] -> [batch, seq, vocab].

        This is exactly what an early exit after that loop would compute (coda, norm, head).
        """

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def loop_step(self, h: torch.Tensor, h0: torch.Tensor, loop: int) -> torch.Tensor:
        """One loop of the model as a differentiable function: h_{t−1} -> h_t, [batch, seq, d_model] each.

        ``h0`` is the injection (``States.hidden_init``), ``loop`` the 0-based index of the loop (its group). The
        contraction statistics (``dump.contraction``, :mod:`looptrace.loopmap.contraction`) take JVPs through it;
        an adapter without one cannot compute them.
        """
        raise NotImplementedError(f"adapter '{self.info.name}' ({type(self).__name__}) exposes no loop step; "
                                  "dump.contraction needs one: set dump.contraction: null")

    def loop_step_refusal(self) -> str | None:
        """Why this model's :meth:`loop_step` cannot be differentiated although the adapter has one (one line), or
        None. E.g. Huginn with test-time noise: its loop map draws fresh noise every loop."""
        return None

    def loop_layers(self, group: int) -> list[torch.nn.Module]:
        """The layers of looped group ``group``'s block, in order (each runs once per loop of the group; its
        forward's output is that layer's state, ``dump.layers``, :mod:`looptrace.capture.layers`)."""
        raise NotImplementedError(f"adapter '{self.info.name}' ({type(self).__name__}) exposes no loop layers; "
                                  "dump.layers needs them: set dump.layers: []")


def file_sha256(path: Path | str, chunk: int = 1 << 20) -> str:
    """sha256 hex digest of a file (checkpoint hash recorded in store attributes)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


class LoopedTransformerAdapter(LoopedModelAdapter):
    """The interface for looptrace's own :class:`~looptrace.models.looped.LoopedTransformer`."""

    def __init__(self, model: LoopedTransformer, name: str, checkpoint_hash: str = "", extra: dict | None = None,
                 device: str = "cpu"):
        self.model = model.to(device).eval()
        self._device = torch.device(device)
        cfg = model.cfg
        self.info = AdapterInfo(
            name=name, n_loops=cfg.n_loops, d_model=cfg.d_model, vocab_size=cfg.vocab_size,
            loop_group=cfg.loop_group, has_gate=model.gate is not None, config=cfg.to_dict(),
            checkpoint_hash=checkpoint_hash, extra=extra or {},
        )

    @classmethod
    def from_checkpoint(cls, path: Path | str, device: str = "cpu", name: str | None = None
                        ) -> LoopedTransformerAdapter:
        """Load ``artifacts/train/<model>/model.pt`` (or an intermediate checkpoint).

        ``name``: the model looked for; a checkpoint recording another model's name is refused
        (:func:`~looptrace.models.looped.load_checkpoint`).
        """
        model, ckpt = load_checkpoint(path, name=name)
        extra = {k: ckpt[k] for k in ("task", "regime", "seed", "data_seeds", "step", "fraction") if k in ckpt}
        return cls(model, ckpt.get("name", Path(path).parent.name), file_sha256(path), extra, device)

    @property
    def device(self) -> torch.device:
        return self._device

    @torch.no_grad()
    def states(self, input_ids: torch.Tensor) -> States:
        out = self.model(input_ids.to(self._device), with_logits=False)
        return States(hidden=out.hidden, hidden_init=out.hidden_init, gate_logits=out.gate_logits)

    @torch.no_grad()
    def readout(self, h: torch.Tensor, loop: int) -> torch.Tensor:
        return self.model.readout(h)

    def loop_step(self, h: torch.Tensor, h0: torch.Tensor, loop: int) -> torch.Tensor:
        return self.model.step(h, h0, self.info.loop_group[loop])

    def loop_layers(self, group: int) -> list[torch.nn.Module]:
        return list(cast(torch.nn.ModuleList, self.model.blocks[group]))
