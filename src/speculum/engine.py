"""The loop: prefill -> propose -> one target forward over a token tree -> verify -> commit -> observe.

Every method runs through :class:`Batch`; the drafter is the only thing that changes. A request is
a row of a batch, and a lone request is a batch of one (``run``), which takes exactly the path of
plain single-sequence decoding: its chains go through the model's own causal mask, nothing padded.
Several rows (``run_batch``, the server) share one target forward per step that carries every
row's tree; each row is verified, committed and observed on its own (ragged: one row accepts five
tokens while another accepts none), and rows join and leave between steps (docs/batching.md).

Invariant kept across steps: the target's cache holds every committed token of a row but the last
one (the root of its next tree), which is fed together with the draft in the next forward.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import torch

from speculum import cache as cache_ops
from speculum import exact
from speculum.controller import Controller
from speculum.drafters.base import DraftContext, Drafter, Outcome, TargetOutputs
from speculum.errors import InvalidInputError
from speculum.runner import ModelRunner, StepOutput
from speculum.sampling import PositionNoise, SamplingParams
from speculum.stats import Stats
from speculum.tree import MAX_DRAFT_NODES, TokenTree
from speculum.verify import Verdict, verify


@dataclass
class Request:
    """One generation: what a row of a batch decodes, and with what."""

    prompt_ids: list[int]
    drafter: Drafter
    sampling: SamplingParams
    max_new_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    generator: torch.Generator | None = None
    stats: Stats = field(default_factory=Stats)
    controller: Controller | None = None  # decides what to draft and verify (None: the proposal as it is)
    noise: PositionNoise | None = None  # a seeded sampled request's: its text whatever is drafted


def check(runner: ModelRunner, request: Request) -> Request:
    """Refuse bad input with one clear error (at the call, not at the first step); the request with
    ``max_new_tokens`` cut to what the model's context leaves."""
    prompt_ids, max_new_tokens = request.prompt_ids, request.max_new_tokens
    if not prompt_ids:
        raise InvalidInputError("the prompt is empty")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise InvalidInputError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    context = runner.max_positions
    if context is not None and len(prompt_ids) >= context:
        raise InvalidInputError(f"the prompt has {len(prompt_ids)} tokens; the model's context is {context}")
    if context is not None:
        max_new_tokens = min(max_new_tokens, context - len(prompt_ids))
    request.drafter.check(request.sampling)
    return replace(request, prompt_ids=list(prompt_ids), max_new_tokens=max_new_tokens)


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
    noise: PositionNoise | None = None,
) -> Iterator[list[int]]:
    """Generate one request; the returned iterator yields the tokens committed at each step and
    fills ``stats``. ``controller``: decides each round whether to draft and which draft nodes to
    verify (None: the drafter's proposal is verified as it is); ``noise``: sample by it (the same
    text whatever is drafted) instead of by ``generator``."""
    stats = stats if stats is not None else Stats()
    request = Request(prompt_ids, drafter, sampling, max_new_tokens, eos_token_ids, generator, stats, controller, noise)
    return _one(runner, check(runner, request))


def run_batch(runner: ModelRunner, requests: list[Request]) -> Iterator[tuple[int, list[int]]]:
    """Generate several requests together; the iterator yields ``(index of the request, tokens it
    committed this step)`` and fills each request's stats. Each row's output is its output alone
    (in bfloat16, up to near-ties that a forward over several rows rounds apart)."""
    checked = [check(runner, request) for request in requests]
    return _many(runner, checked)


def _one(runner: ModelRunner, request: Request) -> Iterator[list[int]]:
    batch = Batch(runner)
    row = batch.join(request)
    try:
        while not row.done:
            for _, new in batch.step():
                yield new
    except GeneratorExit:  # the caller stopped reading (a closed stream): the request still ends
        if not row.done:
            batch.leave(row, "cancelled")
        raise


def _many(runner: ModelRunner, requests: list[Request]) -> Iterator[tuple[int, list[int]]]:
    batch = Batch(runner)
    index = {id(batch.join(request)): i for i, request in enumerate(requests)}
    try:
        while batch.rows:
            for row, new in batch.step():
                yield index[id(row)], new
    except GeneratorExit:
        for row in list(batch.rows):
            batch.leave(row, "cancelled")
        raise


_STEPS = itertools.count()  # batch steps, numbered across batches: a step's decisions are made once for its rows


class Row:
    """A request in flight: its committed tokens, what its drafter reads, and this step's draft."""

    def __init__(self, request: Request, ctx: DraftContext, started: float):
        self.request = request
        self.ctx = ctx
        self.tokens = ctx.tokens  # prompt + generated; the last one is the next tree's root
        self.stats = request.stats
        self.started = started
        self.done = False
        # this step: whether the drafter was asked, its draft, the tree verified, and when
        self.asked = False
        self.draft = None
        self.tree: TokenTree | None = None
        self.t0 = self.t1 = self.tc = self.planning = 0.0
        self.catch_up = 0.0  # of this step's drafting: the drafter catching up (Drafter.catch_up_seconds)

    @property
    def cached(self) -> int:
        """Columns of the row in the target's cache: every committed token but the root."""
        return len(self.tokens) - 1

    def ask(self, rows: int = 1, step: object = None) -> bool:
        """Start the round (``step`` of a batch of ``rows`` rows): whether the drafter is asked
        (False: the controller takes a plain step)."""
        request, ctx = self.request, self.ctx
        ctx.max_depth = request.max_new_tokens - self.stats.new_tokens - 1
        ctx.rows = rows
        self.t0 = time.perf_counter()
        controller = request.controller
        ctx.cost = controller.cost if controller is not None else None
        if controller is None or ctx.max_depth <= 0:
            self.asked = ctx.max_depth > 0
        else:
            estimate = getattr(request.drafter, "catch_up_estimate", None)  # (a duck-typed drafter has none)
            catch_up = estimate(ctx) if estimate is not None and rows == 1 else 0.0
            self.asked = controller.wants_draft(
                rows, step, catch_up=catch_up, generated=self.stats.new_tokens, tokens_left=ctx.max_depth + 1
            )
        # a chain's draft forwards are cut where the next does not pay (alone: in a batch, a row
        # whose chain ended rides along in the others' forwards, and stopping it saves nothing)
        alone = controller is not None and self.asked and rows == 1
        ctx.chain_stop = controller.chain_stop() if alone else None
        self.draft = None
        return self.asked

    def plan(self, draft_seconds: float, rows: int = 1, floor: int = 1) -> None:
        """The drafter's draft is in (``draft_seconds`` of drafting): the controller's plan and the
        tree to verify; ``rows``: the batch's size this step, ``floor``: the largest tree of the rows
        before this one (the batch pads every tree to the largest)."""
        request, ctx, stats, draft = self.request, self.ctx, self.stats, self.draft
        controller = request.controller
        self.t1 = self.t0 + draft_seconds
        start = time.perf_counter()  # (in a batch, the other rows' drafting lies between t1 and now)
        catch_up = getattr(request.drafter, "catch_up_seconds", 0.0)  # (a duck-typed drafter has none)
        self.catch_up = min(catch_up, draft_seconds) if self.asked else 0.0
        judged = draft_seconds - self.catch_up  # what this round's drafting costs the round
        keep = None
        if ctx.chain_stop is not None:
            stats.chains_stopped += ctx.chain_stop.stopped
            ctx.chain_stop = None
        if controller is not None and draft is not None and len(draft):
            drafter = request.drafter
            plan = controller.plan(
                draft, ctx.max_depth, drafter.prunable, drafter.whole_sources,
                draft_seconds=judged, rows=rows, floor=floor,
            )  # fmt: skip
            keep = plan.keep
            stats.nodes_pruned += plan.pruned
            stats.rounds_explored += plan.explored
            stats.predicted_tokens += plan.expected_tokens
            stats.predicted_time += plan.predicted_seconds + judged + controller.overhead
        elif controller is not None and self.asked:  # asked, proposed nothing: a plain step's worth
            stats.predicted_tokens += 1.0
            stats.predicted_time += controller.row_cost(rows)(1) + judged + controller.overhead
        self.tc = time.perf_counter()
        self.planning = self.tc - start
        self.tree = TokenTree.from_draft(self.tokens[-1], draft, ctx.max_depth, MAX_DRAFT_NODES, keep)

    def verify(self, out: StepOutput) -> Verdict:
        request, position = self.request, self.stats.new_tokens
        if request.noise is not None:
            request.noise.forget(position)
        return verify(self.tree, out.logits, request.sampling, request.generator, request.noise, position)

    def commit(
        self, verdict: Verdict, out: StepOutput, forward: tuple[float, float], rows: int, padded: int
    ) -> list[int]:
        """Take the verdict's tokens (cut at EOS and at the length asked), observe, keep the stats;
        the tokens committed. ``forward``: when the shared forward (and commit) began and ended;
        ``rows``: how many rows it carried, their trees padded to ``padded`` nodes."""
        tf, t2 = forward
        request, ctx, stats, tree, draft = self.request, self.ctx, self.stats, self.tree, self.draft
        accepted = [tree.tokens[i] for i in verdict.path[1:]]
        new, stop = accepted + [verdict.next_token], ""
        for i, token in enumerate(new):
            if token in request.eos_token_ids:
                new, stop = new[: i + 1], "eos"
                break
        left = request.max_new_tokens - stats.new_tokens
        if len(new) >= left:
            new, stop = new[:left], stop or "length"
        self.tokens.extend(new)
        stats.new_tokens += len(new)
        if draft is not None and draft.sources is not None:
            for node in verdict.path[1 : 1 + min(verdict.num_accepted, len(new))]:
                by = draft.sources[tree.source[node]]
                stats.accepted_by[by] = stats.accepted_by.get(by, 0) + 1
        stats.count_step(len(tree) - 1, max(tree.depth), verdict.num_accepted, len(new))
        t3 = time.perf_counter()
        lean = None  # the round without the drafter's costly parts, where it says (auto's lean_round)
        if not stop:
            path_hidden = out.hidden[verdict.path] if out.hidden is not None else None
            outcome = Outcome(
                accepted,
                tree.draft_path(verdict.path, draft) if draft is not None else [],
                verdict.next_token,
                len(tree) - 1,
                draft,
                TargetOutputs(tree, out.logits, request.sampling, path_hidden, verdict.argmax),
            )
            if rows > 1:  # what the round cost this row: its own drafting and its share of the forward
                outcome.stats["row_seconds"] = (self.t1 - self.t0 - self.catch_up) + (t2 - tf) / rows
            if request.controller is not None:  # what a forward over n nodes costs this row, modelled
                outcome.stats["node_cost"] = request.controller.row_cost(rows)
            request.drafter.observe(ctx, outcome)
            lean = outcome.stats.get("lean_round")
        t4 = time.perf_counter()
        own_draft = (self.t1 - self.t0) + (t4 - t3)
        # the round's time as the controller judges it (catching up is paid once for the text, not
        # per round): alone, all of it; in a batch, the row's drafting and share of the forward
        judged_draft = own_draft - self.catch_up
        round_seconds = t4 - self.t0 - self.catch_up if rows == 1 else judged_draft + self.planning + (t2 - tf) / rows
        controller = request.controller
        if controller is not None:
            controller.observe_round(
                tree,
                verdict.path,
                draft,
                asked=self.asked,
                committed=len(new),
                forward_seconds=t2 - tf,
                round_seconds=round_seconds,
                draft_seconds=judged_draft,
                rows=rows,
                padded=padded,
                lean=None if lean is None else (lean[0], round_seconds - lean[1], lean[2]),
            )
            if self.asked:
                stats.rounds_drafted += 1
                stats.drafted_round_tokens += len(new)
                stats.drafted_round_time += round_seconds
            else:
                stats.rounds_plain += 1
            stats.time_control += self.planning + (time.perf_counter() - t4)
        stats.time_draft += own_draft
        stats.time_draft_catch_up += self.catch_up
        stats.time_verify += t2 - tf
        stats.draft_forwards = request.drafter.forwards
        stats.wall_time = time.perf_counter() - self.started
        spent = stats.time_prefill + stats.time_draft + stats.time_verify + stats.time_control
        stats.time_other = stats.wall_time - spent
        stats.stop_reason = stop
        self.done = bool(stop)
        return new


class Joining:
    """A request being prefilled, alone and in chunks if asked, before it joins a batch: a long
    prompt then holds the running rows for one chunk at a time, not for its whole prefill."""

    def __init__(self, runner: ModelRunner, request: Request):
        self.runner = runner
        self.request = request
        self.started = time.perf_counter()
        self.tokens = list(request.prompt_ids)
        request.stats.prompt_tokens = len(self.tokens)
        self.cache = runner.new_cache()
        self.done = 0  # prompt tokens prefilled (all but the last, which is the first tree's root)
        self.hidden: list[torch.Tensor] = []  # the prefill's hidden states, for drafters that read them

    @property
    def left(self) -> int:
        return len(self.tokens) - 1 - self.done

    def prefill(self, max_tokens: int | None = None) -> bool:
        """Prefill the next ``max_tokens`` prompt tokens (None: all the rest); True once complete."""
        t = time.perf_counter()
        last = len(self.tokens) - 1
        end = (
            last
            if max_tokens is None
            else exact.prefill_end(self.runner.model, self.done, self.done + max_tokens, last)
        )
        wants = self.request.drafter.wants_hidden_states
        if end > self.done:
            states = self.runner.prefill(self.cache, self.tokens[self.done : end], hidden=wants)
            if states is not None:
                self.hidden.append(states)
            self.done = end
        self.request.stats.time_prefill += time.perf_counter() - t
        return self.left == 0


class Batch:
    """Rows decoded together: each step, one target forward carries every row's tree.

    Rows join (after their own prefill) and leave (finished, cancelled) between steps; a row's
    output does not depend on what else is in the batch (greedy: up to the batch's float rounding).

    ``isolate``: a row whose drafter, controller, verification or share of the target forward
    raises fails alone: it leaves the batch and goes to ``failed`` with its exception, and the
    other rows' step goes on (a server must not fail every request for one). Without it, the step
    raises."""

    def __init__(self, runner: ModelRunner, isolate: bool = False):
        self.runner = runner
        self.rows: list[Row] = []
        self.cache = runner.new_cache()
        self.isolate = isolate
        self.failed: list[tuple[Row, Exception]] = []  # the last step's failed rows

    def __len__(self) -> int:
        return len(self.rows)

    def join(self, request: Request) -> Row:
        """Prefill ``request`` (alone, at once) and add it as a row; it must have passed :func:`check`."""
        joining = Joining(self.runner, request)
        while not joining.prefill():
            pass
        return self.admit(joining)

    def admit(self, joining: Joining) -> Row:
        """Add a request whose prefill is complete as a row (its drafter starts now)."""
        request, stats = joining.request, joining.request.stats
        hidden = joining.hidden
        prefill_hidden = None if not hidden else hidden[0] if len(hidden) == 1 else torch.cat(hidden)
        ctx = DraftContext(
            joining.tokens, len(joining.tokens), request.sampling, request.generator, 0, request.eos_token_ids,
            self.runner.output_device, prefill_hidden, noise=request.noise,
            wants_scores=request.controller is not None,
        )  # fmt: skip
        t = time.perf_counter()
        request.drafter.start(ctx)
        if request.controller is not None:
            request.controller.start()
        stats.time_draft += time.perf_counter() - t
        # the cache takes the row only once its drafter has started: a drafter that raises leaves the batch as it was
        if self.rows:
            cache_ops.join(self.cache, len(self.rows), joining.cache)
        else:
            self.cache = joining.cache
        row = Row(request, ctx, joining.started)
        self.rows.append(row)
        return row

    def leave(self, row: Row, reason: str = "") -> None:
        """Remove ``row`` now (its cache columns too); ``reason`` is its stop reason if it had none."""
        others = [i for i, r in enumerate(self.rows) if r is not row]
        if len(others) == len(self.rows):
            return
        if others:
            cache_ops.keep_rows(self.cache, others, max(self.rows[i].cached for i in others))
        else:
            self.cache = self.runner.new_cache()
        self.rows = [self.rows[i] for i in others]
        row.done = True
        row.stats.stop_reason = row.stats.stop_reason or reason
        row.request.drafter.finish(row.ctx)
        if row.request.controller is not None:
            row.request.controller.finish(row.stats.new_tokens)

    def _fail(self, row: Row, error: Exception) -> None:
        """``row`` raised ``error``: it leaves the batch (or, without ``isolate``, the step raises)."""
        if not self.isolate:
            raise error
        self.failed.append((row, error))
        try:
            self.leave(row, "error")
        except Exception:  # its drafter's finish: the row is out of the batch already
            pass

    def _each(self, rows: list[Row], call) -> list[Row]:
        """``call(row)`` for each row; the rows that did not raise (those that did have failed)."""
        kept = []
        for row in rows:
            try:
                call(row)
                kept.append(row)
            except Exception as exc:
                self._fail(row, exc)
        return kept

    def _draft(self, asked: list[Row]) -> dict[int, float]:
        """Each asked row's draft (``Row.draft``); the seconds of drafting each is charged. Rows whose
        drafters share a ``batch_key`` propose together and share the time it took."""
        groups: dict[object, list[Row]] = {}
        for row in asked:
            key = getattr(row.request.drafter, "batch_key", None)  # (a duck-typed drafter proposes alone)
            groups.setdefault(id(row) if key is None else key, []).append(row)
        seconds: dict[int, float] = {}

        def propose(row: Row) -> None:
            row.draft = row.request.drafter.propose(row.ctx)

        for members in groups.values():
            start = time.perf_counter()
            if len(members) == 1:
                self._each(members, propose)
            else:
                drafters = [row.request.drafter for row in members]
                try:
                    drafts = type(drafters[0]).propose_rows(drafters, [row.ctx for row in members])
                    for row, draft in zip(members, drafts, strict=True):
                        row.draft = draft
                except Exception:
                    if not self.isolate:
                        raise
                    # which row's drafting raised is unknown: each proposes alone (a draft changes no output)
                    self._each(members, propose)
            share = (time.perf_counter() - start) / len(members)
            for row in members:
                seconds[id(row)] = share
        return seconds

    def _forward(self, rows: list[Row], hidden: bool) -> tuple[list[StepOutput], int]:
        """The target forward over ``rows``' trees, and the cache's columns before it. With ``isolate``,
        where it raises, each row's tree runs alone on a copy of its cache: the rows that raise alone
        fail (leaving ``rows``), and the others' forward runs again without them."""
        while True:
            lengths = [row.cached for row in rows]
            # (a lone row's cache need not be a batch's: a replay's is not)
            columns = lengths[0] if len(rows) == 1 else cache_ops.cache_length(self.cache)
            try:
                if len(rows) == 1:
                    return [self.runner.forward(self.cache, rows[0].tree, hidden=hidden)], columns
                trees = [row.tree for row in rows]
                return self.runner.forward_rows(self.cache, trees, lengths, hidden=hidden), columns
            except Exception as exc:
                if not self.isolate:
                    raise
                errors = {id(rows[0]): exc} if len(rows) == 1 else self._alone(rows, lengths, hidden)
                if not errors:
                    raise  # the rows fail only together: the batch fails
                for row in [row for row in rows if id(row) in errors]:
                    self._fail(row, errors[id(row)])  # (leaving crops the columns the forward added)
                rows[:] = [row for row in rows if id(row) not in errors]
                if not rows:
                    return [], columns

    def _alone(self, rows: list[Row], lengths: list[int], hidden: bool) -> dict[int, Exception]:
        """What each row's tree raises in a forward of its own (by ``id`` of the row)."""
        errors = {}
        for r, row in enumerate(rows):
            cache = cache_ops.split_rows(self.cache, [n if i == r else 0 for i, n in enumerate(lengths)])[r]
            try:
                self.runner.forward_rows(cache, [row.tree], [lengths[r]], hidden=hidden)
            except Exception as exc:
                errors[id(row)] = exc
        return errors

    def step(self) -> list[tuple[Row, list[int]]]:
        """One round for every row: the tokens each committed (finished rows have left after it, and
        with ``isolate`` failed rows too: see ``failed``)."""
        self.failed = []
        rows = list(self.rows)
        step, size, asked = next(_STEPS), len(rows), []

        def ask(row: Row) -> None:
            if row.ask(size, step):
                asked.append(row)

        rows = self._each(rows, ask)
        drafting = self._draft(asked)
        rows = [row for row in rows if row in self.rows]  # (a failed row has left)
        floor = 1

        def plan(row: Row) -> None:
            nonlocal floor
            row.plan(drafting.get(id(row), 0.0), size, floor)
            floor = max(floor, len(row.tree))

        rows = self._each(rows, plan)
        if not rows:
            return []
        tf = rows[0].tc if len(rows) == 1 else time.perf_counter()
        outs, columns = self._forward(rows, any(row.request.drafter.wants_hidden_states for row in rows))
        lengths, verdicts, late = [row.cached for row in rows], [], []  # late: (row, error) failed after the forward
        for row, out in zip(rows, outs, strict=True):
            try:
                verdicts.append(row.verify(out))
            except Exception as exc:
                if not self.isolate:
                    raise
                verdicts.append(None)
                late.append((row, exc))
        paths = [[0] if v is None else v.path for v in verdicts]  # (a row that failed keeps its root only)
        if len(rows) == 1:  # plain single-sequence decoding's path (a lone row is as long as the cache)
            self.runner.commit(self.cache, lengths[0], paths[0])
        elif rows:
            self.runner.commit_rows(self.cache, columns, lengths, paths)
        t2 = time.perf_counter()
        committed = []
        for row, v, out in zip(rows, verdicts, outs, strict=True):
            if v is not None:
                try:
                    committed.append((row, row.commit(v, out, (tf, t2), len(rows), floor)))
                except Exception as exc:
                    if not self.isolate:
                        raise
                    late.append((row, exc))
        # failed rows leave once every row has committed: leaving crops the cache to the rows' lengths
        for row, exc in late:
            self._fail(row, exc)
        for row, _ in committed:
            if row.done:
                try:
                    self.leave(row)
                except Exception as exc:  # its drafter's finish: the row is out of the batch already
                    if not self.isolate:
                        raise
                    self.failed.append((row, exc))
        failed = {id(row) for row, _ in self.failed}
        return [(row, new) for row, new in committed if id(row) not in failed]


__all__ = ["Batch", "Joining", "Request", "Row", "Stats", "check", "run", "run_batch"]
