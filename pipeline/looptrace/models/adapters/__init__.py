"""Adapters that run real looped checkpoints through the model interface of ``looptrace.models.interface``."""
