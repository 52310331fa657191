"""The phrase pool of lookahead decoding and Ouroboros: key token -> up to G phrases that followed it.

As in LADE's ``token_map`` and Ouroboros' ``CacheEngine``: each key (one token id) holds an
ordered list of at most ``capacity`` phrases (tuples of token ids), oldest first. Adding a phrase
that is already there moves it to the newest end (refresh); adding to a full list drops the
oldest. Lookups return the newest first. Unlike the reference code, the number of keys is bounded
too (``max_keys``; the least recently updated key goes first), so a pool shared by a long-running
server cannot grow without limit.

Files: :meth:`PhrasePool.save` / :meth:`PhrasePool.load` use the format shared by every saved
pool (:mod:`speculum.poolfile`: atomic write, checksum, refused under another ``model_key``).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from speculum.errors import InvalidInputError, PoolFileError
from speculum.poolfile import read_pool_file, write_pool_file

__all__ = ["FORMAT_NAME", "FORMAT_VERSION", "PhrasePool"]

FORMAT_NAME = "speculum-phrase-pool"
FORMAT_VERSION = 1
DEFAULT_MAX_KEYS = 200_000


def _is_token(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


class PhrasePool:
    """key token -> up to ``capacity`` phrases, per-key LRU; at most ``max_keys`` keys."""

    def __init__(self, capacity: int = 7, max_keys: int = DEFAULT_MAX_KEYS) -> None:
        for name, value in (("capacity", capacity), ("max_keys", max_keys)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidInputError(f"phrase pool: {name} must be an integer >= 1, got {value!r}")
        self.capacity = capacity
        self.max_keys = max_keys
        self._data: OrderedDict[int, list[tuple[int, ...]]] = OrderedDict()

    def __len__(self) -> int:
        """Number of phrases (all keys)."""
        return sum(len(v) for v in self._data.values())

    def __contains__(self, key: int) -> bool:
        return key in self._data

    def keys(self) -> list[int]:
        return list(self._data)

    def add(self, key: int, phrase: Sequence[int]) -> None:
        """Insert ``phrase`` under ``key`` as the newest (moved there if already present)."""
        phrase = tuple(int(t) for t in phrase)
        if not phrase:
            return
        phrases = self._data.get(key)
        if phrases is None:
            phrases = self._data[key] = []
            if len(self._data) > self.max_keys:
                self._data.popitem(last=False)
        else:
            self._data.move_to_end(key)
            if phrase in phrases:
                phrases.remove(phrase)
        phrases.append(phrase)
        if len(phrases) > self.capacity:
            del phrases[0]

    def replace(self, key: int, old: Sequence[int], new: Sequence[int]) -> None:
        """Put ``new`` where ``old`` was under ``key`` (Ouroboros: a tried phrase replaced by the
        target's corrected version); ``new`` is simply added when ``old`` is gone."""
        phrases = self._data.get(key)
        old, new = tuple(old), tuple(int(t) for t in new)
        if phrases and old in phrases and new not in phrases and new:
            phrases[phrases.index(old)] = new
            self._data.move_to_end(key)
        else:
            if phrases and old in phrases:
                phrases.remove(old)
            self.add(key, new)

    def add_all(self, items: Iterable[tuple[int, Sequence[int]]]) -> None:
        for key, phrase in items:
            self.add(key, phrase)

    def get(self, key: int, limit: int | None = None) -> list[tuple[int, ...]]:
        """The phrases under ``key``, newest first (at most ``limit``)."""
        phrases = self._data.get(key)
        if not phrases:
            return []
        newest_first = phrases[::-1]
        return newest_first if limit is None else newest_first[:limit]

    def add_ngrams(self, tokens: Sequence[int], phrase_length: int, start: int = 0) -> None:
        """Every ``(token, next phrase_length tokens)`` of ``tokens`` whose key is at ``start`` or later
        (LADE's pool-from-prompt; phrases lie entirely inside ``tokens``)."""
        for i in range(max(start, 0), len(tokens) - phrase_length):
            self.add(tokens[i], tokens[i + 1 : i + 1 + phrase_length])

    # ------------------------------------------------------------------ files

    def save(self, path: str | os.PathLike[str], *, model_key: str = "") -> None:
        """Write the pool atomically; an existing file is untouched on failure."""
        entries = [[key, [list(p) for p in phrases]] for key, phrases in self._data.items()]
        write_pool_file(
            path,
            kind=FORMAT_NAME,
            version=FORMAT_VERSION,
            model_key=model_key,
            settings={"capacity": self.capacity, "keys": len(entries)},
            body={"entries": entries},
            what="phrase pool",
        )

    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str],
        *,
        model_key: str = "",
        capacity: int | None = None,
        max_keys: int = DEFAULT_MAX_KEYS,
    ) -> PhrasePool:
        """Read a pool written by :meth:`save` (PoolFileError for anything else).

        ``capacity`` (default: the file's) may be smaller than the file's: the oldest phrases of
        each key are dropped; past ``max_keys`` keys, the least recently updated go.
        """
        header, payload = read_pool_file(
            path, kind=FORMAT_NAME, version=FORMAT_VERSION, model_key=model_key, what="phrase pool"
        )
        try:
            pool = cls(capacity if capacity is not None else header.get("capacity"), max_keys)
            seen: set[int] = set()
            for key, phrases in payload["entries"]:
                if not _is_token(key) or key in seen or not isinstance(phrases, list) or not phrases:
                    raise ValueError(f"bad key {key!r}")
                seen.add(key)
                for phrase in phrases:
                    if not isinstance(phrase, list) or not phrase or not all(_is_token(t) for t in phrase):
                        raise ValueError(f"bad phrase {phrase!r} under key {key}")
                    pool.add(key, phrase)
        except (InvalidInputError, ValueError, TypeError, KeyError) as exc:
            raise PoolFileError(f"{str(path)!r} is corrupt: {exc}") from exc
        return pool
