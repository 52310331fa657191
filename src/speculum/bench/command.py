"""``speculum bench``: the typer command (registered by the CLI as ``app.command("bench")(bench)``)."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Annotated

import typer

from speculum.bench.datasets import check_dataset_name, split_names
from speculum.bench.runner import DEFAULT_METHODS, known_methods, parse_methods, run_bench
from speculum.errors import SpeculumError

DEFAULT_DATASETS = "humaneval,gsm8k,mt_bench"


def _fail(message: str) -> None:
    typer.echo(f"Error: {message}", err=True)
    raise typer.Exit(2)


def bench(
    model: Annotated[str, typer.Option("--model", "-m", help="Target model: alias, hub id or local path.")] = (
        "gemma-3-270m"
    ),
    draft: Annotated[
        str | None, typer.Option(help='Draft model (alias/id/path) or "self:N" (the target\'s first N layers).')
    ] = None,
    dtype: Annotated[str, typer.Option(help="auto, float32, bfloat16 or float16.")] = "auto",
    device: Annotated[str | None, typer.Option(help="cpu, cuda, cuda:1, ... (default: the library's choice).")] = None,
    dataset: Annotated[
        list[str] | None,
        typer.Option(
            "--dataset",
            "-d",
            help="humaneval, gsm8k, mt_bench, wmt16, mbpp, or a path to a Spec-Bench question.jsonl. "
            f"Repeatable or comma-separated. [default: {DEFAULT_DATASETS}]",
            show_default=False,
        ),
    ] = None,
    limit: Annotated[int, typer.Option(min=1, help="Prompts per dataset.")] = 10,
    max_new_tokens: Annotated[int, typer.Option(min=1, help="New tokens per generation.")] = 128,
    methods: Annotated[
        str,
        typer.Option(
            help="Comma-separated method specs: name or name:key=value,key=value "
            "(e.g. autoregressive,anpd:num_speculative_tokens=5,tree=true), or a config file from "
            "`speculum tune --out` (tuned.json). hf_generate, hf_assisted and "
            "hf_prompt_lookup name transformers' own generate."
        ),
    ] = DEFAULT_METHODS,
    compare_transformers: Annotated[
        bool,
        typer.Option(
            "--compare-transformers", help="Add transformers' rows: hf_generate, hf_assisted, hf_prompt_lookup."
        ),
    ] = False,
    warmup: Annotated[
        int, typer.Option(min=0, help="Warm-up generations per method on the first prompt (not recorded).")
    ] = 1,
    temperature: Annotated[float, typer.Option(min=0.0, help="0 = greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option(min=0.0, max=1.0)] = 1.0,
    top_k: Annotated[int, typer.Option(min=0)] = 0,
    seed: Annotated[int | None, typer.Option(help="Base seed; prompt i uses seed + i.")] = None,
    out: Annotated[Path | None, typer.Option(help="Directory for records.jsonl, summary.md and summary.json.")] = None,
    check_lossless: Annotated[
        bool, typer.Option("--check-lossless/--no-check-lossless", help="Compare every output with the baseline's.")
    ] = True,
    threads: Annotated[int | None, typer.Option(min=1, help="torch.set_num_threads.")] = None,
    prepack: Annotated[
        bool, typer.Option(help="oneDNN-prepacked float32 weights for speculum's rows (transformers' rows run stock).")
    ] = True,
    chat: Annotated[
        bool | None,
        typer.Option(
            "--chat/--no-chat",
            help="Apply the chat template. Default: yes for gsm8k/mt_bench/wmt16/mbpp/question files when the "
            "tokenizer has one, no for humaneval (code completion).",
            show_default=False,
        ),
    ] = None,
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help="Show a progress bar.")] = True,
) -> None:
    """Benchmark decoding methods side by side on public prompt sets (speed, acceptance, losslessness)."""
    # everything that can be checked without a model is checked first
    names = split_names(dataset) or split_names(DEFAULT_DATASETS)
    for name in names:
        try:
            check_dataset_name(name)
        except SpeculumError as e:
            raise typer.BadParameter(str(e), param_hint="'--dataset'") from None
    try:
        mspecs = parse_methods(methods, known_methods() or None)
        for m in mspecs:  # parameters are checked by SpeculativeConfig before any model loads
            if not m.is_transformers:
                m.to_config()
    except SpeculumError as e:
        raise typer.BadParameter(str(e), param_hint="'--methods'") from None

    import torch

    if threads is not None:
        torch.set_num_threads(threads)

    from speculum.bench.report import machine_info, now_iso, print_markdown, write_result

    command = shlex.join(["speculum", *sys.argv[1:]])
    meta = {"command": command, "date": now_iso(), "model": model, "draft": draft, "dtype_requested": dtype}

    try:
        import speculum

        kwargs = {"draft": draft, "dtype": dtype, "prepack": "auto" if prepack else False}
        if device is not None:
            kwargs["device"] = device
        spec = speculum.load(model, **kwargs)
        spec.pools_per_config = True  # methods compared on the same prompts never share a pool
    except SpeculumError as e:
        _fail(str(e))
    meta["dtype"] = str(getattr(spec.model, "dtype", dtype)).replace("torch.", "")
    if getattr(spec, "dtype_choice", None) is not None:  # why this dtype (dtype="auto" measures on a CPU)
        meta["dtype_choice"] = spec.dtype_choice.to_dict()
    from speculum.accel import is_packed

    meta["prepacked"] = is_packed(spec.model)
    meta["device"] = str(getattr(spec.model, "device", device or "?"))
    meta["machine"] = machine_info()

    records_file = None
    on_record = None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        records_file = open(out / "records.jsonl", "w", encoding="utf-8")  # noqa: SIM115 - closed below

        def on_record(rec: dict) -> None:
            records_file.write(json.dumps(rec) + "\n")
            records_file.flush()

    try:
        result = run_bench(
            spec,
            names,
            mspecs,
            limit=limit,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            warmup=warmup,
            chat=chat,
            check_lossless=check_lossless,
            compare_transformers=compare_transformers,
            draft=draft,
            progress=progress,
            on_record=on_record,
            meta=meta,
        )
    except SpeculumError as e:
        _fail(str(e))
    finally:
        if records_file is not None:
            records_file.close()

    summary_md = result.to_markdown()
    print_markdown(summary_md)
    if out is not None:
        paths = write_result(result, out, records=False)
        typer.echo(f"wrote {out / 'records.jsonl'}, {paths['summary_md']}, {paths['summary_json']}")
