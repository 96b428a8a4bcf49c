"""A byte-level tokenizer: the UTF-8 bytes of a text are its token ids (vocab 256).

It is what the reference model (vocab 256) and ``tiered-kv warm-start`` use for prompts
given as text. No merges and no special tokens: every text has exactly one encoding, so
the same text always gives the same prefix hashes, in every process::

    >>> encode("KV")
    [75, 86]
    >>> decode([75, 86])
    'KV'
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable

__all__ = ["VOCAB_SIZE", "decode", "encode"]

#: Token ids are byte values, ``[0, 256)``.
VOCAB_SIZE = 256


def encode(text: str) -> list[int]:
    """The UTF-8 bytes of ``text`` as token ids in ``[0, 256)``."""
    if not isinstance(text, str):
        raise TypeError(f"text: expected a str, got {type(text).__name__}")
    return list(text.encode("utf-8"))


def decode(token_ids: Iterable[int], *, errors: str = "strict") -> str:
    """The text whose UTF-8 bytes are ``token_ids``.

    ``errors`` is the codec's error handler: ``"strict"`` (default) raises
    ``UnicodeDecodeError`` on a byte sequence that is not UTF-8 (e.g. a multi-byte
    character cut at a block boundary); ``"replace"`` shows it as U+FFFD.
    """
    ids = list(token_ids)
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise TypeError(f"token_ids[{i}]: expected an int, got {type(t).__name__}")
        if not 0 <= int(t) < VOCAB_SIZE:
            raise ValueError(f"token_ids[{i}]: expected a byte-level token id in [0, {VOCAB_SIZE}), got {t}")
    return bytes(int(t) for t in ids).decode("utf-8", errors=errors)
