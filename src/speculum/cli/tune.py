"""``speculum tune``: search a method's parameters for this machine (:mod:`speculum.tune`), show the
choice against the start, and write it as a config file or print it as flags."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

import speculum
from speculum.bench.datasets import load_dataset
from speculum.bench.report import machine_info, now_iso
from speculum.cli.common import (
    DEFAULT_MODEL,
    DeviceOption,
    DtypeOption,
    QuantizationOption,
    ThreadsOption,
    err,
    fail,
    loading,
    parse_params,
)
from speculum.errors import SpeculumError
from speculum.methods import SpeculativeConfig


def tune(
    method: Annotated[str, typer.Option(help="draft_model, ouroboros, anpd, medusa or ctc.")],
    model: Annotated[str, typer.Option(help="Target: packaged alias, hub id or local path.")] = DEFAULT_MODEL,
    draft: Annotated[str | None, typer.Option(help="Draft model, or self:N (draft_model, ouroboros).")] = None,
    dataset: Annotated[
        str, typer.Option(help="Prompts to tune on: a prompt set name or a question.jsonl (keep the report sets out).")
    ] = "mbpp",
    limit: Annotated[int, typer.Option(min=1, help="Prompts to tune on.")] = 4,
    max_new_tokens: Annotated[int, typer.Option(min=1)] = 64,
    param: Annotated[list[str] | None, typer.Option(help="Fix a parameter, key=value (repeatable).")] = None,
    out: Annotated[str | None, typer.Option(help="Write the chosen configuration to this config file (.json).")] = None,
    sweeps: Annotated[int, typer.Option(min=1, help="Most sweeps over the parameters.")] = 3,
    min_gain: Annotated[
        float, typer.Option(min=0.0, help="Least predicted relative gain that changes a parameter (timing noise).")
    ] = 0.05,
    confirm: Annotated[bool, typer.Option(help="Time the choice against plain decoding and the defaults.")] = True,
    dtype: DtypeOption = "auto",
    quantization: QuantizationOption = "auto",
    device: DeviceOption = "cpu",
    threads: ThreadsOption = None,
    chat: Annotated[
        bool | None, typer.Option("--chat/--no-chat", help="Apply the chat template (default: as speculum bench).")
    ] = None,
    temperature: Annotated[
        float, typer.Option(min=0.0, help="Tune for sampling at this temperature (seeded requests); 0: greedy.")
    ] = 0.0,
    top_p: Annotated[float, typer.Option(min=0.0, max=1.0, help="Nucleus sampling (with --temperature).")] = 1.0,
    top_k: Annotated[int, typer.Option(min=0, help="Top-k sampling (with --temperature; 0: off).")] = 0,
    seed: Annotated[int, typer.Option(min=0, help="Prompt i is sampled with seed SEED + i (with --temperature).")] = 0,
) -> None:
    """Choose a method's parameters for this machine: heuristic search (Ouroboros' Algorithm 1) scored by
    exact replay of the target's greedy outputs (or seeded samples, with --temperature) and a measured
    verification cost, then a timed check."""
    from speculum.tune import TUNABLE

    if method not in TUNABLE:
        fail(f"speculum tune supports --method {', '.join(TUNABLE)}; got {method!r}")
    if out is not None and not out.endswith(".json"):
        fail(f"--out must name a .json file, got {out!r}")
    import torch

    from speculum.sampling import SamplingParams
    from speculum.tune import tune as run_tune

    try:
        sampling = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)
        fixed = parse_params(param or [])
        SpeculativeConfig.coerce(method, **fixed)
        prompts = load_dataset(dataset, limit)
        if threads is not None:
            torch.set_num_threads(threads)
        with loading(model, draft):
            spec = speculum.load(model, draft, dtype=dtype, device=device, quantization=quantization)
        ids = _prompt_ids(spec, prompts, chat)
        result = run_tune(
            spec,
            method,
            ids,
            max_new_tokens=max_new_tokens,
            fixed=fixed,
            max_sweeps=sweeps,
            min_gain=min_gain,
            confirm=confirm,
            sampling=sampling,
            seed=seed,
            log=lambda line: err.print(line, highlight=False),
        )
    except SpeculumError as error:
        fail(str(error))
    regime = "greedy" if sampling.greedy else f"T={sampling.temperature:g}, seeds {seed}..{seed + len(ids) - 1}"
    title = f"speculum tune --method {method}: {len(ids)} prompts of {dataset}, {max_new_tokens} tokens, {regime}"
    _show_result(result, fixed, title)
    tuning = _tuning_record(result, f"{dataset} x {len(ids)}", max_new_tokens, sampling, seed)
    metadata = {"model": model, "draft": draft, "dtype": str(spec.model.dtype).replace("torch.", ""), "tuning": tuning}
    if out is not None:
        try:
            result.config.save(out, **metadata)
        except SpeculumError as error:
            fail(str(error))
        Console().print(f"wrote {out}: `speculum generate --config {out}`, `speculum bench --methods {out}`")
    else:
        Console().print(f"chosen: --method {method} " + " ".join(f"--param {k}={v}" for k, v in result.params.items()))


def _prompt_ids(spec, prompts, chat: bool | None) -> list:
    """The tuning prompts' token ids, chat-templated as ``speculum bench`` would unless --chat/--no-chat says."""
    has_template = bool(getattr(spec.tokenizer, "chat_template", None))
    return [
        spec.encode_prompt(p.render(chat if chat is not None else (p.chat_default and has_template))) for p in prompts
    ]


def _show_result(result, fixed: dict, title: str) -> None:
    """The start and the choice side by side (predicted), then the timed check where one ran."""
    from speculum.tune import describe_params

    table = Table(title=title)
    table.add_column("parameters")
    table.add_column("predicted tok/s", justify="right")
    table.add_column("vs plain", justify="right")
    table.add_column("acc. length", justify="right")
    start_label = "start: " + (describe_params(fixed) if fixed else "defaults")
    for label, ev in ((start_label, result.start), ("chosen: " + describe_params(result.params), result.best)):
        table.add_row(
            label,
            f"{ev.tokens_per_second:.2f}",
            f"×{ev.tokens_per_second / result.plain_predicted_tps:.2f}",
            f"{ev.mean_acceptance_length:.2f}",
        )
    Console().print(table)
    if result.measured:
        plain = result.measured.get("autoregressive")
        line = ", ".join(
            f"{label} {tps:.2f} tok/s" + (f" (×{tps / plain:.2f})" if plain and label != "autoregressive" else "")
            for label, tps in result.measured.items()
        )
        Console().print(f"measured: {line}", highlight=False)


def _tuning_record(result, prompts: str, max_new_tokens: int, sampling, seed: int) -> dict:
    """How the choice was made, saved with it in the config file."""
    info = machine_info()
    return {
        "prompts": prompts,
        "max_new_tokens": max_new_tokens,
        "sampling": "greedy"
        if sampling.greedy
        else {
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k,
            "seed": seed,
        },
        "predicted_speedup": round(result.best.tokens_per_second / result.plain_predicted_tps, 3),
        "measured_tokens_per_s": {k: round(v, 3) for k, v in result.measured.items()},
        "machine": f"{info.get('cpu', '?')}, {info.get('threads', '?')} threads",
        "date": now_iso(),
    }
