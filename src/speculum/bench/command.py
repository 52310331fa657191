"""``speculum bench``: the typer command (registered by the CLI as ``app.command("bench")(bench)``)."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Annotated

import torch
import typer

from speculum.accel import is_packed
from speculum.api import Speculum, load
from speculum.bench.datasets import check_dataset_name, split_names
from speculum.bench.method_specs import DEFAULT_METHODS, MethodSpec, known_methods, parse_methods
from speculum.bench.report import machine_info, now_iso, print_markdown, write_result
from speculum.bench.runner import run_bench
from speculum.errors import SpeculumError
from speculum.poolfile import write_atomic

DEFAULT_DATASETS = "humaneval,gsm8k,mt_bench"
RUN_FILE = "run.json"  # the settings of the run whose records lie beside it


def _earlier_run(out: Path, settings: dict) -> tuple[list[dict], dict | None]:
    """The records of the interrupted run in ``out`` and its run file, checked against ``settings``.

    Records are written a whole prompt at a time; a prompt whose last line was cut off by the
    interruption is dropped (it runs again)."""
    records_path, run_path = out / "records.jsonl", out / RUN_FILE
    if not records_path.exists():
        typer.echo(f"--resume: no earlier run in {out}: starting one", err=True)
        return [], None
    if not run_path.exists():
        _fail(f"--resume: {records_path} has no {RUN_FILE} beside it (a run from before --resume existed), "
              "so it cannot be checked to be this run")  # fmt: skip
    try:
        earlier = json.loads(run_path.read_text(encoding="utf-8"))
        lines = records_path.read_text(encoding="utf-8").splitlines()
        was = earlier["settings"]
        if not isinstance(was, dict):
            raise TypeError("settings are not a mapping")
    except (OSError, ValueError, KeyError, TypeError) as e:
        _fail(f"--resume: cannot read the earlier run in {out}: {type(e).__name__}: {e}")
    differ = [f"{k} {was.get(k)!r} (now {v!r})" for k, v in settings.items() if was.get(k) != v]
    if differ:
        _fail(f"--resume: {out} holds a run with other settings: " + "; ".join(differ))
    records = []
    for n, line in enumerate(lines):
        try:
            rec = json.loads(line)
            whole = isinstance(rec, dict) and "dataset" in rec and "question_id" in rec
        except ValueError:
            whole = False
        if whole:
            records.append(rec)
        elif n < len(lines) - 1:
            _fail(f"--resume: {records_path} line {n + 1} is not a record: the file is damaged")
        elif records:  # cut off while its prompt was written: that prompt runs again
            cut = (records[-1]["dataset"], records[-1]["question_id"])
            records = [r for r in records if (r["dataset"], r["question_id"]) != cut]
    prompts = len({(r["dataset"], str(r["question_id"])) for r in records})
    when = earlier.get("date", "?")
    typer.echo(f"--resume: {prompts} prompts ({len(records)} records) kept from the run of {when}", err=True)
    return records, earlier


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
    quantization: Annotated[
        str, typer.Option(help="auto, none or gguf: a GGUF model's linear layers on the file's own quantized weights.")
    ] = "auto",
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
            "hf_prompt_lookup name transformers' own generate. A '#tag' suffix runs a method again as a row "
            "of its own: autoregressive#2 gives the run's noise floor (plain decoding against itself)."
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
        bool, typer.Option(help="oneDNN-prepacked weights for speculum's rows (transformers' rows run stock).")
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
    resume: Annotated[
        bool,
        typer.Option(
            "--resume",
            help="Continue the interrupted run in --out: prompts already recorded there are kept, not rerun "
            "(the settings must be the run's own).",
        ),
    ] = False,
) -> None:
    """Benchmark decoding methods side by side on public prompt sets (speed, acceptance, losslessness)."""
    # everything that can be checked without a model is checked first
    if resume and out is None:
        raise typer.BadParameter("--resume continues the run saved in --out: give --out", param_hint="'--resume'")
    names = _checked_datasets(dataset)
    mspecs = _checked_methods(methods)
    settings = {  # what makes two runs the same run (run.json; --resume checks it)
        "model": model, "draft": draft, "dtype": dtype, "device": device, "datasets": names, "limit": limit,
        "max_new_tokens": max_new_tokens, "methods": methods, "compare_transformers": compare_transformers,
        "warmup": warmup, "temperature": temperature, "top_p": top_p, "top_k": top_k, "seed": seed,
        "check_lossless": check_lossless, "threads": threads, "prepack": prepack, "chat": chat,
    }  # fmt: skip
    previous, earlier = _earlier_run(out, settings) if resume else ([], None)
    if threads is not None:
        torch.set_num_threads(threads)

    command = shlex.join(["speculum", *sys.argv[1:]])
    meta = {"command": command, "date": now_iso(), "model": model, "draft": draft, "dtype_requested": dtype}
    if earlier is not None:
        meta["resumed"] = {"date": earlier.get("date"), "machine": earlier.get("machine"), "records": len(previous)}
    spec = _load_model(model, draft, dtype, device, prepack, meta, quantization)

    records_file = None
    on_prompt = None
    if out is not None:
        records_file = _start_records(out, resume, settings, meta, earlier, previous)

        def on_prompt(recs: list[dict]) -> None:
            records_file.write("".join(json.dumps(r) + "\n" for r in recs))
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
            on_prompt=on_prompt,
            previous=previous,
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


def _checked_datasets(dataset: list[str] | None) -> list[str]:
    names = split_names(dataset) or split_names(DEFAULT_DATASETS)
    for name in names:
        try:
            check_dataset_name(name)
        except SpeculumError as e:
            raise typer.BadParameter(str(e), param_hint="'--dataset'") from None
    return names


def _checked_methods(methods: str) -> list[MethodSpec]:
    try:
        mspecs = parse_methods(methods, known_methods() or None)
        for m in mspecs:  # parameters are checked by SpeculativeConfig before any model loads
            if not m.is_transformers:
                m.to_config()
    except SpeculumError as e:
        raise typer.BadParameter(str(e), param_hint="'--methods'") from None
    return mspecs


def _load_model(
    model: str, draft: str | None, dtype: str, device: str | None, prepack: bool, meta: dict, quantization: str = "auto"
) -> Speculum:
    """The loaded model; ``meta`` gets what loading decided (dtype, quantization, row padding, prepacking)
    and the machine."""
    try:
        kwargs = {"draft": draft, "dtype": dtype, "prepack": "auto" if prepack else False, "quantization": quantization}
        if device is not None:
            kwargs["device"] = device
        spec = load(model, **kwargs)
        spec.pools_per_config = True  # methods compared on the same prompts never share a pool
    except SpeculumError as e:
        _fail(str(e))
    meta["dtype"] = str(getattr(spec.model, "dtype", dtype)).replace("torch.", "")
    if getattr(spec, "dtype_choice", None) is not None:  # why this dtype (dtype="auto" measures on a CPU)
        meta["dtype_choice"] = spec.dtype_choice.to_dict()
    for name in ("row_padding", "draft_row_padding"):  # small forwards padded to 4 rows (speculum.accel)
        if (padding := getattr(spec, name, None)) is not None:
            meta[name] = {"rows": padding.rows, "dense_rows": padding.dense_rows, "reason": padding.describe()}
    if spec.quantization_choice is not None:  # what quantization="auto" chose, and the timings
        meta["quantization_choice"] = spec.quantization_choice.describe()
    meta["quantization"] = spec.quantization.describe() if spec.quantization is not None else "none"
    meta["prepacked"] = is_packed(spec.model)
    meta["device"] = str(getattr(spec.model, "device", device or "?"))
    meta["machine"] = machine_info()
    return spec


def _start_records(out: Path, resume: bool, settings: dict, meta: dict, earlier: dict | None, previous: list[dict]):
    """Write the run file and the earlier run's records into ``out``; the records file, open for appending
    this run's, one prompt at a time."""
    if not resume and (out / "records.jsonl").exists():
        typer.echo(f"{out} holds an earlier run's records: replacing them (--resume would continue it)", err=True)
    run_file = {"settings": settings, "date": meta["date"], "machine": meta["machine"]}
    if earlier is not None:  # the run continued keeps its start and machine
        run_file.update(date=earlier.get("date"), machine=earlier.get("machine"))
    try:
        out.mkdir(parents=True, exist_ok=True)
        write_atomic(out / RUN_FILE, (json.dumps(run_file, indent=2) + "\n").encode(), what="run file")
        # the earlier run's whole prompts, then this run's, one prompt at a time
        write_atomic(out / "records.jsonl", "".join(json.dumps(r) + "\n" for r in previous).encode())
        return open(out / "records.jsonl", "a", encoding="utf-8")  # noqa: SIM115 - the caller closes it
    except OSError as e:
        _fail(f"cannot write the results to {out}: {e}")
