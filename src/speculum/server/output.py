"""The output text of one request as its tokens arrive, cut at the first of its stop strings."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Piece:
    """The text of one output token and where the token came from."""

    text: str
    source: str  # "draft": an accepted draft token; "target": the target's own token (bonus or correction)
    token: bool = True  # False for text that no token of its own carries (a decoding tail)


class Output:
    """The output text of one request as its tokens arrive, cut at the first stop string.

    Text is handed out (``take``) only where no stop string can still begin: an end of the text
    that a stop string starts with waits for the next tokens, so a client never receives text
    that a stop string later takes back. Each step costs what its new text costs: every stop string
    is followed by a matcher that reads each character once, never the whole output again.
    """

    def __init__(self, stop: list[str]):
        self.stop = stop
        self._matchers = [StopMatcher(s) for s in stop]
        self.pieces: list[Piece] = []
        self.length = 0  # characters of output text
        self.shown = 0  # pieces handed out so far
        self.shown_chars = 0
        self.stopped = False  # a stop string was found
        self.num_tokens = 0  # output tokens (up to the one that completed the stop string)

    @property
    def text(self) -> str:
        return "".join(p.text for p in self.pieces)

    def add(self, pieces: list[Piece]) -> None:
        if self.stopped:
            return
        new = "".join(p.text for p in pieces)
        begin = self.length
        self.pieces.extend(pieces)
        self.length += len(new)
        self.num_tokens += sum(p.token for p in pieces)
        hits = []  # (start, stop string) of each stop string's first occurrence
        for matcher in self._matchers:
            end = matcher.feed(new)
            if end >= 0:
                hits.append((begin + end - len(matcher.stop), matcher.stop))
        if hits:
            self._cut(*min(hits))

    def _cut(self, at: int, stop: str) -> None:
        """Keep the text before the stop string and the tokens up to the one that completed it."""
        end, pos, kept, tokens = at + len(stop), 0, [], 0
        for piece in self.pieces:
            if pos >= end:
                break
            kept.append(Piece(piece.text[: max(0, at - pos)], piece.source, piece.token))
            tokens += piece.token
            pos += len(piece.text)
        self.pieces, self.length, self.num_tokens, self.stopped = kept, at, tokens, True

    def _pending_stop(self) -> int:
        """Length of the longest end of the text that a stop string begins with (it may still complete)."""
        return max((m.matched for m in self._matchers), default=0)

    def take(self, final: bool = False) -> list[Piece]:
        """The pieces that may be shown now (all of them once the output is complete)."""
        limit = self.length if final or self.stopped else self.length - self._pending_stop()
        out = []
        while self.shown < len(self.pieces) and self.shown_chars + len(self.pieces[self.shown].text) <= limit:
            out.append(self.pieces[self.shown])
            self.shown_chars += len(self.pieces[self.shown].text)
            self.shown += 1
        return out


class StopMatcher:
    """Finds one stop string in text fed piece by piece (Knuth-Morris-Pratt): ``matched`` is the
    longest beginning of the stop string that the text so far ends with."""

    def __init__(self, stop: str):
        self.stop = stop
        # fallback[i]: the longest proper beginning of stop[: i + 1] that also ends it
        self.fallback = [0] * len(stop)
        k = 0
        for i in range(1, len(stop)):
            while k and stop[i] != stop[k]:
                k = self.fallback[k - 1]
            if stop[i] == stop[k]:
                k += 1
            self.fallback[i] = k
        self.matched = 0

    def feed(self, text: str) -> int:
        """Read ``text``; the index in it just past the first complete stop string, or -1."""
        stop, fallback, k = self.stop, self.fallback, self.matched
        for i, char in enumerate(text):
            while k and char != stop[k]:
                k = fallback[k - 1]
            if char == stop[k]:
                k += 1
                if k == len(stop):
                    self.matched = 0  # the output ends here
                    return i + 1
        self.matched = k
        return -1
