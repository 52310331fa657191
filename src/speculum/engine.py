"""The loop: prefill -> propose -> one target forward over a token tree -> verify -> commit -> observe.

Every method runs through ``run``; the drafter is the only thing that changes. Invariant kept
across steps: the target's cache holds every committed token but the last one (the tree's
root), which is fed together with the draft in the next forward.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch

from speculum.controller import Controller
from speculum.drafters.base import DraftContext, Drafter, Outcome, TargetOutputs
from speculum.errors import InvalidInputError
from speculum.runner import ModelRunner
from speculum.sampling import SamplingParams
from speculum.stats import Stats
from speculum.tree import MAX_DRAFT_NODES, TokenTree
from speculum.verify import verify


def run(
    runner: ModelRunner,
    prompt_ids: list[int],
    drafter: Drafter,
    sampling: SamplingParams,
    max_new_tokens: int,
    eos_token_ids: frozenset[int] = frozenset(),
    generator: torch.Generator | None = None,
    stats: Stats | None = None,
    controller: Controller | None = None,
) -> Iterator[list[int]]:
    """Generate; the returned iterator yields the tokens committed at each step and fills ``stats``.

    ``controller``: decides each round whether to draft and which draft nodes to verify (None: the
    drafter's proposal is verified as it is). Bad input is refused here, at the call, not at the
    first iteration.
    """
    if not prompt_ids:
        raise InvalidInputError("the prompt is empty")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise InvalidInputError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    context = runner.max_positions
    if context is not None and len(prompt_ids) >= context:
        raise InvalidInputError(f"the prompt has {len(prompt_ids)} tokens; the model's context is {context}")
    if context is not None:
        max_new_tokens = min(max_new_tokens, context - len(prompt_ids))
    drafter.check(sampling)
    stats = stats if stats is not None else Stats()
    return _steps(
        runner, list(prompt_ids), drafter, sampling, max_new_tokens, eos_token_ids, generator, stats, controller
    )


def _steps(
    runner: ModelRunner,
    tokens: list[int],
    drafter: Drafter,
    sampling: SamplingParams,
    max_new_tokens: int,
    eos_token_ids: frozenset[int],
    generator: torch.Generator | None,
    stats: Stats,
    controller: Controller | None,
) -> Iterator[list[int]]:
    start = time.perf_counter()
    stats.prompt_tokens = len(tokens)
    hidden = drafter.wants_hidden_states
    cache = runner.new_cache()
    prefill_hidden = runner.prefill(cache, tokens[:-1], hidden=hidden)
    ctx = DraftContext(
        tokens, len(tokens), sampling, generator, 0, eos_token_ids, runner.output_device, prefill_hidden,
        wants_scores=controller is not None,
    )  # fmt: skip
    t = time.perf_counter()
    stats.time_prefill = t - start
    drafter.start(ctx)
    if controller is not None:
        controller.start()
    stats.time_draft += time.perf_counter() - t

    try:
        while True:
            ctx.max_depth = max_new_tokens - stats.new_tokens - 1
            t0 = time.perf_counter()
            asked = ctx.max_depth > 0 and (controller is None or controller.wants_draft())
            draft = drafter.propose(ctx) if asked else None
            t1 = time.perf_counter()
            keep = None
            if controller is not None and draft is not None and len(draft):
                plan = controller.plan(draft, ctx.max_depth, drafter.prunable, drafter.whole_sources)
                keep = plan.keep
                stats.nodes_pruned += plan.pruned
                stats.predicted_tokens += plan.expected_tokens
                stats.predicted_time += plan.predicted_seconds + (t1 - t0)
            tc = time.perf_counter()
            tree = TokenTree.from_draft(tokens[-1], draft, ctx.max_depth, MAX_DRAFT_NODES, keep)
            past = len(tokens) - 1
            out = runner.forward(cache, tree, hidden=hidden)
            verdict = verify(tree, out.logits, sampling, generator)
            runner.commit(cache, past, verdict.path)
            t2 = time.perf_counter()

            accepted = [tree.tokens[i] for i in verdict.path[1:]]
            new, stop = accepted + [verdict.next_token], ""
            for i, token in enumerate(new):
                if token in eos_token_ids:
                    new, stop = new[: i + 1], "eos"
                    break
            if len(new) >= max_new_tokens - stats.new_tokens:
                new, stop = new[: max_new_tokens - stats.new_tokens], stop or "length"
            tokens.extend(new)
            stats.new_tokens += len(new)
            if draft is not None and draft.sources is not None:
                for node in verdict.path[1 : 1 + min(verdict.num_accepted, len(new))]:
                    by = draft.sources[tree.source[node]]
                    stats.accepted_by[by] = stats.accepted_by.get(by, 0) + 1
            stats.count_step(len(tree) - 1, max(tree.depth), verdict.num_accepted, len(new))
            t3 = time.perf_counter()
            if not stop:
                path_hidden = out.hidden[verdict.path] if out.hidden is not None else None
                outcome = Outcome(
                    accepted,
                    tree.draft_path(verdict.path, draft) if draft is not None else [],
                    verdict.next_token,
                    len(tree) - 1,
                    draft,
                    TargetOutputs(tree, out.logits, sampling, path_hidden, verdict.argmax),
                )
                drafter.observe(ctx, outcome)
            t4 = time.perf_counter()
            if controller is not None:
                controller.observe_round(
                    tree,
                    verdict.path,
                    draft,
                    asked=asked,
                    committed=len(new),
                    forward_seconds=t2 - tc,
                    round_seconds=t4 - t0,
                    draft_seconds=(t1 - t0) + (t4 - t3),
                )
                if asked:
                    stats.rounds_drafted += 1
                    stats.drafted_round_tokens += len(new)
                    stats.drafted_round_time += t4 - t0
                else:
                    stats.rounds_plain += 1
                stats.time_control += (tc - t1) + (time.perf_counter() - t4)
            stats.time_draft += (t1 - t0) + (t4 - t3)
            stats.time_verify += t2 - tc
            stats.draft_forwards = drafter.forwards
            stats.wall_time = time.perf_counter() - start
            stats.time_other = (
                stats.wall_time - stats.time_prefill - stats.time_draft - stats.time_verify - stats.time_control
            )
            stats.stop_reason = stop
            yield new
            if stop:
                break
    except GeneratorExit:  # the caller stopped reading (a closed stream): the request still ends
        stats.stop_reason = stats.stop_reason or "cancelled"
        drafter.finish(ctx)
        raise
    drafter.finish(ctx)


__all__ = ["Stats", "run"]
