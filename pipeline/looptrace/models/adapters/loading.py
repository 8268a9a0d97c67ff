"""The ``dump.adapter`` section and the loader: a local checkpoint directory → its kind's adapter.

:class:`AdapterConfig` is checked against the kind's class (:data:`~looptrace.models.adapters.kinds.KINDS`: whether it
loops a block, whether it runs remote code); :func:`load_adapter` loads the checkpoint (local files only; remote code
through :mod:`looptrace.models.adapters.compat`) and builds the kind's adapter on it. Nothing here names a kind: what
differs between kinds is in each kind's module (docs/adapters.md, "A new adapter").
"""

from __future__ import annotations

import contextlib
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from looptrace.config import CheckpointLoadError, ConfigError, from_dict
from looptrace.models.adapters import compat
from looptrace.models.adapters.kinds import KINDS
from looptrace.models.interface import LoopedModelAdapter, file_sha256

MODEL_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


@dataclass(frozen=True)
class AdapterConfig:
    """``dump.adapter`` section: which checkpoint to run and how to loop it.

    Attributes:
        kind: ``dory`` | ``inkling2loop`` | ``retrofit`` | ``ouro`` | ``huginn`` | ``nanbeige`` (:data:`~looptrace.models.adapters.
            kinds.KINDS`, with any installed ``looptrace.adapters`` entry point).
        path: local checkpoint directory (config.json + weights; the tokenizer for text dumps).
        name: run name ``<model>`` of the artifacts (default: the directory name).
        dtype: weights/compute dtype: ``float32`` | ``bfloat16`` | ``float16`` | ``auto`` (the checkpoint's).
        n_loops: T. Native kinds: overrides the checkpoint's loop count (dory ``n_recurrent_loops``,
            inkling2loop ``loop_num_passes``, ouro ``total_ut_steps``, huginn ``mean_recurrence``, nanbeige
            ``num_loops``); null keeps
            it. ``retrofit``: passes through the block (required).
        block: ``retrofit`` only: ``[start, end)`` layer indices of the looped block (0 < start < end ≤ L
            is not required: start may be 0, end may be L).
        trust_remote_code: run the checkpoint directory's own modeling code (required for ouro / huginn / nanbeige;
            the code is read from the local directory only).
        attn_implementation: transformers attention backend (``eager``, ``sdpa``...); null = the default.
        verify_exit: check the exit path against the model's own forward logits on the first batch.
        seed: base seed of Huginn's random streams (initial state, test-time noise): each sequence draws from its
            own stream, :func:`~looptrace.models.adapters.huginn.sequence_seed` (seed, its token ids); other kinds
            are deterministic.
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
        if self.kind not in KINDS:
            raise ConfigError(f"dump.adapter.kind must be one of {', '.join(KINDS.names())}, got {self.kind!r}")
        entry = KINDS[self.kind]
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
            blocks = [k for k in KINDS.names() if KINDS[k].needs_block]
            raise ConfigError(f"dump.adapter.block is only for kind {', '.join(blocks)} (kind is {self.kind})")
        if entry.remote_class is not None and not self.trust_remote_code:
            raise ConfigError(f"dump.adapter.trust_remote_code: kind {self.kind} runs the checkpoint's own "
                              "modeling code; set it to true (the code is read from the local directory only)")

    @property
    def run_name(self) -> str:
        return self.name or Path(self.path).resolve().name


def checkpoint_hash(path: Path | str) -> str:
    """sha256 over the weight files of a checkpoint directory (name + content hash of each, sorted)."""
    path = Path(path)
    files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in WEIGHT_SUFFIXES)
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + b"\0" + file_sha256(f).encode() + b"\n")
    return h.hexdigest()


def load_hf_model(cfg: AdapterConfig, device: str = "cpu") -> nn.Module:
    """Load the causal LM of ``cfg.path`` (local files only) in ``cfg.dtype``, in eval mode on ``device``.

    Checkpoints of a remote-code kind (``ouro`` / ``huginn`` / ``nanbeige``) carrying their code load through the compatibility
    shim (:mod:`looptrace.models.adapters.compat`); the patches in force are kept in
    ``model._looptrace_compat_patches``.

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
    kind = KINDS[cfg.kind]
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # the dump has its own progress bar; keep stage output to one line
    try:
        if kind.remote_class is not None and compat.read_auto_map(path):
            model, patches = compat.load_remote_model(path, cfg.kind, dtype, cfg.attn_implementation,
                                                      kind.config_overrides(cfg))
            model._looptrace_compat_patches = patches
        else:
            model = _load_auto(cfg, path, dtype, kind.auto_classes)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    return model.to(device).eval()


def _load_auto(cfg: AdapterConfig, path: Path, dtype, auto_classes: dict[str, str]) -> nn.Module:
    """transformers' Auto classes (native architectures, or remote code the shim does not know); ``auto_classes``:
    model_type -> the Auto class of a checkpoint that is not a plain causal LM (a multimodal wrapper)."""
    # lazy: transformers: a multi-second import, only once a checkpoint is loaded
    import transformers

    kw: dict[str, Any] = {"local_files_only": True, "trust_remote_code": cfg.trust_remote_code, "dtype": dtype}
    if cfg.attn_implementation:
        kw["attn_implementation"] = cfg.attn_implementation
    try:
        hf_cfg = transformers.AutoConfig.from_pretrained(path, local_files_only=True,
                                                         trust_remote_code=cfg.trust_remote_code)
        auto: type[Any] = getattr(transformers, auto_classes.get(getattr(hf_cfg, "model_type", None) or "",
                                                                 "AutoModelForCausalLM"))
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
    kind = KINDS[spec.kind]
    with compat.quiet_transformers() if kind.remote_class is not None else contextlib.nullcontext():
        return kind(load_hf_model(spec, device), spec, device)


__all__ = ["MODEL_DTYPES", "AdapterConfig", "CheckpointLoadError", "checkpoint_hash", "load_adapter", "load_hf_model"]
