"""The dump of a checkpoint on a text corpus (``dump.adapter`` + ``dump.text``): the corpus's splits through
:func:`looptrace.capture.dump.dump_split`, as :func:`looptrace.capture.dump.dump_model` does for a task."""

from __future__ import annotations

from pathlib import Path

from looptrace.capture.dump import _say, dump_split, output_root
from looptrace.capture.prefix_overlap import check_prefix_overlap, overlap_attrs, overlap_line
from looptrace.config import ConfigError
from looptrace.io.store.location import (
    join_store,
)
from looptrace.tasks import IGNORE
from looptrace.tasks.base import prefix_keys, shared_prefixes
from looptrace.tasks.text import loss_bins_finalizer, text_attrs, text_dataset


def dump_text_model(adapter, cfg, out_dir: Path | str, base=None, progress: bool = True,
                    shard: tuple[int, int] = (0, 1)) -> dict:
    """Dump every split of ``cfg.sequences`` of a checkpoint on the corpus ``cfg.text``: ``<out_dir>/<split>.zarr``.

    The batches come from :func:`looptrace.tasks.text.text_dataset` (content-disjoint document splits, packed,
    ``difficulty`` from fit-split token frequencies); with ``text.difficulty: final_loss`` it is rewritten before
    completion by :func:`looptrace.tasks.text.loss_bins_finalizer`.

    Args:
        adapter: the checkpoint's :class:`~looptrace.models.interface.LoopedModelAdapter` (``looptrace.models.adapters``).
        cfg: the ``dump`` section (:class:`looptrace.capture.dump.DumpConfig`) with ``text`` set; the tokenizer
            defaults to ``cfg.adapter.path``.
        out_dir: ``artifacts/dump/<model>`` (or a URL).
        base: the ``base`` section (its seed is recorded).
        shard: ``(i, N)``: this process's shard of every split (:func:`dump_split`).

    Returns:
        split -> completed store (``difficulty_*`` attributes: name, definition, edges).
    """
    if cfg.text is None:
        raise ConfigError("dump.text is required to dump a checkpoint on a corpus")
    tok_path = cfg.text.tokenizer or (cfg.adapter.path if cfg.adapter is not None else None)
    if tok_path is None:
        raise ConfigError("dump.text.tokenizer: no tokenizer directory (and no dump.adapter.path)")
    out_dir = output_root(out_dir)
    trust = bool(cfg.adapter is not None and cfg.adapter.trust_remote_code)
    data, diff_attrs = text_dataset(cfg.text, cfg.sequences, tok_path, adapter.info.vocab_size, trust)
    overlap = shared_prefixes({s: prefix_keys(b.tokens)[b.targets != IGNORE] for s, b in data.items()})
    check_prefix_overlap(overlap, cfg.allow_prefix_overlap, adapter.info.name)
    _say(f"{adapter.info.name}: {overlap_line(overlap)}")
    stores = {}
    for split, batch in data.items():
        attrs = {**text_attrs(cfg.text, split), **diff_attrs, "base_seed": None if base is None else base.seed,
                 "prefix_overlap": overlap_attrs(overlap, split, cfg.allow_prefix_overlap)}
        stores[split] = dump_split(adapter, batch, join_store(out_dir, f"{split}.zarr"), cfg, attrs, progress,
                                   finalize=(loss_bins_finalizer(cfg.text.difficulty_bins)
                                             if cfg.text.difficulty == "final_loss" else None), shard=shard)
    return stores
