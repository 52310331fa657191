"""Per-request state for a vLLM proposer, found again by content.

vLLM hands a ``custom_class`` proposer batch slots, not requests: a slot is reused when a request
ends, and requests move between slots when the batch is condensed. So a request's state (its n-gram
table, what was last proposed for it) is keyed by what the row holds: its first tokens, checked
against the tokens it ended with at the last step. vLLM never says that a request ended, so what is
kept is settled at the end of each step (``end_step``): states beyond the capacity are evicted,
least recently claimed first, but never one a row claimed in that step (more rows in flight than
the capacity must not evict each other's states and start them again). A wrong match can only cost
speed, never output: vLLM verifies every proposed token against the target.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
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
    """Request states by content: at the end of a step, at most ``capacity`` of them or the states
    claimed in that step, whichever is more (least recently claimed evicted)."""

    def __init__(self, capacity: int = 256) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._states: OrderedDict[int, RequestState] = OrderedDict()  # id -> state, least recent first
        self._by_head: dict[tuple[int, ...], list[int]] = {}
        self._head_lengths: dict[int, int] = {}  # head length -> states with a head that long
        self._claimed: set[int] = set()  # the states the last step claimed

    def __len__(self) -> int:
        return len(self._states)

    def __iter__(self) -> Iterator[RequestState]:
        return iter(list(self._states.values()))

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
        return state, True

    def end_step(self, taken: set[int]) -> list[RequestState]:
        """The step whose rows claimed ``taken`` is over: evict least recently claimed states beyond
        the capacity, never one in ``taken``. Returns the states kept that the step before claimed
        and this one did not (their requests ended, were preempted or wait for a prefill), for the
        proposer to release what they hold that costs memory."""
        # the states claimed in this step sit last (claim moves them there): eviction stops at them
        while len(self._states) > self.capacity and next(iter(self._states)) not in taken:
            self._evict()
        idle = [self._states[key] for key in self._claimed - taken if key in self._states]
        self._claimed = set(taken)
        return idle

    def _evict(self) -> None:
        key, state = self._states.popitem(last=False)
        keys = self._by_head[state.head]
        keys.remove(key)
        if not keys:
            del self._by_head[state.head]
        self._head_lengths[len(state.head)] -= 1
        if not self._head_lengths[len(state.head)]:
            del self._head_lengths[len(state.head)]
