"""Multi-level n-gram table for ANPD-style drafting (pure Python; no torch).

What it stores
--------------
For every level ``n`` in ``min_n..max_n`` and every position of the ingested sequences, the
*context* (the previous ``n - 1`` token ids, as a tuple of ints) is mapped to the tokens that
followed it. All levels share one ordered dict keyed by the context tuple (a context's length
says its level), each value an entry ``[total, best, conts]``:

- ``conts``: ``{next_token: count << 40 | stamp}``. ``stamp`` is the table clock (one tick per
  ingested position) at the continuation's most recent occurrence. Packing both in one int makes
  the tie-break a plain integer comparison.
- ``total``: the sum of the counts (for the agreement ratio ``count(best) / total``).
- ``best``: the continuation with the largest packed value, maintained in O(1) per update.

Tie-break (deterministic): a higher count wins; between equal counts the continuation seen most
recently wins (stamps within one context are unique, so there are never exact ties).

Bugs of the reference snippet that cannot happen here: every position of a sequence is ingested
exactly once (callers pass ``start`` = how many positions were already ingested, so counts equal
a brute-force recount), and an n-gram is counted only when it lies entirely inside one sequence
(nothing spans the end of a prompt back to its start, or one request into the next).

Memory bound and eviction: at most ``max_entries`` contexts (all levels together). When an
insertion goes over the cap, the least-recently-*updated* context is evicted first (the dict is
kept in update order: an updated context moves to the end, eviction pops from the front).
Queries do not reorder it. Measured cost: about 520 bytes per context in CPython 3 (text with
few repeats, one continuation per context), so the default cap of 500,000 contexts bounds a
table to roughly 250 MB; a per-request table holds at most ``(max_n - min_n + 1) * len(sequence)``
contexts (about 8,000 for a 2,000-token request with N = 5), far below it.

Files (``save``/``load``): the format shared by every saved pool (:mod:`speculum.poolfile`:
a JSON header with ``model_key`` = the tokenizer/vocabulary identity the caller passes and the
levels, then a JSON body; written atomically). A file that is corrupt, truncated, of another
format or version, or built for another ``model_key`` is refused with
:class:`~speculum.errors.PoolFileError`. No pickle.

Micro-benchmark: ``python -m speculum.drafters.ngram_table`` prints µs per propose + update.
"""

from __future__ import annotations

import heapq
import os
import random
import time
from collections import OrderedDict
from collections.abc import Collection, Iterator, Sequence
from operator import itemgetter

from speculum.errors import InvalidInputError, PoolFileError
from speculum.poolfile import read_pool_file, write_pool_file

__all__ = ["DEFAULT_MAX_ENTRIES", "FORMAT_NAME", "FORMAT_VERSION", "NgramTable"]

DEFAULT_MAX_ENTRIES = 500_000  # contexts, all levels; ~520 B each
FORMAT_NAME = "speculum-ngram-pool"
FORMAT_VERSION = 1

_SHIFT = 40  # stamp bits in a packed continuation value
_STAMP_MASK = (1 << _SHIFT) - 1
_ONE = 1 << _SHIFT  # count increment in packed form
_NO_STOP: frozenset[int] = frozenset()


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class NgramTable:
    """Counts of next tokens after every context of ``min_n - 1 .. max_n - 1`` tokens.

    ``lookup`` implements the multi-level query (largest n first, first hit wins);
    ``draft_chain`` / ``draft_tree`` build drafts by querying autoregressively.
    """

    __slots__ = ("_ctx_lens", "_data", "clock", "evictions", "max_entries", "max_n", "min_n")

    def __init__(self, max_n: int = 5, min_n: int = 2, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        for name, value in (("max_n", max_n), ("min_n", min_n), ("max_entries", max_entries)):
            if not _is_int(value):
                raise InvalidInputError(f"{name} must be an int, got {value!r}")
        if min_n < 2 or max_n < min_n:
            raise InvalidInputError(f"need 2 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        if max_entries < 1:
            raise InvalidInputError(f"max_entries must be >= 1, got {max_entries}")
        self.max_n = max_n
        self.min_n = min_n
        self.max_entries = max_entries
        self.clock = 0  # one tick per ingested position; the source of recency stamps
        self.evictions = 0
        self._data: OrderedDict[tuple[int, ...], list] = OrderedDict()
        # context lengths, longest first (query order of the multi-level lookup)
        self._ctx_lens = tuple(range(max_n - 1, min_n - 2, -1))

    # ------------------------------------------------------------------ building

    def __len__(self) -> int:
        """Number of contexts held (all levels together)."""
        return len(self._data)

    def add_sequence(self, seq: Sequence[int], start: int = 0) -> None:
        """Count the n-grams of ``seq`` whose last token is at position ``start`` or later.

        Only n-grams lying entirely inside ``seq`` are counted. Call it once with the prompt
        (``start=0``), then with the grown sequence and ``start`` = the previous length: the
        result equals one call on the whole sequence, and nothing is ever counted twice.
        """
        data = self._data
        get = data.get
        move = data.move_to_end
        cap = self.max_entries
        ctx_lens = self._ctx_lens[::-1]  # shortest first, so `break` skips the too-long ones
        clock = self.clock
        n_seq = len(seq)
        for i in range(max(start, 0), n_seq):
            tok = seq[i]
            stamp = clock
            clock += 1
            if i == 0:
                continue
            for c in ctx_lens:
                if c > i:
                    break
                key = tuple(seq[i - c : i])
                entry = get(key)
                if entry is None:
                    data[key] = [1, tok, {tok: _ONE | stamp}]
                else:
                    move(key)
                    conts = entry[2]
                    v = ((conts.get(tok, 0) >> _SHIFT) + 1) << _SHIFT | stamp
                    conts[tok] = v
                    entry[0] += 1
                    if v > conts[entry[1]]:
                        entry[1] = tok
            if len(data) > cap:
                self._evict()
        if clock > _STAMP_MASK:  # ~1e12 tokens: practically unreachable
            raise InvalidInputError("n-gram table clock overflow; start a new table")
        self.clock = clock

    def _evict(self) -> None:
        data = self._data
        while len(data) > self.max_entries:
            data.popitem(last=False)
            self.evictions += 1

    # ------------------------------------------------------------------ querying

    def lookup(self, window: Sequence[int]) -> list | None:
        """Multi-level query: the entry of the longest context that is a suffix of ``window``.

        Returns ``[total, best, conts]`` (do not mutate) or None when no level matches.
        """
        data = self._data
        n_win = len(window)
        for c in self._ctx_lens:
            if c > n_win:
                continue
            entry = data.get(tuple(window[n_win - c :]))
            if entry is not None:
                return entry
        return None

    def predict(self, window: Sequence[int]) -> int | None:
        """The best next token after ``window`` (multi-level), or None."""
        entry = self.lookup(window)
        return None if entry is None else entry[1]

    def continuations(self, context: Sequence[int]) -> list[tuple[int, int]]:
        """``(token, count)`` after exactly this context, best first (the tie-break order)."""
        entry = self._data.get(tuple(context))
        if entry is None:
            return []
        items = sorted(entry[2].items(), key=itemgetter(1), reverse=True)
        return [(tok, v >> _SHIFT) for tok, v in items]

    def counts(self) -> dict[tuple[int, ...], int]:
        """Every stored n-gram ``context + (token,)`` with its count (for tests and tools)."""
        return {(*ctx, tok): v >> _SHIFT for ctx, e in self._data.items() for tok, v in e[2].items()}

    def contexts(self) -> Iterator[tuple[int, ...]]:
        """Contexts in eviction order (the first is evicted next)."""
        return iter(self._data)

    # ------------------------------------------------------------------ drafting

    def draft_chain(
        self,
        history: Sequence[int],
        k: int,
        *,
        min_count: int = 1,
        min_agreement: float = 0.0,
        stop_tokens: Collection[int] = _NO_STOP,
        agreement: list[float] | None = None,
    ) -> list[int]:
        """Up to ``k`` tokens continuing ``history`` by autoregressive multi-level queries.

        Stops early when no level matches, when the best continuation was seen fewer than
        ``min_count`` times or holds less than ``min_agreement`` of its context's count
        (weak evidence), or right after a token in ``stop_tokens`` (e.g. EOS). ``agreement``: a
        list that receives each drafted token's share of its context's count.
        """
        cap = self.max_n - 1
        window = list(history[-cap:])
        out: list[int] = []
        lookup = self.lookup
        while len(out) < k:
            entry = lookup(window)
            if entry is None:
                break
            total, best, conts = entry
            count = conts[best] >> _SHIFT
            if count < min_count or count < min_agreement * total:
                break
            out.append(best)
            if agreement is not None:
                agreement.append(count / total)
            if best in stop_tokens:
                break
            if len(window) >= cap:
                del window[0]
            window.append(best)
        return out

    def draft_tree(
        self,
        history: Sequence[int],
        max_depth: int,
        max_nodes: int,
        top_k: int,
        *,
        min_count: int = 1,
        min_agreement: float = 0.0,
        stop_tokens: Collection[int] = _NO_STOP,
        agreement: list[float] | None = None,
    ) -> tuple[list[int], list[int], int]:
        """A token tree below ``history[-1]``: ``(tokens, parents, depth)``.

        Each node's children are the ``top_k`` best continuations of its path (distinct tokens,
        tie-break order), each kept only if it passes ``min_count`` / ``min_agreement``. Nodes
        are added best-first by the path's estimated probability (the product of
        ``count / total`` along it; ties by insertion order, so deterministic) until
        ``max_nodes`` nodes are placed; no node is deeper than ``max_depth``. Parents precede
        their children; ``parents[i] == -1`` marks a child of the root. ``depth`` is the
        deepest level reached. ``agreement``: a list that receives each node's share of its
        context's count.
        """
        tokens: list[int] = []
        parents: list[int] = []
        if max_depth < 1 or max_nodes < 1:
            return tokens, parents, 0
        cap = self.max_n - 1
        heap: list[tuple[float, int, int, int, tuple[int, ...], int]] = []
        counter = 0
        deepest = 0
        lookup = self.lookup

        def expand(window: tuple[int, ...], parent: int, depth: int, score: float) -> None:
            nonlocal counter
            entry = lookup(window)
            if entry is None:
                return
            total, best, conts = entry
            if top_k == 1 or len(conts) == 1:
                items = [(best, conts[best])]
            else:
                items = heapq.nlargest(top_k, conts.items(), key=itemgetter(1))
            for tok, v in items:
                count = v >> _SHIFT
                if count < min_count or count < min_agreement * total:
                    break  # items are best first: the rest are weaker still
                heapq.heappush(heap, (-score * count / total, counter, parent, tok, window, depth + 1, count / total))
                counter += 1

        expand(tuple(history[-cap:]), -1, 0, 1.0)
        while heap and len(tokens) < max_nodes:
            neg_score, _, parent, tok, window, depth, share = heapq.heappop(heap)
            index = len(tokens)
            tokens.append(tok)
            parents.append(parent)
            if agreement is not None:
                agreement.append(share)
            if depth > deepest:
                deepest = depth
            if depth < max_depth and tok not in stop_tokens:
                expand((*window, tok)[-cap:], index, depth, -neg_score)
        return tokens, parents, deepest

    # ------------------------------------------------------------------ files

    def save(self, path: str | os.PathLike[str], *, model_key: str = "") -> None:
        """Write the table to ``path`` atomically (format: :mod:`speculum.poolfile`).

        On any failure an existing file at ``path`` is untouched.
        """
        entries = [
            [list(ctx), [[tok, v >> _SHIFT, v & _STAMP_MASK] for tok, v in e[2].items()]]
            for ctx, e in self._data.items()
        ]
        write_pool_file(
            path,
            kind=FORMAT_NAME,
            version=FORMAT_VERSION,
            model_key=model_key,
            settings={"min_n": self.min_n, "max_n": self.max_n, "contexts": len(entries)},
            body={"clock": self.clock, "entries": entries},
            what="n-gram pool",
        )

    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str],
        *,
        model_key: str = "",
        max_entries: int = DEFAULT_MAX_ENTRIES,
    ) -> NgramTable:
        """Read a table written by :meth:`save`; refuse anything else with PoolFileError.

        ``model_key`` must equal the one the file was saved with. If the file holds more than
        ``max_entries`` contexts, the least-recently-updated ones are dropped.
        """
        header, payload = read_pool_file(
            path, kind=FORMAT_NAME, version=FORMAT_VERSION, model_key=model_key, what="n-gram pool"
        )
        try:
            table = cls(max_n=header.get("max_n"), min_n=header.get("min_n"), max_entries=max_entries)
            table._fill(payload)
        except (InvalidInputError, ValueError, TypeError, KeyError, AttributeError) as exc:
            raise PoolFileError(f"{str(path)!r} is corrupt: {exc}") from exc
        return table

    def _fill(self, payload: dict) -> None:
        clock = payload["clock"]
        if not _is_int(clock) or not 0 <= clock <= _STAMP_MASK:
            raise ValueError("bad clock")
        lo, hi = self.min_n - 1, self.max_n - 1
        data = self._data
        for ctx_list, cont_list in payload["entries"]:
            ctx = tuple(ctx_list)
            if not lo <= len(ctx) <= hi or not all(_is_int(t) and t >= 0 for t in ctx):
                raise ValueError(f"bad context {ctx_list!r}")
            if ctx in data:
                raise ValueError(f"duplicate context {ctx_list!r}")
            conts: dict[int, int] = {}
            total = 0
            for tok, count, stamp in cont_list:
                if not (_is_int(tok) and tok >= 0 and _is_int(count) and count >= 1):
                    raise ValueError(f"bad continuation {[tok, count, stamp]!r}")
                if not (_is_int(stamp) and 0 <= stamp < clock) or tok in conts:
                    raise ValueError(f"bad continuation {[tok, count, stamp]!r}")
                conts[tok] = count << _SHIFT | stamp
                total += count
            if not conts:
                raise ValueError(f"context {ctx_list!r} has no continuation")
            best = max(conts, key=conts.__getitem__)
            data[ctx] = [total, best, conts]
        self.clock = clock
        self._evict()


def _benchmark(n_tokens: int = 2000, vocab: int = 32000, seed: int = 0) -> None:
    """Simulate drafting on a sequence with copy-able spans; print µs per propose + update."""
    rng = random.Random(seed)
    prompt = [rng.randrange(vocab) for _ in range(n_tokens // 2)]
    seq = list(prompt)
    while len(seq) < n_tokens + 64:  # half new text, half copies of prompt spans
        if rng.random() < 0.5:
            a = rng.randrange(len(prompt) - 40)
            seq.extend(prompt[a : a + rng.randrange(5, 40)])
        else:
            seq.extend(rng.randrange(vocab) for _ in range(rng.randrange(1, 10)))
    for mode in ("chain", "tree"):
        table = NgramTable(max_n=5)
        table.add_sequence(prompt)
        committed = list(prompt)
        pos, steps, drafted, accepted = len(prompt), 0, 0, 0
        t0 = time.perf_counter()
        while pos < n_tokens:
            if mode == "chain":
                draft = table.draft_chain(committed, 7, min_agreement=0.1)
                parents = list(range(-1, len(draft) - 1))
            else:
                draft, parents, _ = table.draft_tree(committed, 7, 16, 3, min_agreement=0.1)
            n_acc, node = 0, -1  # greedy walk: descend to the child holding the true token
            for i, (tok, parent) in enumerate(zip(draft, parents, strict=True)):
                if parent == node and tok == seq[pos + n_acc]:
                    node, n_acc = i, n_acc + 1
            drafted += len(draft)
            accepted += n_acc
            committed.extend(seq[pos : pos + n_acc + 1])
            table.add_sequence(committed, start=pos)
            pos += n_acc + 1
            steps += 1
        dt = time.perf_counter() - t0
        print(
            f"{mode}: {1e6 * dt / steps:.1f} us per propose+update over {steps} steps "
            f"({n_tokens} tokens, N=5, K=7; drafted {drafted}, accepted {accepted}; "
            f"{len(table)} contexts)"
        )


if __name__ == "__main__":
    _benchmark()
