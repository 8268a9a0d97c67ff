"""Models: looptrace's own looped transformer, depth-supervision regimes, training, the model interface
the capture uses, and adapters for real checkpoints.

:func:`check_device` lives here, not in :mod:`looptrace.config`, because it needs torch: only the stages that run
a model (train, dump, dynamics, latency, generate) import this package, so the offline stages stay torch-free.
"""

from __future__ import annotations

from looptrace.config import ConfigError


def check_device(device: str, key: str = "base.device") -> str:
    """``device`` if torch can use it on this machine, else a one-line :class:`ConfigError` (imports torch only for a
    non-CPU device)."""
    if device == "cpu":
        return device
    # lazy: torch: only for a non-CPU device; importing looptrace.models (gates import models.regimes lazily) stays light
    import torch

    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(f"{key} = {device!r}: this machine has no usable CUDA device (torch "
                              f"{torch.__version__}, CUDA {torch.version.cuda or 'not compiled in'}); set {key}: cpu")
        idx = int(device.partition(":")[2] or 0)
        if idx >= torch.cuda.device_count():
            raise ConfigError(f"{key} = {device!r}: only {torch.cuda.device_count()} CUDA device(s) are visible "
                              f"(cuda:0..cuda:{torch.cuda.device_count() - 1}); set {key} to one of them")
    elif device == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise ConfigError(f"{key} = 'mps': MPS is not available on this machine; set {key}: cpu")
    return device
