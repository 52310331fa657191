"""The loop: prefill -> propose -> one target forward over a token tree -> verify -> commit -> observe.

Every method runs through ``run``; the drafter is the only thing that changes. Invariant kept
across steps: the target's cache holds every committed token but the last one (the tree's
root), which is fed together with the draft in the next forward.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

import torch

from speculum import cache as cache_ops
from speculum.drafters.base import Draft, DraftContext, Drafter, Outcome
from speculum.errors import InvalidInputError
from speculum.sampling import SamplingParams
from speculum.tree import TokenTree
from speculum.verify import verify


@dataclass
class Stats:
    """Speculation statistics of one generation call (vLLM's names where they exist)."""

    new_tokens: int = 0
    prompt_tokens: int = 0
    target_forwards: int = 0  # verification forwards (the prefill is not counted)
    draft_forwards: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    accept_lengths: list[int] = field(default_factory=list)  # tokens committed per target forward
    draft_sizes: list[int] = field(default_factory=list)  # draft tokens verified per target forward
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    time_prefill: float = 0.0
    time_draft: float = 0.0
    time_verify: float = 0.0
    time_other: float = 0.0
    wall_time: float = 0.0
    stop_reason: str = ""

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens added per target forward, counting the bonus token (1.0 for plain decoding)."""
        return sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else 0.0

    @property
    def draft_acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def acceptance_per_position(self) -> list[float]:
        """Share of steps that drafted at depth d whose depth-d token was accepted."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position, strict=True)]

    @property
    def discard_rate(self) -> float:
        """SpecDec++: discarded draft tokens per generated token."""
        return (self.drafted_tokens - self.accepted_tokens) / self.new_tokens if self.new_tokens else 0.0

    @property
    def verification_rate(self) -> float:
        """SpecDec++: target forwards per generated token."""
        return self.target_forwards / self.new_tokens if self.new_tokens else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.wall_time if self.wall_time else 0.0

    def to_dict(self) -> dict:
        out = asdict(self)
        for name in (
            "mean_acceptance_length",
            "draft_acceptance_rate",
            "acceptance_per_position",
            "discard_rate",
            "verification_rate",
            "tokens_per_second",
        ):
            out[name] = getattr(self, name)
        return out


class TargetRunner:
    """Runs the target over a token tree through the public attention-mask path of transformers.

    Chains go through the model's own causal masking (the same code path as plain decoding).
    Trees get an explicit additive mask (prefix + ancestors) and per-node position ids; models
    with sliding-window layers (``config.layer_types``) get one mask per layer type.
    """

    def __init__(self, model: torch.nn.Module, lazy_head: bool | None = None):
        self.model = model
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.layer_types = set(getattr(config, "layer_types", None) or [])
        unsupported = self.layer_types - {"full_attention", "sliding_attention"}
        if unsupported:
            raise InvalidInputError(f"layer types {sorted(unsupported)} are not supported for tree verification yet")
        self.sliding_window = getattr(config, "sliding_window", None)
        self.max_positions = getattr(config, "max_position_embeddings", None)
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.softcap = getattr(config, "final_logit_softcapping", None)
        self.lazy_head = lazy_head if lazy_head is not None else self._lazy_head_pays()

    def _lazy_head_pays(self) -> bool:
        """Compute LM-head rows one accepted node at a time instead of for the whole tree?

        Worth it where the head's cost grows with the number of rows (half precision on a CPU
        without native support: compute-bound), and only for architectures whose logits are
        exactly ``head(base(x))`` (plus Gemma's soft-capping).
        """
        if self.device.type != "cpu" or self.dtype not in (torch.bfloat16, torch.float16):
            return False
        return self._plain_head()

    def _plain_head(self) -> bool:
        config = self.model.config
        known = {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text"}
        return config.model_type in known and hasattr(self.model, "model") and hasattr(self.model, "lm_head")

    def new_cache(self):
        return cache_ops.new_cache()

    def commit(self, cache, past_length: int, path: list[int]) -> None:
        """Keep only the accepted path's keys/values after a tree forward."""
        cache_ops.keep_path(cache, past_length, path)

    @torch.inference_mode()
    def prefill(self, cache, token_ids: list[int]) -> None:
        if token_ids:
            ids = torch.tensor([token_ids], device=self.device)
            self.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)

    @torch.inference_mode()
    def forward(self, cache, tree: TokenTree) -> torch.Tensor:
        """Logits ``[len(tree), vocab]``; the tree's keys/values are appended to the cache."""
        past = cache_ops.cache_length(cache)
        inputs = dict(input_ids=torch.tensor([tree.tokens], device=self.device), past_key_values=cache, use_cache=True)
        if not tree.is_chain:
            positions = tree.position_ids(past).to(self.device)
            inputs.update(attention_mask=self._tree_mask(tree, past, positions), position_ids=positions[None])
        if self.lazy_head and len(tree) > 1:
            hidden = self.model.model(**inputs).last_hidden_state[0]
            return LazyLogits(hidden, self._head)
        return self.model(**inputs).logits[0]

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.model.lm_head(hidden)
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def _tree_mask(self, tree: TokenTree, past: int, positions: torch.Tensor):
        n = len(tree)
        allowed = torch.ones(n, past + n, dtype=torch.bool, device=self.device)
        allowed[:, past:] = tree.ancestor_mask.to(self.device)
        full = self._additive(allowed)
        if "sliding_attention" not in self.layer_types:
            return full
        key_positions = torch.cat([torch.arange(past, device=self.device), positions])
        in_window = positions[:, None] - key_positions[None, :] < self.sliding_window
        return {"full_attention": full, "sliding_attention": self._additive(allowed & in_window)}

    def _additive(self, allowed: torch.Tensor) -> torch.Tensor:
        mask = torch.zeros(allowed.shape, dtype=self.dtype, device=self.device)
        return mask.masked_fill_(~allowed, torch.finfo(self.dtype).min)[None, None]


class LazyLogits:
    """Logits of a tree whose LM-head rows are computed on first use (the verifier reads only the
    nodes on the path it walks). Indexing by a node returns that node's logits ``[vocab]``."""

    def __init__(self, hidden: torch.Tensor, head):
        self.hidden = hidden
        self.head = head
        self.rows: dict[int, torch.Tensor] = {}
        self.shape = (hidden.shape[0], None)

    def __len__(self) -> int:
        return self.hidden.shape[0]

    @torch.inference_mode()
    def __getitem__(self, node: int) -> torch.Tensor:
        if node not in self.rows:
            self.rows[node] = self.head(self.hidden[node : node + 1])[0]
        return self.rows[node]


def run(
    runner: TargetRunner,
    prompt_ids: list[int],
    drafter: Drafter,
    sampling: SamplingParams,
    max_new_tokens: int,
    eos_token_ids: frozenset[int] = frozenset(),
    generator: torch.Generator | None = None,
    stats: Stats | None = None,
) -> Iterator[list[int]]:
    """Generate; yields the tokens committed at each step. ``stats`` is filled in as it goes."""
    stats = stats if stats is not None else Stats()
    if not prompt_ids:
        raise InvalidInputError("the prompt is empty")
    if max_new_tokens < 1:
        raise InvalidInputError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    context = runner.max_positions
    if context is not None and len(prompt_ids) >= context:
        raise InvalidInputError(f"the prompt has {len(prompt_ids)} tokens; the model's context is {context}")
    if context is not None:
        max_new_tokens = min(max_new_tokens, context - len(prompt_ids))

    start = time.perf_counter()
    tokens = list(prompt_ids)
    stats.prompt_tokens = len(tokens)
    cache = runner.new_cache()
    runner.prefill(cache, tokens[:-1])
    ctx = DraftContext(tokens, len(prompt_ids), sampling, generator, 0, eos_token_ids)
    t = time.perf_counter()
    stats.time_prefill = t - start
    drafter.start(ctx)
    stats.time_draft += time.perf_counter() - t

    while True:
        ctx.max_depth = max_new_tokens - stats.new_tokens - 1
        t0 = time.perf_counter()
        draft = drafter.propose(ctx) if ctx.max_depth > 0 else None
        if draft is not None:
            draft = draft.truncated(ctx.max_depth)
        t1 = time.perf_counter()
        tree = TokenTree.from_draft(tokens[-1], draft)
        past = len(tokens) - 1
        logits = runner.forward(cache, tree)
        verdict = verify(tree, logits, sampling, generator)
        runner.commit(cache, past, verdict.path)
        t2 = time.perf_counter()

        new = [tree.tokens[i] for i in verdict.path[1:]] + [verdict.next_token]
        _count_step(stats, tree, verdict.num_accepted)
        stop = ""
        for i, token in enumerate(new):
            if token in eos_token_ids:
                new, stop = new[: i + 1], "eos"
                break
        if len(new) >= max_new_tokens - stats.new_tokens:
            new, stop = new[: max_new_tokens - stats.new_tokens], stop or "length"
        tokens.extend(new)
        stats.new_tokens += len(new)
        stats.accept_lengths.append(len(new))
        t3 = time.perf_counter()
        if not stop:
            draft_nodes = [i - 1 for i in verdict.path[1:]]
            drafter.observe(
                ctx,
                Outcome([tree.tokens[i] for i in verdict.path[1:]], draft_nodes, verdict.next_token, len(tree) - 1),
            )
        t4 = time.perf_counter()
        stats.time_draft += (t1 - t0) + (t4 - t3)
        stats.time_verify += t2 - t1
        stats.draft_forwards = drafter.forwards
        stats.wall_time = time.perf_counter() - start
        stats.time_other = stats.wall_time - stats.time_prefill - stats.time_draft - stats.time_verify
        yield new
        if stop:
            stats.stop_reason = stop
            return


def _count_step(stats: Stats, tree: TokenTree, accepted: int) -> None:
    stats.target_forwards += 1
    stats.drafted_tokens += len(tree) - 1
    stats.draft_sizes.append(len(tree) - 1)
    stats.accepted_tokens += accepted
    deepest = max(tree.depth)
    while len(stats.drafted_per_position) < deepest:
        stats.drafted_per_position.append(0)
        stats.accepted_per_position.append(0)
    for d in range(deepest):
        stats.drafted_per_position[d] += 1
        stats.accepted_per_position[d] += d < accepted


class ReplayRunner:
    """Stands in for the target when its greedy output is already known (``reference``).

    Greedy verification accepts exactly the draft tokens that equal the target's greedy output, so
    feeding the loop one-hot logits of the reference gives, without running the model, the very
    acceptance a *deterministic* drafter gets in a real greedy run (timings aside). Used for
    acceptance-only ablations over many prompts and settings.
    """

    max_positions = None

    def __init__(self, prompt_ids: list[int], reference: list[int]):
        self.sequence = list(prompt_ids) + list(reference)

    def new_cache(self) -> list[int]:
        return [0]  # the number of committed positions, as a stand-in for a KV cache

    def prefill(self, cache, token_ids: list[int]) -> None:
        cache[0] = len(token_ids)

    def commit(self, cache, past_length: int, path: list[int]) -> None:
        cache[0] = past_length + len(path)

    def forward(self, cache, tree: TokenTree) -> _ReferenceRows:
        root = cache[0]  # index of the tree's root in the full sequence
        return _ReferenceRows([self.sequence[min(root + d + 1, len(self.sequence) - 1)] for d in tree.depth])


class _ReferenceRows:
    """Greedy-only stand-in for a logits matrix: row i's argmax is the reference token at node i's depth
    (materialising one-hot rows over a 150k vocabulary would cost more than the drafters studied)."""

    def __init__(self, tokens: list[int]):
        self.tokens = tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, node: int) -> _ReferenceRow:
        return _ReferenceRow(self.tokens[node])


class _ReferenceRow:
    def __init__(self, token: int):
        self.token = token

    def argmax(self) -> int:
        return self.token


def replay(prompt_ids: list[int], reference: list[int], drafter: Drafter, eos_token_ids=frozenset()) -> Stats:
    """The greedy acceptance statistics ``drafter`` would get on a prompt whose greedy output is ``reference``."""
    stats = Stats()
    runner = ReplayRunner(prompt_ids, reference)
    for _ in run(runner, prompt_ids, drafter, SamplingParams(), len(reference), eos_token_ids, None, stats):
        pass
    return stats


__all__ = ["Draft", "ReplayRunner", "Stats", "TargetRunner", "replay", "run"]
