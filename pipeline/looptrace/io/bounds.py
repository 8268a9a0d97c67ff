"""Bounds derived from the data, and known-slow settings.

A value can be legal on its own and absurd for the data it meets: a block of 1 token read from a store chunked by
4096 decodes every chunk 4096 times. Such values are refused in one line naming the key and the fix
(:func:`check_block_tokens`); settings that are merely slow print one ``warning:`` line, once per process, with
the expected cost (:func:`warn_once`).
"""

from __future__ import annotations

import math
import sys

from looptrace.config import ConfigError

#: A block may be at most this many times smaller than a store chunk (each chunk decoded at most this often).
MAX_CHUNK_REREADS = 16

_WARNED: set[str] = set()


def warn_once(key: str, message: str) -> bool:
    """Print ``warning: <message>`` to stderr the first time ``key`` is warned about in this process."""
    if key in _WARNED:
        return False
    _WARNED.add(key)
    print(f"warning: {message}", file=sys.stderr, flush=True)
    return True


def check_block_tokens(block_tokens: int | None, chunk_tokens: int, key: str, label: str) -> None:
    """Refuse a block far smaller than the store's chunk; warn once about one smaller than the chunk.

    Args:
        block_tokens: the params value (None = the chunk size: always fine).
        chunk_tokens: tokens per chunk of the store read.
        key: the params key (``geometry.block_tokens``).
        label: the store, for the message.

    Raises:
        ConfigError: ``block_tokens`` < ``chunk_tokens / MAX_CHUNK_REREADS``.
    """
    if block_tokens is None or block_tokens >= chunk_tokens:
        return
    rereads = math.ceil(chunk_tokens / block_tokens)
    floor = math.ceil(chunk_tokens / MAX_CHUNK_REREADS)
    if rereads > MAX_CHUNK_REREADS:
        raise ConfigError(f"{key} = {block_tokens} is far below the chunk of store {label} ({chunk_tokens} tokens): "
                          f"every chunk would be decoded {rereads} times; set {key} ≥ {floor}, or null (the chunk "
                          "size)")
    warn_once(key, f"{key} = {block_tokens} is below the chunk of store {label} ({chunk_tokens} tokens): every "
                   f"chunk is decoded {rereads} times (about {rereads}x the read time of {key}: null)")


__all__ = ["MAX_CHUNK_REREADS", "check_block_tokens", "warn_once"]
