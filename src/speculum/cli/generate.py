"""``speculum generate``: one prompt, one method, then the speculation statistics."""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer
from rich.table import Table

from speculum.cli.common import (
    DEFAULT_MODEL,
    DeviceOption,
    DraftDeviceOption,
    DraftOption,
    DtypeOption,
    ExactOption,
    GgufFileOption,
    ModelOption,
    PrepackOption,
    QuantizationOption,
    err,
    fail,
    load_models,
    parse_params,
    resolve_config,
)
from speculum.errors import SpeculumError
from speculum.methods import MACHINE_DEFAULTS, machine_class


def generate(
    prompt: Annotated[str, typer.Argument(help="The prompt text ('-' reads stdin).")],
    model: ModelOption = None,
    draft: DraftOption = None,
    method: Annotated[
        str | None, typer.Option(help="auto, autoregressive, draft_model, prompt_lookup, anpd, ... [default: auto]")
    ] = None,
    config: Annotated[
        str | None,
        typer.Option(help="A config file from `speculum tune --out`: its method, parameters, model and draft."),
    ] = None,
    num_speculative_tokens: Annotated[
        int | None, typer.Option(help="Draft length K (method default if unset).")
    ] = None,
    length_policy: Annotated[
        str | None,
        typer.Option(
            help="Draft-model methods: fixed, heuristic, confidence or specdecpp (a shipped or --param "
            "acceptance_head=DIR head)."
        ),
    ] = None,  # fmt: skip
    param: Annotated[list[str] | None, typer.Option(help="Method parameter key=value (repeatable).")] = None,
    controller: Annotated[
        bool | None,
        typer.Option(
            "--controller/--no-controller",
            help="Let the controller decide each round whether drafting pays and what to verify "
            "[default: on; off for draft_model and preset=paper] "
            "(--no-controller: the method as published).",
        ),
    ] = None,  # fmt: skip
    max_new_tokens: Annotated[int, typer.Option(min=1)] = 128,
    temperature: Annotated[float, typer.Option(help="0 = greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option()] = 1.0,
    top_k: Annotated[int, typer.Option()] = 0,
    seed: Annotated[
        int | None, typer.Option(help="Pin a sampled text: the same one with every method (plain sampling's).")
    ] = None,
    chat: Annotated[bool, typer.Option(help="Apply the chat template (when the model has one).")] = False,
    stream: Annotated[bool, typer.Option(help="Print text as tokens are accepted.")] = True,
    stats: Annotated[bool, typer.Option(help="Print speculation statistics.")] = True,
    json_output: Annotated[bool, typer.Option("--json", help="Print one JSON object instead.")] = False,
    dtype: DtypeOption = "auto",
    device: DeviceOption = "cpu",
    draft_device: DraftDeviceOption = None,
    gguf_file: GgufFileOption = None,
    prepack: PrepackOption = True,
    exact: ExactOption = "auto",
    quantization: QuantizationOption = "auto",
) -> None:
    """Generate text with a speculative method; the output equals plain decoding."""
    from speculum.sampling import SamplingParams

    if prompt == "-":
        prompt = sys.stdin.read()
    try:
        params = parse_params(param or [])
        if num_speculative_tokens is not None:
            params["num_speculative_tokens"] = num_speculative_tokens
        if length_policy is not None:
            params["length_policy"] = length_policy
        if controller is not None:
            params["controller"] = controller
        spec_config, model, draft = resolve_config(method, config, params, model, draft)
        model = model or DEFAULT_MODEL
        SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)
        if not prompt.strip():
            fail("the prompt is empty")
        spec = load_models(
            model,
            draft,
            dtype=dtype,
            device=device,
            draft_device=draft_device,
            gguf_file=gguf_file,
            prepack=prepack,
            exact=exact,
            quantization=quantization,
        )
        text_or_messages = [{"role": "user", "content": prompt}] if chat else prompt
        kwargs = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
        if stream and not json_output:
            result_stream = spec.generate(text_or_messages, spec_config, stream=True, **kwargs)
            for chunk in result_stream:
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
            sys.stdout.write("\n")
            result = result_stream.result
        else:
            result = spec.generate(text_or_messages, spec_config, **kwargs)
            if not json_output:
                print(result.text)
    except SpeculumError as error:
        fail(str(error))
    if json_output:
        print(json.dumps({"text": result.text, "token_ids": result.token_ids, "stats": result.stats.to_dict()}))
    elif stats:
        # the curve the controller judged by, where one ran (reading spec.cost_model would measure one)
        cost_model = getattr(spec, "_cost_model", None)
        print_stats(
            result,
            spec_config,
            spec.dtype_choice,
            spec.row_padding,
            spec.device_type,
            cost_model,
            spec.exact,
            (spec.quantization_choice, spec.quantization),
        )


def print_stats(
    result,
    config,
    dtype_choice=None,
    row_padding=None,
    device_type=None,
    cost_model=None,
    exact=None,
    quantization=None,
) -> None:
    """The run's statistics as a table on stderr, then what the machine-dependent choices were and why."""
    err.print(_stats_table(result.stats, config))
    if device_type is not None and config.preset == "machine":  # whose measured settings the method ran with
        klass = machine_class(device_type)
        # a class without a setting of its own runs its device's (measured on every class of it)
        where = klass if klass in MACHINE_DEFAULTS else f"{device_type} (this machine: {klass})"
        err.print(f"defaults: measured for {where} (preset=paper: the published ones)", markup=False)
    if dtype_choice is not None:  # what dtype="auto" chose and why, on one line
        err.print(f"dtype: {dtype_choice.describe()}", soft_wrap=True, markup=False, highlight=False)
    choice, report = quantization or (None, None)
    if choice is not None:  # what quantization="auto" chose, and the timings it chose by
        err.print(f"quantization: {choice.describe()}", soft_wrap=True, markup=False, highlight=False)
    if report is not None:  # which layers run on the GGUF's own blocks, and which stayed de-quantized
        err.print(f"quantized layers: {report.describe()}", soft_wrap=True, markup=False, highlight=False)
    if row_padding is not None:  # whether one- and two-token forwards run on a 4-row kernel, and why
        err.print(f"linear layers: {row_padding.describe()}", soft_wrap=True, markup=False, highlight=False)
    if exact is not None:  # whether the output is independent of drafts and batch neighbours, and how
        err.print(exact.describe(), soft_wrap=True, markup=False, highlight=False)
    if cost_model is not None:  # the verification costs, and whether they were measured on a busy CPU
        err.print(f"verification costs: {cost_model.describe()}", soft_wrap=True, markup=False, highlight=False)


def _stats_table(s, config) -> Table:
    table = Table(title=f"{config!r}", show_header=False, title_justify="left")
    rows = [
        ("new tokens", f"{s.new_tokens} ({s.stop_reason})"),
        ("tokens/s", f"{s.tokens_per_second:.2f}"),
        ("mean acceptance length", f"{s.mean_acceptance_length:.2f} tokens per target forward"),
        ("draft acceptance rate", f"{s.draft_acceptance_rate:.1%} ({s.accepted_tokens}/{s.drafted_tokens})"),
        ("acceptance per position", " ".join(f"{a:.2f}" for a in s.acceptance_per_position[:12]) or "-"),
        ("target / draft forwards", f"{s.target_forwards} / {s.draft_forwards}"),
        ("discard rate / verification rate", f"{s.discard_rate:.2f} / {s.verification_rate:.2f}"),
        (
            "time: prefill / draft / verify / other",
            f"{s.time_prefill:.2f}s / {s.time_draft:.2f}s / {s.time_verify:.2f}s / {s.time_other:.2f}s "
            f"(wall {s.wall_time:.2f}s)"
            + (f"; of the draft time, {s.time_draft_catch_up:.2f}s catching up" if s.time_draft_catch_up else ""),
        ),
    ]
    if s.rounds_drafted or s.rounds_plain:
        rows += [
            (
                "controller: rounds drafted / plain, nodes pruned",
                f"{s.rounds_drafted} / {s.rounds_plain}, {s.nodes_pruned} ({s.rounds_explored} rounds verified whole "
                f"to explore; own time {s.time_control * 1e3:.1f} ms)"
                + (f"; {s.chains_stopped} draft chains ended early" if s.chains_stopped else ""),
            ),
            (
                "controller: predicted / realised tokens/s",
                f"{s.predicted_tokens_per_second:.2f} / {s.drafted_tokens_per_second:.2f} (rounds that drafted)",
            ),
        ]
    if s.accepted_by:
        by = sorted(s.accepted_by.items(), key=lambda kv: -kv[1])
        rows.append(("accepted tokens by drafter", ", ".join(f"{name} {count}" for name, count in by)))
    for name, value in rows:
        table.add_row(name, value)
    return table
