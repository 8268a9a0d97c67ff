"""The splits' scored-prefix overlap (SPEC §6), checked before a dump writes anything: a test store whose
tokens' contexts are also scored in fit or val is refused unless ``dump.allow_prefix_overlap``, and every store
records the measured overlap (:func:`overlap_attrs`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from looptrace.config import InputError


class PrefixOverlapError(InputError):
    """The test split shares scored contexts with fit or val and ``dump.allow_prefix_overlap`` is false."""


def check_prefix_overlap(report: Mapping[str, Any], allow: bool, name: str) -> None:
    """Refuse a test store that shares a scored prefix with fit or val (SPEC §6), unless ``allow``.

    Args:
        report: :func:`looptrace.tasks.base.shared_prefixes` of the splits being dumped together.
        allow: ``dump.allow_prefix_overlap``.
        name: the model / run name (for the message).

    Raises:
        PrefixOverlapError: one line naming the split, the count and the parameter that overrides it.
    """
    shared = report.get("shared_with", {}).get("test", {})
    n = sum(int(v) for k, v in shared.items() if k in ("fit", "val"))
    if n and not allow:
        total = int(report.get("n_scored", {}).get("test", 0))
        where = ", ".join(f"{k} {int(v)}" for k, v in shared.items() if k in ("fit", "val"))
        raise PrefixOverlapError(
            f"dump of '{name}': split 'test' has {n} of {total} scored tokens whose prefix is also scored in fit or "
            f"val ({where}); the test store would repeat their trajectories; set dump.allow_prefix_overlap: true "
            "to write it anyway")


def check_training_split(spec: Mapping[str, Any] | None, allow: bool, name: str) -> None:
    """Refuse a checkpoint whose training data was split by rows (its task spec has no ``split_rule: context``).

    Such a model was trained on every prefix of its fit rows, most short ones also test's (SPEC §6), so its test
    trajectories are not held out whatever the dump's own splits are. Checkpoints written before token-level
    splits have no ``split_rule`` and count as ``sequence``. No task spec (an external model): nothing to check.

    Raises:
        PrefixOverlapError: one line naming the checkpoint, the rule and ``dump.allow_prefix_overlap``.
    """
    if not isinstance(spec, Mapping):
        return
    rule = spec.get("split_rule", "sequence")
    if rule != "context" and not allow:
        raise PrefixOverlapError(
            f"dump of '{name}': the checkpoint was trained on split_rule '{rule}' data (rows split by content, "
            "short prefixes shared with test); retrain it, or set dump.allow_prefix_overlap: true to dump it anyway")


def overlap_line(report: Mapping[str, Any]) -> str:
    """One line for the log: scored tokens of test and val whose context is scored in another split."""
    n, sh = report["n_scored"], report["shared_with"]
    parts = []
    if "test" in n:
        k = sum(v for o, v in sh["test"].items() if o in ("fit", "val"))
        parts.append(f"test tokens with a prefix scored in fit/val: {k} of {n['test']}")
    if "val" in n:
        parts.append(f"val tokens with a prefix scored in fit: {sh['val'].get('fit', 0)} of {n['val']}")
    return "; ".join(parts)

def overlap_attrs(report: Mapping[str, Any], split: str, allowed: bool) -> dict[str, Any]:
    """The ``prefix_overlap`` store attribute: this split's shared-token counts plus the whole report.

    ``shared_with[other]`` = this split's scored tokens whose exact context is scored in ``other``; ``splits`` = the
    splits measured together (those dumped in one run); ``allowed`` = ``dump.allow_prefix_overlap``.
    """
    return {"n_scored": int(report["n_scored"][split]), "shared_with": dict(report["shared_with"][split]),
            "shared_any": int(report["shared_any"][split]), "splits": list(report["n_scored"]),
            "report": report, "allowed": bool(allowed)}
