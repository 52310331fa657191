"""Exact replay: the greedy acceptance a deterministic drafter gets, without running the model.

Greedy verification accepts exactly the draft tokens that equal the target's greedy output, so
feeding the engine's own loop one-hot "logits" of a recorded greedy output gives, without a model
forward, the very acceptance a *deterministic* drafter (n-gram, prompt lookup, phrases) gets in a
real greedy run (timings aside). Used for acceptance-only studies over many prompts and settings
(``benchmarks/anpd_ablations.py``, ``speculum tune``).

Head drafters (Medusa, CTC) also read the target's hidden states: given ``hidden`` (the target's
last hidden states over prompt + reference, from one teacher-forced forward), the replay hands
them the state of every committed position, as the real loop would (up to rounding: one batched
forward, not the step-by-step ones).
"""

from __future__ import annotations

import torch

from speculum import engine
from speculum.drafters.base import Drafter
from speculum.runner import StepOutput
from speculum.sampling import SamplingParams
from speculum.stats import Stats
from speculum.tree import TokenTree


class ReplayRunner:
    """Stands in for the target's ModelRunner when its greedy output (``reference``) is known."""

    max_positions = None
    output_device = torch.device("cpu")

    def __init__(self, prompt_ids: list[int], reference: list[int], hidden: torch.Tensor | None = None):
        self.sequence = list(prompt_ids) + list(reference)
        self.hidden = hidden  # [len(sequence) (or one less), hidden size], for drafters that read it

    def new_cache(self) -> list[int]:
        return [0]  # the number of committed positions, as a stand-in for a KV cache

    def prefill(self, cache, token_ids: list[int], hidden: bool = False) -> torch.Tensor | None:
        cache[0] = len(token_ids)
        return self._states(list(range(len(token_ids))), hidden) if token_ids else None

    def _states(self, positions: list[int], wanted: bool) -> torch.Tensor | None:
        if not wanted:
            return None
        if self.hidden is None:
            raise ValueError("this drafter reads hidden states: replay it with hidden=...")
        return self.hidden[[min(p, len(self.hidden) - 1) for p in positions]]

    def commit(self, cache, past_length: int, path: list[int]) -> None:
        cache[0] = past_length + len(path)

    def forward(self, cache, tree: TokenTree, *, hidden: bool = False, last_only: bool = False) -> StepOutput:
        root = cache[0]  # index of the tree's root in the full sequence
        end = len(self.sequence) - 1
        rows = _ReferenceRows([self.sequence[min(root + d + 1, end)] for d in tree.depth])
        # a node at depth d on the accepted path is the reference token at root + d: its state is
        # the recorded one there (other nodes' states are never read: they are not committed)
        return StepOutput(rows, self._states([root + d for d in tree.depth], hidden))


class _ReferenceRows:
    """Greedy-only stand-in for a logits matrix: row i's argmax is the reference token at node i's depth
    (materialising one-hot rows over a 150k vocabulary would cost more than the drafters studied)."""

    def __init__(self, tokens: list[int]):
        self.tokens = tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, node: int) -> _ReferenceRow:
        return _ReferenceRow(self.tokens[node])

    def materialize(self) -> _ReferenceRows:
        return self

    def argmax(self, dim: int = -1) -> _ReferenceRows:
        return self

    def tolist(self) -> list[int]:
        return list(self.tokens)


class _ReferenceRow:
    def __init__(self, token: int):
        self.token = token

    def argmax(self) -> int:
        return self.token


def replay(
    prompt_ids: list[int],
    reference: list[int],
    drafter: Drafter,
    eos_token_ids=frozenset(),
    hidden: torch.Tensor | None = None,
) -> Stats:
    """The greedy acceptance statistics ``drafter`` would get on a prompt whose greedy output is
    ``reference`` (``hidden``: the target's states over both, for drafters that read them)."""
    stats = Stats()
    runner = ReplayRunner(prompt_ids, reference, hidden)
    steps = engine.run(runner, prompt_ids, drafter, SamplingParams(), len(reference), eos_token_ids, None, stats)
    for _ in steps:
        pass
    return stats
