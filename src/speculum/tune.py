"""``speculum tune``: choose a method's parameters for this machine, these models and these prompts.

The search is the Ouroboros paper's heuristic one (Algorithm 1) as we read it: start from the
method's defaults, vary one parameter at a time over a short grid of values, keep a change only if
it makes generation faster, and sweep the parameters again until a sweep changes nothing.

How a candidate is scored, without timing noise where none is needed:

* **Acceptance by exact replay.** The target's greedy output for each tuning prompt is generated
  once; greedy verification accepts exactly the draft tokens that match it, so every candidate is
  run through the engine's own loop with the target replaced by that recorded output
  (:mod:`speculum.bench.replay`). This gives each step's tree size and accepted length exactly.
  Sampling (``temperature`` > 0) is tuned the same way on seeded requests: prompt i's reference is
  the text plain sampling gives with seed ``seed + i``, which every method gives too, and a draft
  token is accepted exactly when it is that text's token (the draft model samples its chain with
  the seed's noise, as in the real run).
  Ouroboros' verification phrases also read the target's predictions at rejected draft tokens,
  which no record holds: the replay computes those with the target (one forward at such a step,
  after a cache of the prompt + reference made once per prompt); the other drafters cost no
  target forward.
* **Cost by measurement.** The drafter runs for real, so its time (draft-model forwards, n-gram
  lookups) is measured. The target's cost is a verification-cost curve t(K) measured once on this
  machine (one forward over a K-node tree after a cache of a typical prompt length). The predicted
  time of a candidate is its drafting time + sum over steps of t(tree size) + the engine's own
  bookkeeping time.

The chosen parameters are then confirmed by a real timed run, interleaved per prompt with plain
decoding (and the method's defaults), and can be written to a config file that ``load``,
``generate`` and ``bench`` accept (:meth:`SpeculativeConfig.save`).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from speculum.bench.replay import ReplayRunner
from speculum.costs import CostModel
from speculum.errors import InvalidInputError
from speculum.methods import SpeculativeConfig, machine_defaults
from speculum.sampling import SamplingParams
from speculum.stats import Stats

# The parameters searched per method, in the order they are swept (the draft length first, as in
# the paper, then what shapes the tree). A user's own --param values stay fixed.
SEARCH_SPACES: dict[str, list[tuple[str, list[Any]]]] = {
    "draft_model": [
        ("length_policy", ["fixed", "heuristic", "confidence"]),
        ("num_speculative_tokens", [2, 3, 4, 5, 6, 8]),
        ("confidence_threshold", [0.2, 0.3, 0.4, 0.6]),
    ],
    "ouroboros": [
        ("num_speculative_tokens", [2, 3, 4, 5, 6, 8]),
        ("length_policy", ["fixed", "heuristic", "confidence"]),
        ("phrase_drafting", [True, False]),
        ("window_size", [0, 1, 2, 4, 8, 15]),
        ("draft_guesses", [None, 1, 2, 4]),
        ("ngram_size", [3, 4, 5, 6]),
        ("num_phrase_candidates", [0, 1, 2, 3, 5, 8]),
        ("guess_set_size", [2, 4, 8, 15]),
        ("context_phrases", [False, True]),
    ],
    "medusa": [
        ("tree_nodes", [4, 8, 12, 16, 24, 32, 48]),
        ("top_k", [4, 10]),
    ],
    "ctc": [
        ("tree_nodes", [4, 8, 12, 16, 24, 32, 48]),
        ("top_k", [2, 3, 4, 8]),
        ("candidates", [16, 32, 48, 96]),
        ("tree", ["first", "mass", "prefix"]),
    ],
    "anpd": [
        ("num_speculative_tokens", [3, 5, 7, 10]),
        ("max_ngram_size", [3, 4, 5, 6]),
        ("tree", [False, True]),
        ("max_tree_nodes", [8, 16, 32]),
        ("tree_top_k", [2, 3, 4]),
        ("min_agreement", [0.05, 0.1, 0.2, 0.3]),
    ],
}
TUNABLE = tuple(SEARCH_SPACES)

# Other starting points besides the method's defaults: the search starts from whichever scores best.
# One coordinate at a time cannot reach a setting that needs two changes together; Ouroboros'
# cheap phrase drafting does (no Jacobi window AND phrases from the context).
EXTRA_STARTS: dict[str, list[dict[str, Any]]] = {
    "ouroboros": [{"num_speculative_tokens": 4, "window_size": 0, "draft_guesses": 2, "context_phrases": True}],
}


@dataclass
class TunePrompt:
    ids: list[int]
    reference: list[int]  # the target's greedy output, or its seeded sampled text
    prefill_time: float
    plain_time: float  # plain decoding's wall time for the reference (measured once)
    hidden: Any = None  # the target's last hidden states over ids + reference (head drafters read them)
    seed: int | None = None  # the seed of a sampled reference
    # made on the first replay and reused: it keeps the target's cache over ids + reference
    replayer: ReplayRunner | None = field(default=None, repr=False)

    def replay(self, drafter, spec, sampling: SamplingParams | None = None) -> Stats:
        """Exact replay of ``drafter`` on this prompt (``spec``: the target, for drafters that read
        its outputs off the accepted path; ``sampling``: the reference's, with its seed)."""
        if self.replayer is None or self.replayer.sequence != self.ids + self.reference:
            self.replayer = ReplayRunner(self.ids, self.reference, self.hidden, spec.runner)
        return self.replayer.run(drafter, spec.eos_token_ids, sampling, self.seed)


def plain_seconds_per_token(prompts: list[TunePrompt]) -> float:
    """What plain decoding paid per token on ``prompts`` (the median): a lone one-token probe after a
    prefill reads high on some CPUs, and the plain baseline is predicted with this same number."""
    return statistics.median((p.plain_time - p.prefill_time) / max(len(p.reference), 1) for p in prompts)


@dataclass
class Evaluation:
    params: dict[str, Any]
    predicted_time: float
    new_tokens: int
    mean_acceptance_length: float
    draft_time: float
    # what the configuration did, step by step (tree sizes, accepted lengths, draft forwards): two
    # configurations that did the same thing cost the same, whatever their timings say
    trajectory: tuple = ()

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.predicted_time if self.predicted_time > 0 else 0.0


@dataclass
class TuneResult:
    method: str
    params: dict[str, Any]  # the chosen parameters (all of them that differ from the defaults, plus fixed ones)
    best: Evaluation
    start: Evaluation
    plain_predicted_tps: float
    trace: list[Evaluation] = field(default_factory=list)
    measured: dict[str, float] = field(default_factory=dict)  # confirmation run: label -> tokens/s
    cost_model: CostModel | None = None

    @property
    def config(self) -> SpeculativeConfig:
        return SpeculativeConfig.coerce(self.method, **self.params)


def _defaults(method: str, device_type: str | None = None, sampled: bool = False) -> dict[str, Any]:
    """Every parameter of ``method`` as a user gets it on ``device_type`` for greedy or ``sampled``
    requests (its measured setting there)."""
    options = SpeculativeConfig(method).options(device_type, sampled)
    return {f.name: getattr(options, f.name) for f in dataclasses.fields(options)}


def prepare_prompts(
    spec,
    prompt_ids: list[list[int]],
    max_new_tokens: int,
    hidden: bool = False,
    batch: int = 1,
    sampling: SamplingParams | None = None,
    seed: int = 0,
) -> list[TunePrompt]:
    """Each prompt's greedy reference, with plain decoding's timings (a one-prompt warm-up first);
    ``hidden``: also the target's hidden states over prompt + reference (one forward each).
    ``sampling`` (not greedy): prompt i's reference is plain sampling's text with seed ``seed + i``.

    ``batch`` > 1: the references come from the batched engine, that many prompts at a time (far
    faster on a big target), and no timings are taken (NaN): for acceptance studies only (greedy;
    sampled references are generated one at a time)."""
    sampling = sampling or SamplingParams()
    if batch > 1 and sampling.greedy:
        references = []
        for first in range(0, len(prompt_ids), batch):
            results = spec.generate(prompt_ids[first : first + batch], "autoregressive", max_new_tokens=max_new_tokens)
            references.extend(result.token_ids for result in results)
        prompts = [TunePrompt(ids, ref, math.nan, math.nan) for ids, ref in zip(prompt_ids, references, strict=True)]
    else:
        kw = _sampling_kwargs(sampling)
        seeds = [None if sampling.greedy else seed + i for i in range(len(prompt_ids))]
        spec.generate(prompt_ids[0], "autoregressive", max_new_tokens=min(8, max_new_tokens), seed=seeds[0], **kw)
        prompts = []
        for ids, request_seed in zip(prompt_ids, seeds, strict=True):
            result = spec.generate(ids, "autoregressive", max_new_tokens=max_new_tokens, seed=request_seed, **kw)
            stats = result.stats
            prompts.append(TunePrompt(ids, result.token_ids, stats.time_prefill, stats.wall_time, seed=request_seed))
    if hidden:
        runner = spec.runner
        for p in prompts:
            p.hidden = runner.prefill(runner.new_cache(), p.ids + p.reference, hidden=True)
    return prompts


class ReplayScorer:
    """Predicted tokens/s of a method's configurations on recorded prompts (see the module docstring).

    Each configuration gets a fresh drafter and a fresh pool, run over the prompts in order (so a
    pool kept across requests warms up over the sequence, as it would in service)."""

    def __init__(
        self,
        spec,
        method: str,
        prompts: list[TunePrompt],
        cost: CostModel,
        log=lambda _: None,
        sampling: SamplingParams | None = None,
    ):
        self.spec, self.method, self.prompts, self.cost, self.log = spec, method, prompts, cost, log
        self.sampling = sampling or SamplingParams()  # the references' (seeded, when not greedy)
        self.defaults = _defaults(method, getattr(spec, "device_type", None), not self.sampling.greedy)
        self.trace: list[Evaluation] = []
        self._cache: dict[tuple, Evaluation] = {}
        steps = sum(len(p.reference) for p in prompts)
        self.plain_tokens_per_second = steps / (sum(p.prefill_time for p in prompts) + steps * cost(1))

    def score(self, params: dict[str, Any], *, warm_up: list[TunePrompt] = ()) -> Evaluation | None:
        """None for a combination the method refuses; ``warm_up``: prompts run first, not scored."""
        try:
            config = SpeculativeConfig.coerce(self.method, **params)
        except InvalidInputError:
            return None
        key = (config.key(), tuple(id(p) for p in warm_up))
        if key in self._cache:
            return self._cache[key]
        # a fresh drafter and pool per candidate: one candidate's phrases must not warm another's
        resources = dataclasses.replace(self.spec.resources(), shared={})
        drafter = config.drafter_class()(config.options(), resources)
        for p in warm_up:
            p.replay(drafter, self.spec, self.sampling)
        total, tokens, draft_time, lengths, trajectory = 0.0, 0, 0.0, [], []
        for p in self.prompts:
            stats: Stats = p.replay(drafter, self.spec, self.sampling)
            model_time = sum(self.cost(size + 1) for size in stats.draft_sizes)
            total += p.prefill_time + stats.time_draft + stats.time_verify + stats.time_other + model_time
            tokens += stats.new_tokens
            draft_time += stats.time_draft
            lengths.extend(stats.accept_lengths)
            trajectory.append((tuple(stats.draft_sizes), tuple(stats.accept_lengths), stats.draft_forwards))
        mean_length = sum(lengths) / max(len(lengths), 1)
        ev = Evaluation(dict(params), total, tokens, mean_length, draft_time, tuple(trajectory))
        self._cache[key] = ev
        self.trace.append(ev)
        speedup = ev.tokens_per_second / self.plain_tokens_per_second
        self.log(
            f"  {_describe(params, self.defaults)}: {ev.tokens_per_second:.2f} tok/s predicted (×{speedup:.2f}), "
            f"acceptance length {ev.mean_acceptance_length:.2f}"
        )
        return ev


def best_change(best: Evaluation, tried: list[tuple[Any, Evaluation]], min_gain: float):
    """The value of one parameter to move to, with its evaluation, or None: the best of ``tried``
    when it predicts at least ``min_gain`` (relative) more tokens/s than ``best``. Every value is
    compared, not the first to clear the bar: that made the choice depend on the values' order."""
    if not tried:
        return None
    value, ev = max(tried, key=lambda pair: pair[1].tokens_per_second)
    return (value, ev) if ev.tokens_per_second > best.tokens_per_second * (1 + min_gain) else None


def tune(
    spec,
    method: str,
    prompt_ids: list[list[int]],
    *,
    max_new_tokens: int = 64,
    fixed: dict[str, Any] | None = None,
    max_sweeps: int = 3,
    min_gain: float = 0.05,
    confirm: bool = True,
    sampling: SamplingParams | None = None,
    seed: int = 0,
    log: Callable[[str], None] = lambda _: None,
) -> TuneResult:
    """Search ``method``'s parameters on ``prompt_ids``, greedy or under ``sampling`` (seeded
    requests: prompt i's seed is ``seed + i``); see the module docstring.

    ``fixed``: parameters not searched. A change is kept when it predicts at least ``min_gain``
    (relative) more tokens/s. ``confirm``: time the choice against plain decoding and the defaults.
    """
    sampling = sampling or SamplingParams()
    if method not in SEARCH_SPACES:
        raise InvalidInputError(f"speculum tune supports {', '.join(TUNABLE)}; got {method!r}")
    if not prompt_ids:
        raise InvalidInputError("no prompts to tune on")
    fixed = dict(fixed or {})
    SpeculativeConfig.coerce(method, **fixed)  # refuse bad fixed values before any model work
    cls = SpeculativeConfig(method).drafter_class()
    if getattr(cls, "needs_draft_model", False) and spec.draft_model is None:
        raise InvalidInputError(f"method {method!r} needs a draft model: pass --draft (a model or self:N)")

    log("plain decoding: " + ("greedy references" if sampling.greedy else "seeded sampled references") + " and timings")
    prompts = prepare_prompts(spec, prompt_ids, max_new_tokens, cls.wants_hidden_states, sampling=sampling, seed=seed)
    typical = sorted(prompts, key=lambda p: len(p.ids))[len(prompts) // 2]
    log("measuring the target's verification cost t(K)")
    cost = CostModel.measure(spec.runner, typical.ids + typical.reference[: max_new_tokens // 2], reps=5)
    cost = cost.with_plain_step(plain_seconds_per_token(prompts))
    log("t(K): " + ", ".join(f"K={k} {t * 1000:.1f} ms" for k, t in cost.points))

    scorer = ReplayScorer(spec, method, prompts, cost, log=log, sampling=sampling)
    defaults = scorer.defaults
    plain = {k: v for k, v in defaults.items() if k != "pool_path"}
    start = scorer.score({**plain, **fixed})
    if start is None:
        raise InvalidInputError(f"the starting parameters of {method!r} are invalid: {fixed}")
    current, best = {**plain, **fixed}, start
    for extra in EXTRA_STARTS.get(method, []):
        ev = scorer.score({**plain, **extra, **fixed})
        if ev is not None and ev.trajectory != best.trajectory and ev.tokens_per_second > best.tokens_per_second:
            current, best = {**plain, **extra, **fixed}, ev
    space = [(name, values) for name, values in SEARCH_SPACES[method] if name not in fixed and name in defaults]
    for sweep in range(max_sweeps):
        log(f"sweep {sweep + 1}")
        changed = False
        for name, values in space:
            tried = []
            for value in values:
                if value == current[name]:
                    continue
                ev = scorer.score({**current, name: value})
                if ev is None or ev.trajectory == best.trajectory:
                    continue  # refused, or no change in what the drafter does (e.g. W with phrase drafting off)
                tried.append((value, ev))
            change = best_change(best, tried, min_gain)
            if change is not None:
                current, best, changed = {**current, name: change[0]}, change[1], True
        if not changed:
            break

    measured = machine_defaults(method, getattr(spec, "device_type", None), not scorer.sampling.greedy)
    chosen = chosen_params(current, defaults, fixed, measured)
    result = TuneResult(method, chosen, best, start, scorer.plain_tokens_per_second, scorer.trace, cost_model=cost)
    if confirm:
        log("confirming with a timed run (interleaved with plain decoding)")
        result.measured = confirm_timing(spec, method, chosen, fixed, prompts, max_new_tokens, sampling)
    return result


def chosen_params(
    current: dict[str, Any], defaults: dict[str, Any], fixed: dict[str, Any], measured: dict[str, Any]
) -> dict[str, Any]:
    """What a config file must give to load as ``current``: the parameters fixed or unlike the
    defaults; and since a config that gives any parameter of the machine's ``measured`` setting
    replaces that setting whole (:meth:`SpeculativeConfig.options`), then all of them."""
    chosen = {k: v for k, v in current.items() if k in fixed or v != defaults.get(k)}
    if set(chosen) & set(measured):
        chosen.update({k: current[k] for k in measured})
    return chosen


def confirm_timing(
    spec, method, chosen, fixed, prompts: list[TunePrompt], max_new_tokens: int, sampling: SamplingParams | None = None
) -> dict[str, float]:
    """Tokens/s of plain decoding, the method's defaults and the chosen parameters, interleaved per
    prompt (sampled with each prompt's seed where ``sampling`` is not greedy)."""
    kw = _sampling_kwargs(sampling or SamplingParams())
    # "defaults" are the published ones the search starts from; each setting keeps its own pools, so
    # that one never reads phrases another harvested from the same prompt's output
    runs = {
        "autoregressive": SpeculativeConfig("autoregressive"),
        "defaults": SpeculativeConfig.coerce(method, **{"preset": "paper", **fixed}),
        "tuned": SpeculativeConfig.coerce(method, **chosen),
    }
    spec.pools_per_config = True
    times = dict.fromkeys(runs, 0.0)
    tokens = dict.fromkeys(runs, 0)
    labels = list(runs)
    for config in runs.values():  # warm-up
        spec.generate(prompts[0].ids, config, max_new_tokens=min(8, max_new_tokens), seed=prompts[0].seed, **kw)
    for i, p in enumerate(prompts):
        for label in labels[i % len(labels) :] + labels[: i % len(labels)]:
            result = spec.generate(p.ids, runs[label], max_new_tokens=max_new_tokens, seed=p.seed, **kw)
            times[label] += result.stats.wall_time
            tokens[label] += len(result.token_ids)
    return {label: tokens[label] / times[label] for label in labels if times[label] > 0}


def _sampling_kwargs(sampling: SamplingParams) -> dict[str, Any]:
    """``spec.generate``'s keywords for ``sampling`` (none for greedy)."""
    if sampling.greedy:
        return {}
    return dict(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k)


def _describe(params: dict[str, Any], defaults: dict[str, Any]) -> str:
    changed = {k: v for k, v in params.items() if v != defaults.get(k)}
    return ", ".join(f"{k}={v}" for k, v in changed.items()) or "defaults"


def describe_params(params: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in params.items()) or "(defaults)"
