"""Per-request state for a vLLM proposer, found again by content.

vLLM hands a ``custom_class`` proposer batch slots, not requests: a slot is reused when a request
ends, and requests move between slots when the batch is condensed. So a request's state (its n-gram
table, what was last proposed for it) is keyed by what the row holds: its first tokens, checked
against the tokens it ended with at the last step. A state that no row claims for a while is
evicted, least recently used first. A wrong match can only cost speed, never output: vLLM verifies
every proposed token against the target.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

HEAD = 32  # tokens of the prompt a state is looked up by (all of a shorter one)
TAIL = 16  # tokens before the last step's end a state checks before it is claimed


@dataclass
class RequestState:
    """What a proposer keeps for one request between ``propose`` calls."""

    head: tuple[int, ...]
    length: int = 0  # tokens the row held at the last step (num_tokens_no_spec)
    tail: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    drafted: list[int] = field(default_factory=list)  # tokens proposed at the last step
    data: dict[str, Any] = field(default_factory=dict)  # the proposer's own (drafters, scores)

    def follows(self, tokens: np.ndarray) -> bool:
        """Whether ``tokens`` continue what this state saw at its last step."""
        n = len(tokens)
        if n <= self.length:
            return False
        return np.array_equal(tokens[self.length - len(self.tail) : self.length], self.tail)

    def moved_to(self, tokens: np.ndarray) -> None:
        self.length = len(tokens)
        self.tail = np.array(tokens[max(0, self.length - TAIL) : self.length], dtype=np.int64)


class RequestStates:
    """Request states by content, at most ``capacity`` of them (least recently claimed evicted)."""

    def __init__(self, capacity: int = 256) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._states: OrderedDict[int, RequestState] = OrderedDict()  # id -> state, least recent first
        self._by_head: dict[tuple[int, ...], list[int]] = {}
        self._head_lengths: dict[int, int] = {}  # head length -> states with a head that long

    def __len__(self) -> int:
        return len(self._states)

    def claim(self, tokens: np.ndarray, taken: set[int]) -> tuple[RequestState, bool]:
        """The state ``tokens`` continue (not one in ``taken``, already claimed by another row this
        step), or a new one; the bool says whether it is new. The state is marked as used now."""
        best = None
        for length in self._head_lengths:
            for key in self._by_head.get(tuple(int(t) for t in tokens[:length]), ()):
                state = self._states[key]
                if key not in taken and state.follows(tokens) and (best is None or state.length > best[1].length):
                    best = (key, state)
        if best is not None:
            key, state = best
            self._states.move_to_end(key)
            taken.add(key)
            return state, False
        state = RequestState(head=tuple(int(t) for t in tokens[:HEAD]))
        key = id(state)
        self._states[key] = state
        self._by_head.setdefault(state.head, []).append(key)
        self._head_lengths[len(state.head)] = self._head_lengths.get(len(state.head), 0) + 1
        taken.add(key)
        while len(self._states) > self.capacity:
            self._evict()
        return state, True

    def _evict(self) -> None:
        key, state = self._states.popitem(last=False)
        keys = self._by_head[state.head]
        keys.remove(key)
        if not keys:
            del self._by_head[state.head]
        self._head_lengths[len(state.head)] -= 1
        if not self._head_lengths[len(state.head)]:
            del self._head_lengths[len(state.head)]
