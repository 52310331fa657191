"""Run methods side by side on the same prompts, time them and check losslessness.

Methods are interleaved per prompt in one process: for prompt i every method runs once, in the
order of row i of a balanced Latin square (``interleaved_order``), so slow drift of the machine
(thermal, other load) spreads over all methods instead of landing on whichever ran last.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tqdm.auto import tqdm

from speculum.bench import report
from speculum.bench.datasets import Prompt, load_datasets
from speculum.bench.generations import RECORD_KEYS, hf_generate_kwargs, run_speculum, run_transformers
from speculum.bench.method_specs import (
    DEFAULT_METHODS,
    HF_METHODS,
    MethodSpec,
    parse_method_spec,
    parse_methods,
)
from speculum.errors import InvalidInputError


def interleaved_order(methods: Sequence[Any], prompt_index: int) -> list[Any]:
    """The method order for prompt ``prompt_index``: a row of a balanced Latin square (Williams'
    design). Over ``len(methods)`` consecutive prompts (twice that for an odd number of methods)
    every method runs once in every position and right after every other method equally often.

    A plain rotation balances positions only: each method would always run right after the same
    one, and the row after transformers' assisted generation (which runs the stock model, a second
    copy of the weights) would pay for that in every prompt."""
    n = len(methods)
    if n <= 2:
        r = prompt_index % n if n else 0
        return list(methods[r:]) + list(methods[:r])
    first, low, high = [0], 1, n - 1  # 0, 1, n-1, 2, n-2, ...: each difference between neighbours once
    while len(first) < n:
        if len(first) % 2:
            first.append(low)
            low += 1
        else:
            first.append(high)
            high -= 1
    k = prompt_index % (n if n % 2 == 0 else 2 * n)
    order = [(j + k) % n for j in first]
    if k >= n:  # odd n: the mirrored square balances the neighbours the first one repeats
        order.reverse()
    return [methods[j] for j in order]


@dataclass
class BenchResult:
    records: list[dict]
    methods: list[str]  # row labels, in the order given
    baseline: str | None
    datasets: list[str]
    meta: dict = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)  # method label -> the error that stopped it
    notes: list[str] = field(default_factory=list)

    def summary(self) -> dict:
        return report.summarize(self)

    def to_markdown(self) -> str:
        return report.to_markdown(self.summary())

    def write(self, out_dir) -> dict[str, str]:
        return report.write_result(self, out_dir)


def compare_tokens(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token, or None when equal (a prefix differs at the shorter length)."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return None if len(a) == len(b) else n


def _tokenizer_has_chat_template(spec) -> bool:
    tok = getattr(spec, "tokenizer", None)
    return bool(getattr(tok, "chat_template", None))


def run_bench(
    spec,
    datasets: Iterable[str] | str | dict[str, list[Prompt]],
    methods: Iterable[str | MethodSpec] | str = DEFAULT_METHODS,
    *,
    limit: int | None = 10,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | None = None,
    warmup: int = 1,
    chat: bool | None = None,
    check_lossless: bool = True,
    compare_transformers: bool = False,
    draft: str | None = None,
    progress: bool = True,
    fail_fast: bool = False,
    on_prompt: Callable[[list[dict]], None] | None = None,
    previous: Sequence[dict] = (),
    meta: dict | None = None,
) -> BenchResult:
    """Run every method on every prompt (interleaved per prompt) and return the records.

    ``spec``: what ``speculum.load`` returns. ``datasets``: names/paths, or prompts already loaded
    (``{name: [Prompt, ...]}``). ``methods``: spec strings (``"anpd:num_speculative_tokens=5"``) or
    :class:`MethodSpec`. ``compare_transformers`` adds the ``hf_*`` rows. ``draft``: the draft string
    given to ``load`` (``"self:N"`` makes ``hf_assisted`` use ``assistant_early_exit=N``).
    ``chat``: None = per dataset default (chat when the tokenizer has a chat template, except
    HumanEval). ``fail_fast``: re-raise a method's error instead of recording it and dropping the method.
    ``on_prompt``: called with a prompt's records (in the methods' order) as soon as its methods have
    all run. ``previous``: records of an interrupted run of the same settings: the prompts they hold
    are not run again and the records lead the result (``speculum bench --resume``).
    """
    notes: list[str] = []
    mspecs, hf_kwargs = _applicable_rows(_method_rows(methods, compare_transformers), spec, draft, notes)
    labels = [m.label for m in mspecs]
    configs = {m.label: m.to_config() for m in mspecs if not m.is_transformers}
    baseline = _baseline(mspecs)
    greedy = not temperature or temperature <= 0
    if baseline is None:
        notes.append("no baseline (autoregressive or hf_generate) among the methods: no speedup, no equality check")
    do_check = _lossless_check(check_lossless, greedy, seed, baseline, mspecs, notes)
    prompts = _load_prompts(datasets, limit)
    has_template = _tokenizer_has_chat_template(spec)
    if chat and not has_template:
        raise InvalidInputError("--chat asked for, but the tokenizer has no chat template")

    all_prompts = [p for ps in prompts.values() for p in ps]
    records: list[dict] = list(previous)
    done = {(r["dataset"], str(r["question_id"])) for r in previous}
    todo = [p for p in all_prompts if (p.dataset, str(p.question_id)) not in done]
    if done:
        notes.append(f"resumed: {len(all_prompts) - len(todo)} of {len(all_prompts)} prompts from the earlier run")
    sampling = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k)
    total = len(todo) * len(mspecs) + (warmup * len(mspecs) if todo else 0)
    bar = tqdm(total=total, disable=not progress, unit="gen", dynamic_ncols=True)
    rows = _Rows(spec, mspecs, hf_kwargs, configs, sampling, fail_fast, bar)
    try:
        if todo and warmup > 0:
            rows.warm_up(spec.encode_prompt(todo[0].render(_use_chat(todo[0], chat, has_template))), warmup, seed)
        for i, p in enumerate(all_prompts):  # i: the prompt's place in the whole run (its seed, its order)
            if (p.dataset, str(p.question_id)) in done:
                continue
            ids = spec.encode_prompt(p.render(_use_chat(p, chat, has_template)))
            by_method = rows.run_prompt(p, ids, i, None if seed is None else seed + i, baseline)
            base = by_method.get(baseline) if do_check else None
            prompt_records = _in_given_order(by_method, mspecs, base, greedy)
            records.extend(prompt_records)
            if on_prompt is not None and prompt_records:
                on_prompt(prompt_records)
    finally:
        bar.close()

    settings = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                    warmup=warmup, limit=limit, chat=chat, check_lossless=do_check)  # fmt: skip
    meta = {**(meta or {}), **settings, "prompts": {k: len(v) for k, v in prompts.items()}}
    return BenchResult(records, labels, baseline, list(prompts), meta, rows.errors, notes)


def _method_rows(methods: Iterable[str | MethodSpec] | str, compare_transformers: bool) -> list[MethodSpec]:
    """The rows asked for, then transformers' own rows not among them where ``compare_transformers``."""
    if isinstance(methods, str):
        mspecs = parse_methods(methods)
    else:
        mspecs = [m if isinstance(m, MethodSpec) else parse_method_spec(m) for m in methods]
    labels = [m.label for m in mspecs]
    if compare_transformers:
        for name in HF_METHODS:
            if name not in labels:
                mspecs.append(MethodSpec(name, name, {}))
                labels.append(name)
    return mspecs


def _applicable_rows(
    mspecs: list[MethodSpec], spec, draft: str | None, notes: list[str]
) -> tuple[list[MethodSpec], dict[str, dict]]:
    """The rows that apply, and each transformers row's ``generate`` kwargs. A transformers row that
    does not apply (hf_assisted without a draft model) is dropped with a note."""
    hf_kwargs: dict[str, dict] = {}
    kept = []
    for m in mspecs:
        if m.is_transformers:
            kw = hf_generate_kwargs(m, spec, draft)
            if kw is None:
                notes.append(f"{m.label}: skipped (no separate draft model loaded and no self:N draft)")
                continue
            hf_kwargs[m.label] = kw
        kept.append(m)
    return kept, hf_kwargs


def _baseline(mspecs: list[MethodSpec]) -> str | None:
    """The row the others are timed and checked against: plain autoregressive (without parameters
    first), else transformers' generate."""
    baseline = next((m.label for m in mspecs if m.name == "autoregressive" and not m.params), None)
    baseline = baseline or next((m.label for m in mspecs if m.name == "autoregressive"), None)
    return baseline or next((m.label for m in mspecs if m.name == "hf_generate"), None)


def _lossless_check(
    check_lossless: bool, greedy: bool, seed: int | None, baseline: str | None, mspecs: list[MethodSpec], notes
) -> bool:
    """Whether outputs are compared with the baseline's token by token (a note says why not when sampling)."""
    by_label = {m.label: m for m in mspecs}
    # a seeded sample is the seed's text whatever speculum drafts (PositionNoise): checked like greedy
    # output, for speculum's methods against speculum's plain decoding (transformers samples otherwise)
    seeded_check = not greedy and seed is not None and baseline is not None and not by_label[baseline].is_transformers
    if check_lossless and not greedy:
        notes.append(
            "temperature > 0 with a seed: speculum's outputs are checked against plain decoding's seeded text"
            if seeded_check
            else "temperature > 0 without a seed: outputs are samples, so the token-equality check is skipped"
        )
    return check_lossless and baseline is not None and (greedy or seeded_check)


def _load_prompts(
    datasets: Iterable[str] | str | dict[str, list[Prompt]], limit: int | None
) -> dict[str, list[Prompt]]:
    prompts = datasets if isinstance(datasets, dict) else load_datasets(datasets, limit)
    if isinstance(datasets, dict) and limit is not None:
        prompts = {k: v[:limit] for k, v in prompts.items()}
    return prompts


def _use_chat(p: Prompt, chat: bool | None, has_template: bool) -> bool:
    return chat if chat is not None else (p.chat_default and has_template)


def _in_given_order(
    by_method: dict[str, dict], mspecs: list[MethodSpec], base: dict | None, greedy: bool
) -> list[dict]:
    """A prompt's records in the methods' given order, whatever order they ran in; each compared with
    ``base`` (the baseline's record, when checked): transformers' samples are not."""
    prompt_records = []
    for m in mspecs:
        rec = by_method.get(m.label)
        if rec is None:
            continue
        if base is not None and (greedy or not m.is_transformers):
            fm = compare_tokens(rec["token_ids"], base["token_ids"])
            rec["equal_to_baseline"] = fm is None
            rec["first_mismatch"] = fm
        prompt_records.append(rec)
    return prompt_records


class _Rows:
    """Runs the bench's rows on a prompt, one after another; a row that raises is dropped for the rest
    of the run, its error recorded (re-raised with ``fail_fast``)."""

    def __init__(self, spec, mspecs: list[MethodSpec], hf_kwargs: dict, configs: dict, sampling: dict, fail_fast, bar):
        self.spec = spec
        self.mspecs = mspecs
        self.hf_kwargs = hf_kwargs  # transformers rows: their generate kwargs
        self.configs = configs  # speculum's rows: their SpeculativeConfig
        self.sampling = sampling  # max_new_tokens, temperature, top_p, top_k
        self.fail_fast = fail_fast
        self.errors: dict[str, str] = {}  # method label -> the error that stopped it
        self.dead: set[str] = set()
        self.bar = bar  # the progress bar (tqdm)

    def run_one(self, m: MethodSpec, ids: list[int], seed: int | None) -> dict:
        kw = dict(**self.sampling, seed=seed)
        if m.is_transformers:
            return run_transformers(self.spec, ids, self.hf_kwargs[m.label], **kw)
        return run_speculum(self.spec, ids, self.configs[m.label], **kw)

    def fail(self, m: MethodSpec, e: Exception) -> None:
        if self.fail_fast:
            raise e
        self.errors[m.label] = f"{type(e).__name__}: {e}"
        self.dead.add(m.label)
        self.bar.write(f"[bench] {m.label} failed and is dropped: {self.errors[m.label]}")

    def warm_up(self, ids: list[int], times: int, seed: int | None) -> None:
        """Each row ``times`` times on ``ids`` (the first prompt to run), not recorded."""
        for m in self.mspecs:
            for _ in range(times):
                self.bar.set_description(f"warm-up {m.label}")
                if m.label not in self.dead:
                    try:
                        self.run_one(m, ids, seed)
                    except Exception as e:  # noqa: BLE001 - recorded, see fail()
                        self.fail(m, e)
                self.bar.update(1)

    def run_prompt(self, p: Prompt, ids: list[int], index: int, seed: int | None, baseline: str | None) -> dict:
        """Every live row on prompt ``p`` (number ``index`` of the run) in its interleaved order: label -> record."""
        by_method: dict[str, dict] = {}
        for m in interleaved_order(self.mspecs, index):
            self.bar.set_description(f"{p.dataset} {p.question_id} {m.label}")
            if m.label in self.dead:
                self.bar.update(1)
                continue
            try:
                out = self.run_one(m, ids, seed)
            except Exception as e:  # noqa: BLE001 - recorded, see fail()
                self.fail(m, e)
                self.bar.update(1)
                continue
            rec = {k: None for k in RECORD_KEYS}
            rec.update(out)
            rec.update(dataset=p.dataset, question_id=p.question_id, category=p.category, method=m.label)
            rec["prompt_tokens"] = len(ids)
            if m.label == baseline:
                rec["prompt_ids"] = ids  # with the baseline's token_ids: enough to replay drafters offline
            by_method[m.label] = rec
            self.bar.update(1)
        return by_method
