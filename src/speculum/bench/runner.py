"""Run methods side by side on the same prompts, time them and check losslessness.

Methods are interleaved per prompt in one process: for prompt i every method runs once, in the
method order rotated by i, so slow drift of the machine (thermal, other load) spreads over all
methods instead of landing on whichever ran last.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from speculum.bench.datasets import Prompt, load_datasets
from speculum.errors import InvalidInputError, SpeculumError
from speculum.sampling import SamplingParams

HF_METHODS = ("hf_generate", "hf_assisted", "hf_prompt_lookup")
BASELINE_METHODS = ("autoregressive", "hf_generate")
DEFAULT_METHODS = "autoregressive,prompt_lookup"

# ----------------------------------------------------------------------------------------------
# method specs: "name" or "name:key=value,key=value"


@dataclass(frozen=True)
class MethodSpec:
    label: str  # the spec string as given (the row label)
    name: str
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def is_transformers(self) -> bool:
        return self.name in HF_METHODS

    def to_config(self):
        """The ``SpeculativeConfig`` for a speculum method."""
        from speculum import SpeculativeConfig  # the lead's API; imported late on purpose

        try:
            return SpeculativeConfig(method=self.name, **self.params)
        except SpeculumError:
            raise
        except (TypeError, ValueError) as e:
            raise InvalidInputError(f"method {self.label!r}: {e}") from None


def parse_value(text: str) -> Any:
    """``"5"`` -> 5, ``"0.5"`` -> 0.5, ``"true"``/``"false"`` -> bool, ``"none"`` -> None, else the string."""
    t = text.strip()
    low = t.lower()
    if low in ("true", "yes", "on"):
        return True
    if low in ("false", "no", "off"):
        return False
    if low in ("none", "null"):
        return None
    try:
        return int(t)
    except ValueError:
        pass
    try:
        return float(t)
    except ValueError:
        return t


def parse_method_spec(spec: str, known: Iterable[str] | None = None) -> MethodSpec:
    """Parse ``name``, ``name:key=value,key=value`` (``-`` in keys reads as ``_``) or the path of a
    config file (``tuned.json``, from ``speculum tune --out``), each optionally followed by ``#tag``:
    a row of its own that runs the same method again (``autoregressive#2`` beside ``autoregressive``
    measures the run's noise floor: an A/A comparison).

    ``known``: the accepted method names (speculum's plus :data:`HF_METHODS`); ``None`` skips that check.
    """
    label = spec.strip()
    if not label:
        raise InvalidInputError("empty method spec")
    body, hash_sign, tag = label.rpartition("#")
    if hash_sign:
        if not body.strip() or not tag.replace("-", "").replace("_", "").isalnum():
            raise InvalidInputError(
                f"method spec {label!r}: a tag after '#' is letters, digits, '-' or '_' (e.g. autoregressive#2)"
            )
    else:
        body = label
    body = body.strip()
    if body.endswith(".json"):  # a config file from `speculum tune --out` (optionally written @file.json)
        from speculum.methods import SpeculativeConfig

        config = SpeculativeConfig.from_file(body.removeprefix("@"))
        return MethodSpec(label, config.method, config.all_params())
    name, sep, rest = body.partition(":")
    name = name.strip()
    if not name:
        raise InvalidInputError(f"method spec {label!r} has no method name")
    params: dict[str, Any] = {}
    if sep and not rest.strip():
        raise InvalidInputError(f"method spec {label!r}: nothing after ':' (expected key=value,...)")
    if rest.strip():
        for item in rest.split(","):
            key, eq, value = item.partition("=")
            key = key.strip().replace("-", "_")
            if not eq or not key or not value.strip():
                raise InvalidInputError(
                    f"method spec {label!r}: bad parameter {item.strip()!r} (expected key=value, "
                    "e.g. anpd:num_speculative_tokens=5,tree=true)"
                )
            if not key.isidentifier():
                raise InvalidInputError(f"method spec {label!r}: bad parameter name {key!r}")
            if key in params:
                raise InvalidInputError(f"method spec {label!r}: parameter {key!r} given twice")
            params[key] = parse_value(value)
    if known is not None:
        known = list(known)
        if name not in known:
            raise InvalidInputError(f"unknown method {name!r} in {label!r}; known methods: {', '.join(known)}")
    return MethodSpec(label, name, params)


def split_method_specs(text: str | Iterable[str]) -> list[str]:
    """Split ``"a,b:k=1,j=2,c"`` into ``["a", "b:k=1,j=2", "c"]``.

    A comma followed by ``key=`` continues the previous spec's parameters; any other comma starts a
    new spec. Repeated options (a list of strings) are split the same way and concatenated.
    """
    if not isinstance(text, str):
        out: list[str] = []
        for t in text:
            out.extend(split_method_specs(t))
        return out
    specs: list[str] = []
    for part in text.split(","):
        p = part.strip()
        if specs and ":" in specs[-1] and "=" in p and ":" not in p.split("=", 1)[0]:
            specs[-1] = f"{specs[-1]},{p}"
        elif p:
            specs.append(p)
        else:
            raise InvalidInputError(f"empty method name in {text!r}")
    return specs


def known_methods() -> list[str]:
    """speculum's registered methods (when the API is importable) plus the transformers rows."""
    try:
        import speculum

        names = list(speculum.METHODS)
    except (ImportError, AttributeError):
        return []
    return names + [m for m in HF_METHODS if m not in names]


def parse_methods(text: str | Iterable[str], known: Iterable[str] | None = None) -> list[MethodSpec]:
    specs = [parse_method_spec(s, known) for s in split_method_specs(text)]
    labels = [s.label for s in specs]
    dup = {x for x in labels if labels.count(x) > 1}
    if dup:
        raise InvalidInputError(f"method given twice: {', '.join(sorted(dup))}")
    if not specs:
        raise InvalidInputError("no method given")
    return specs


def interleaved_order(methods: Sequence[Any], prompt_index: int) -> list[Any]:
    """The method order for prompt ``prompt_index``: a row of a balanced Latin square (Williams'
    design). Over ``len(methods)`` consecutive prompts (twice that for an odd number of methods)
    every method runs once in every position and right after every other method equally often.

    A rotation of the list was balanced by position only: each method always ran right after the
    same one. The row after transformers' assisted generation (which runs the stock model, a
    second copy of the weights) paid for it in every prompt (issue #18: `draft_model`'s target
    forwards cost 1.12 plain steps, and 1.04-1.05 in the rows after speculum's own)."""
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


# ----------------------------------------------------------------------------------------------
# results


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
        from speculum.bench.report import summarize

        return summarize(self)

    def to_markdown(self) -> str:
        from speculum.bench.report import to_markdown

        return to_markdown(self.summary())

    def write(self, out_dir) -> dict[str, str]:
        from speculum.bench.report import write_result

        return write_result(self, out_dir)


# ----------------------------------------------------------------------------------------------
# running one generation


RECORD_KEYS = (
    "dataset",
    "question_id",
    "category",
    "method",
    "prompt_tokens",
    "new_tokens",
    "wall_time",
    "accept_lengths",
    "tokens_per_second",
    "mean_acceptance_length",
    "draft_acceptance_rate",
    "target_forwards",
    "draft_forwards",
    "drafted_tokens",
    "accepted_tokens",
    "time_prefill",
    "time_draft",
    "time_draft_catch_up",
    "time_verify",
    "time_other",
    "draft_sizes",
    "rounds_drafted",
    "rounds_plain",
    "nodes_pruned",
    "rounds_explored",
    "chains_stopped",
    "time_control",
    "accepted_by",
    "equal_to_baseline",
    "first_mismatch",
    "token_ids",
)


def hf_generate_kwargs(method: MethodSpec, spec, draft: str | None) -> dict | None:
    """transformers' ``generate`` kwargs for a transformers row; None when the row does not apply."""
    kw: dict[str, Any] = {}
    if method.name == "hf_assisted":
        if draft and str(draft).startswith("self:"):
            try:
                kw["assistant_early_exit"] = int(str(draft).split(":", 1)[1])
            except ValueError:
                return None
        elif getattr(spec, "draft_model", None) is not None and spec.draft_model is not spec.model:
            kw["assistant_model"] = spec.draft_model
        else:
            return None
    elif method.name == "hf_prompt_lookup":
        kw["prompt_lookup_num_tokens"] = 10
    kw.update(method.params)
    return kw


def run_transformers(
    spec, ids: list[int], extra: dict, *, max_new_tokens: int, temperature: float, top_p: float, top_k: int, seed
) -> dict:
    """One ``spec.model.generate`` call, timed; transformers' own defaults for everything not set here."""
    import torch

    model = spec.model
    device = getattr(model, "device", None) or "cpu"
    input_ids = torch.tensor([ids], dtype=torch.long, device=device)
    gc = getattr(model, "generation_config", None)
    eos_set = spec.eos_token_ids  # the engine's own stopping rule, so both sides stop at the same token
    eos = sorted(eos_set) or None
    pad = getattr(gc, "pad_token_id", None) if gc is not None else None
    if pad is None:
        pad = eos[0] if eos else None
    kw: dict[str, Any] = dict(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_new_tokens,
        pad_token_id=pad,
        eos_token_id=eos,
    )
    if temperature and temperature > 0:
        kw.update(do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k or 0)
        if seed is not None:
            torch.manual_seed(seed)
    else:
        kw.update(do_sample=False, temperature=None, top_p=None, top_k=None)
    kw.update(extra)
    from speculum.accel import unpacked

    # transformers' rows run on the stock model: undo speculum's weight prepacking (not timed).
    with unpacked(model, getattr(spec, "draft_model", None)), torch.inference_mode():
        t0 = time.perf_counter()
        out = model.generate(**kw)
        wall = time.perf_counter() - t0
    new = out[0, input_ids.shape[1] :].tolist()
    for i, t in enumerate(new):
        if t in eos_set:
            new = new[: i + 1]
            break
    rec: dict[str, Any] = {
        "new_tokens": len(new),
        "wall_time": wall,
        "token_ids": new,
        "tokens_per_second": len(new) / wall if wall > 0 else None,
    }
    if not extra:  # plain decoding: one target forward per token
        rec["target_forwards"] = len(new)
        rec["mean_acceptance_length"] = 1.0 if new else None
    return rec


def run_speculum(
    spec, ids: list[int], config, *, max_new_tokens: int, temperature: float, top_p: float, top_k: int, seed
) -> dict:
    t0 = time.perf_counter()
    result = spec.generate(
        ids,
        method=config,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
    )
    outer = time.perf_counter() - t0
    stats = result.stats.to_dict() if hasattr(result.stats, "to_dict") else dict(result.stats)
    rec = {k: stats.get(k) for k in RECORD_KEYS if k in stats}
    token_ids = list(result.token_ids)
    rec["token_ids"] = token_ids
    rec["new_tokens"] = stats.get("new_tokens", len(token_ids))
    # the same clock as the transformers rows: perf_counter around the whole call (prefill included)
    rec["engine_wall_time"] = stats.get("wall_time")
    rec["wall_time"] = outer
    rec["tokens_per_second"] = rec["new_tokens"] / outer if outer > 0 else None
    for k in ("discard_rate", "verification_rate", "stop_reason"):
        if k in stats:
            rec[k] = stats[k]
    drafter = spec.drafter_for(config, not SamplingParams(temperature).greedy) if hasattr(spec, "drafter_for") else None
    drafter_stats = drafter.request_stats() if drafter is not None else {}
    if drafter_stats:
        rec["drafter"] = drafter_stats
    return rec


def compare_tokens(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token, or None when equal (a prefix differs at the shorter length)."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return None if len(a) == len(b) else n


# ----------------------------------------------------------------------------------------------
# the bench


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
    from tqdm.auto import tqdm

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
    notes: list[str] = []
    errors: dict[str, str] = {}

    # transformers rows that do not apply (hf_assisted without a draft model) are dropped with a note
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
    mspecs = kept
    labels = [m.label for m in mspecs]
    by_label = {m.label: m for m in mspecs}
    configs = {m.label: m.to_config() for m in mspecs if not m.is_transformers}

    baseline = next((m.label for m in mspecs if m.name == "autoregressive" and not m.params), None)
    baseline = baseline or next((m.label for m in mspecs if m.name == "autoregressive"), None)
    baseline = baseline or next((m.label for m in mspecs if m.name == "hf_generate"), None)
    greedy = not temperature or temperature <= 0
    if baseline is None:
        notes.append("no baseline (autoregressive or hf_generate) among the methods: no speedup, no equality check")
    # a seeded sample is the seed's text whatever speculum drafts (PositionNoise): checked like greedy
    # output, for speculum's methods against speculum's plain decoding (transformers samples otherwise)
    seeded_check = not greedy and seed is not None and baseline is not None and not by_label[baseline].is_transformers
    if check_lossless and not greedy:
        notes.append(
            "temperature > 0 with a seed: speculum's outputs are checked against plain decoding's seeded text"
            if seeded_check
            else "temperature > 0 without a seed: outputs are samples, so the token-equality check is skipped"
        )
    do_check = check_lossless and baseline is not None and (greedy or seeded_check)

    prompts = datasets if isinstance(datasets, dict) else load_datasets(datasets, limit)
    if isinstance(datasets, dict) and limit is not None:
        prompts = {k: v[:limit] for k, v in prompts.items()}
    has_template = _tokenizer_has_chat_template(spec)
    if chat and not has_template:
        raise InvalidInputError("--chat asked for, but the tokenizer has no chat template")

    def use_chat(p: Prompt) -> bool:
        return chat if chat is not None else (p.chat_default and has_template)

    def run_one(m: MethodSpec, ids: list[int], s) -> dict:
        kw = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=s)
        if m.is_transformers:
            return run_transformers(spec, ids, hf_kwargs[m.label], **kw)
        return run_speculum(spec, ids, configs[m.label], **kw)

    all_prompts = [p for ps in prompts.values() for p in ps]
    records: list[dict] = list(previous)
    done = {(r["dataset"], str(r["question_id"])) for r in previous}
    todo = [p for p in all_prompts if (p.dataset, str(p.question_id)) not in done]
    if done:
        notes.append(f"resumed: {len(all_prompts) - len(todo)} of {len(all_prompts)} prompts from the earlier run")
    bar = tqdm(
        total=len(todo) * len(mspecs) + (warmup * len(mspecs) if todo else 0),
        disable=not progress,
        unit="gen",
        dynamic_ncols=True,
    )
    dead: set[str] = set()

    def fail(m: MethodSpec, e: Exception) -> None:
        if fail_fast:
            raise e
        errors[m.label] = f"{type(e).__name__}: {e}"
        dead.add(m.label)
        bar.write(f"[bench] {m.label} failed and is dropped: {errors[m.label]}")

    try:
        if todo and warmup > 0:
            p0 = todo[0]
            ids0 = spec.encode_prompt(p0.render(use_chat(p0)))
            for m in mspecs:
                for _ in range(warmup):
                    bar.set_description(f"warm-up {m.label}")
                    if m.label not in dead:
                        try:
                            run_one(m, ids0, seed)
                        except Exception as e:  # noqa: BLE001 - recorded, see fail()
                            fail(m, e)
                    bar.update(1)

        for i, p in enumerate(all_prompts):  # i: the prompt's place in the whole run (its seed, its order)
            if (p.dataset, str(p.question_id)) in done:
                continue
            ids = spec.encode_prompt(p.render(use_chat(p)))
            s = None if seed is None else seed + i
            by_method: dict[str, dict] = {}
            for m in interleaved_order(mspecs, i):
                bar.set_description(f"{p.dataset} {p.question_id} {m.label}")
                if m.label in dead:
                    bar.update(1)
                    continue
                try:
                    out = run_one(m, ids, s)
                except Exception as e:  # noqa: BLE001 - recorded, see fail()
                    fail(m, e)
                    bar.update(1)
                    continue
                rec = {k: None for k in RECORD_KEYS}
                rec.update(out)
                rec.update(dataset=p.dataset, question_id=p.question_id, category=p.category, method=m.label)
                rec["prompt_tokens"] = len(ids)
                if m.label == baseline:
                    rec["prompt_ids"] = ids  # with the baseline's token_ids: enough to replay drafters offline
                by_method[m.label] = rec
                bar.update(1)
            base = by_method.get(baseline) if do_check else None
            prompt_records = []
            for label in labels:  # records in the methods' given order, whatever order they ran in
                rec = by_method.get(label)
                if rec is None:
                    continue
                if base is not None and (greedy or not by_label[label].is_transformers):
                    fm = compare_tokens(rec["token_ids"], base["token_ids"])
                    rec["equal_to_baseline"] = fm is None
                    rec["first_mismatch"] = fm
                prompt_records.append(rec)
            records.extend(prompt_records)
            if on_prompt is not None and prompt_records:
                on_prompt(prompt_records)
    finally:
        bar.close()

    return BenchResult(
        records=records,
        methods=labels,
        baseline=baseline,
        datasets=list(prompts),
        meta={
            **(meta or {}),
            "max_new_tokens": max_new_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "top_k": top_k,
            "seed": seed,
            "warmup": warmup,
            "limit": limit,
            "chat": chat,
            "check_lossless": do_check,
            "prompts": {k: len(v) for k, v in prompts.items()},
        },
        errors=errors,
        notes=notes,
    )
