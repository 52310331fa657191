"""Command line: ``speculum generate``, ``speculum models``, ``speculum bench``.

Every error a user can cause ends in one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from speculum.errors import SpeculumError
from speculum.methods import DEFAULT_METHOD

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Lossless speculative decoding for Hugging Face causal language models.",
    pretty_exceptions_enable=False,
)
err = Console(stderr=True)


def fail(message: str) -> None:
    err.print(f"[red]error:[/red] {message}", highlight=False)
    raise typer.Exit(2)


def parse_params(items: list[str]) -> dict:
    """``key=value`` pairs with typed values (int, float, bool, null, str)."""
    from speculum.bench.runner import parse_value

    params = {}
    for item in items:
        if "=" not in item:
            fail(f"--param expects key=value, got {item!r}")
        key, value = item.split("=", 1)
        params[key.strip().replace("-", "_")] = parse_value(value.strip())
    return params


@app.command()
def generate(
    prompt: Annotated[str, typer.Argument(help="The prompt text ('-' reads stdin).")],
    model: Annotated[
        str | None, typer.Option(help="Packaged alias, hub id, local path or .gguf file. [default: gemma-3-270m]")
    ] = None,
    draft: Annotated[str | None, typer.Option(help="Draft model, or self:N for the target's first N layers.")] = None,
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
    dtype: Annotated[str, typer.Option(help="auto, float32, bfloat16, float16.")] = "auto",
    device: Annotated[str, typer.Option(help="cpu, cuda, cuda:N or auto.")] = "cpu",
    draft_device: Annotated[str | None, typer.Option(help="Put the draft model on another device.")] = None,
    gguf_file: Annotated[str | None, typer.Option(help="GGUF file name inside --model.")] = None,
    prepack: Annotated[
        bool,
        typer.Option(
            help="oneDNN-prepacked weights on CPU: float32, and bfloat16 where the CPU has it natively (faster)."
        ),
    ] = True,
) -> None:
    """Generate text with a speculative method; the output equals plain decoding."""
    import speculum

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
        if config is not None:
            file_config = speculum.SpeculativeConfig.from_file(config)
            if method is not None and method != file_config.method:
                fail(f"--method {method} contradicts the config file's method {file_config.method}")
            config = speculum.SpeculativeConfig.coerce(file_config, **params)
            model = model or file_config.metadata.get("model")
            draft = draft or file_config.metadata.get("draft")
        else:
            config = speculum.SpeculativeConfig.coerce(method or DEFAULT_METHOD, **params)
        model = model or "gemma-3-270m"
        speculum.SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)
        if not prompt.strip():
            fail("the prompt is empty")
        with err.status(f"loading {model}" + (f" + {draft}" if draft else "")):
            spec = speculum.load(
                model,
                draft,
                dtype=dtype,
                device=device,
                draft_device=draft_device,
                gguf_file=gguf_file,
                prepack="auto" if prepack else False,
            )
        text_or_messages = [{"role": "user", "content": prompt}] if chat else prompt
        kwargs = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
        if stream and not json_output:
            result_stream = spec.generate(text_or_messages, config, stream=True, **kwargs)
            for chunk in result_stream:
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
            sys.stdout.write("\n")
            result = result_stream.result
        else:
            result = spec.generate(text_or_messages, config, **kwargs)
            if not json_output:
                print(result.text)
    except SpeculumError as error:
        fail(str(error))
    if json_output:
        print(json.dumps({"text": result.text, "token_ids": result.token_ids, "stats": result.stats.to_dict()}))
    elif stats:
        # the curve the controller judged by, where one ran (reading spec.cost_model would measure one)
        cost_model = getattr(spec, "_cost_model", None)
        print_stats(result, config, spec.dtype_choice, spec.row_padding, spec.device_type, cost_model)


def print_stats(result, config, dtype_choice=None, row_padding=None, device_type=None, cost_model=None) -> None:
    s = result.stats
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
    err.print(table)
    if device_type is not None and config.preset == "machine":  # whose measured settings the method ran with
        from speculum.methods import MACHINE_DEFAULTS, machine_class

        klass = machine_class(device_type)
        # a class without a setting of its own runs its device's (measured on every class of it)
        where = klass if klass in MACHINE_DEFAULTS else f"{device_type} (this machine: {klass})"
        err.print(f"defaults: measured for {where} (preset=paper: the published ones)", markup=False)
    if dtype_choice is not None:  # what dtype="auto" chose and why, on one line
        err.print(f"dtype: {dtype_choice.describe()}", soft_wrap=True, markup=False, highlight=False)
    if row_padding is not None:  # whether one- and two-token forwards run on a 4-row kernel, and why
        err.print(f"linear layers: {row_padding.describe()}", soft_wrap=True, markup=False, highlight=False)
    if cost_model is not None:  # the verification costs, and whether they were measured on a busy CPU
        err.print(f"verification costs: {cost_model.describe()}", soft_wrap=True, markup=False, highlight=False)


@app.command()
def models() -> None:
    """List the packaged model aliases and whether they are installed."""
    from speculum.models import list_models

    table = Table()
    table.add_column("alias", no_wrap=True)
    table.add_column("model")
    table.add_column("installed", no_wrap=True)
    table.add_column("converted", no_wrap=True)
    table.add_column("install with", overflow="fold")
    for row in list_models():
        table.add_row(
            row["alias"],
            row.get("description", ""),
            "yes" if row["installed"] else "no",
            "yes" if row.get("converted") else "no",
            row["pip"],
        )
    Console().print(table)


@app.command()
def tune(
    method: Annotated[str, typer.Option(help="draft_model, ouroboros, anpd, medusa or ctc.")],
    model: Annotated[str, typer.Option(help="Target: packaged alias, hub id or local path.")] = "gemma-3-270m",
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
    dtype: Annotated[str, typer.Option(help="auto, float32, bfloat16, float16.")] = "auto",
    device: Annotated[str, typer.Option(help="cpu, cuda, cuda:N or auto.")] = "cpu",
    threads: Annotated[int | None, typer.Option(min=1, help="torch.set_num_threads.")] = None,
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

    import speculum
    from speculum.bench.datasets import load_dataset
    from speculum.sampling import SamplingParams
    from speculum.tune import describe_params
    from speculum.tune import tune as run_tune

    try:
        sampling = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)
        fixed = parse_params(param or [])
        speculum.SpeculativeConfig.coerce(method, **fixed)
        prompts = load_dataset(dataset, limit)
        if threads is not None:
            torch.set_num_threads(threads)
        with err.status(f"loading {model}" + (f" + {draft}" if draft else "")):
            spec = speculum.load(model, draft, dtype=dtype, device=device)
        has_template = bool(getattr(spec.tokenizer, "chat_template", None))
        ids = [
            spec.encode_prompt(p.render(chat if chat is not None else (p.chat_default and has_template)))
            for p in prompts
        ]
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
    table = Table(
        title=f"speculum tune --method {method}: {len(ids)} prompts of {dataset}, {max_new_tokens} tokens, {regime}"
    )
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
    metadata = {
        "model": model,
        "draft": draft,
        "dtype": str(spec.model.dtype).replace("torch.", ""),
        "tuning": {
            "prompts": f"{dataset} x {len(ids)}",
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
            "machine": _machine_line(),
            "date": _now(),
        },
    }
    if out is not None:
        try:
            result.config.save(out, **metadata)
        except SpeculumError as error:
            fail(str(error))
        Console().print(f"wrote {out}: `speculum generate --config {out}`, `speculum bench --methods {out}`")
    else:
        Console().print(f"chosen: --method {method} " + " ".join(f"--param {k}={v}" for k, v in result.params.items()))


def _machine_line() -> str:
    from speculum.bench.report import machine_info

    info = machine_info()
    return f"{info.get('cpu', '?')}, {info.get('threads', '?')} threads"


def _now() -> str:
    from speculum.bench.report import now_iso

    return now_iso()


train_app = typer.Typer(
    no_args_is_help=True,
    help="Train the parts some methods learn (acceptance heads, Medusa heads, the CTC draft module).",
)
app.add_typer(train_app, name="train")


@train_app.command("acceptance-head")
def train_acceptance_head(
    draft: Annotated[str, typer.Option(help="The draft model the head reads (a model or self:N).")],
    out: Annotated[str, typer.Option(help="Checkpoint directory (also caches the training data).")],
    model: Annotated[str, typer.Option(help="Target model.")] = "gemma-3-270m",
    texts: Annotated[
        str,
        typer.Option(
            help="Comma-separated text sources: mbpp, humaneval, gsm8k, mt_bench, wmt16, stdlib, sliced like "
            "gsm8k[100:], or paths. Keep the prompts you report on out."
        ),
    ] = "mbpp[:200],gsm8k[100:200],wmt16[100:],stdlib[:40]",
    max_tokens: Annotated[int, typer.Option(min=8, help="Tokens per text at most.")] = 512,
    temperature: Annotated[float, typer.Option(min=0.0, help="The inference temperature the labels are for.")] = 0.0,
    mixing_ratio: Annotated[float, typer.Option(min=0.0, max=0.99, help="Share r keeping the target token.")] = 0.15,
    depth: Annotated[int, typer.Option(min=0, help="Residual blocks D.")] = 3,
    confidence_input: Annotated[
        bool, typer.Option(help="Also feed the head the draft's confidence in its candidate (beyond the paper).")
    ] = True,
    early: Annotated[
        bool,
        typer.Option(
            help="Score each candidate from the state that produced it, so drafting can stop without "
            "one more unscored token (beyond the paper; implies --confidence-input)."
        ),
    ] = True,  # fmt: skip
    w_rej: Annotated[float, typer.Option(min=0.0, help="Loss weight of rejections.")] = 6.0,
    epochs: Annotated[int, typer.Option(min=1)] = 1,
    lr: Annotated[float, typer.Option(min=0.0)] = 1e-3,
    batch_size: Annotated[int, typer.Option(min=1)] = 256,
    seed: Annotated[int, typer.Option()] = 0,
    device: Annotated[str, typer.Option(help="Where the head trains: cpu, cuda, ...")] = "cpu",
    dtype: Annotated[str, typer.Option(help="Models' dtype for the data pass.")] = "auto",
    threads: Annotated[int | None, typer.Option(min=1, help="torch.set_num_threads.")] = None,
    regenerate: Annotated[bool, typer.Option(help="Remake the cached training data.")] = False,
    resume: Annotated[bool, typer.Option(help="Continue from the checkpoint in --out.")] = False,
) -> None:
    """Train SpecDec++'s acceptance head for a target/draft pair (teacher-forced data, weighted BCE)."""
    from pathlib import Path

    import torch

    import speculum
    from speculum.training import acceptance
    from speculum.training.texts import training_texts

    try:
        sources = training_texts(texts)
        if threads is not None:
            torch.set_num_threads(threads)
        if device.startswith("cuda") and not torch.cuda.is_available():
            fail(f"--device {device}: no CUDA device here")
        with err.status(f"loading {model} + {draft}"):
            spec = speculum.load(model, draft, dtype=dtype)  # prepacked where supported: faster data
        data_settings = acceptance.DataSettings(max_tokens, temperature, 1.0, 0, mixing_ratio, seed)
        train_settings = acceptance.TrainSettings(
            depth, w_rej, epochs, lr, batch_size, 0.1, seed, confidence_input, early
        )
        acceptance.run(
            spec,
            sources,
            Path(out),
            data_settings,
            train_settings,
            device=device,
            regenerate=regenerate,
            resume=resume,
            log=lambda line: err.print(line, highlight=False),
        )
    except SpeculumError as error:
        fail(str(error))
    Console().print(
        f"use it: speculum generate PROMPT --model {model} --draft {draft} --method draft_model "
        f"--length-policy specdecpp --param acceptance_head={out}"
    )


TextsOption = Annotated[
    str,
    typer.Option(
        "--texts",
        "--prompts",
        help="Comma-separated text sources: mbpp, humaneval, gsm8k, mt_bench, wmt16, stdlib, sliced like "
        "gsm8k[100:], or paths (.jsonl prompt files, text/source files, directories). Keep the prompts you "
        "report on out.",
    ),
]
DEFAULT_HEAD_TEXTS = "mbpp[:200],gsm8k[100:200],wmt16[100:],mt_bench[10:],stdlib[:40]"


GenerateOption = Annotated[
    int,
    typer.Option(
        min=0,
        help="Train on the target's own greedy continuations of the prompts, this many tokens each (slower to "
        "make; 0: teacher-forced text).",
    ),
]
GenerateBatchOption = Annotated[
    int, typer.Option(min=1, help="Prompts the target continues at once (--generate; rows of one batch).")
]
RawLayoutOption = Annotated[
    bool,
    typer.Option(help="With --generate, continue a chat-templated prompt as a raw completion too (both layouts)."),
]
DataOption = Annotated[
    str | None,
    typer.Option(
        help="Distillation data cache to use (e.g. the other kind's OUT/distill_data.safetensors; default: in --out)."
    ),
]
ExtraDataOption = Annotated[
    list[str] | None,
    typer.Option(
        help="Data files earlier runs made for this target, trained on too (repeatable): "
        "add texts without a new data pass over the old ones."
    ),
]
PrecisionOption = Annotated[
    str,
    typer.Option(
        help="Training arithmetic: auto (bfloat16 mixed precision where the device computes bf16 natively: "
        "avx512_bf16/AMX CPUs, CUDA GPUs; float32 elsewhere), float32 or bfloat16."
    ),
]
ConsistentOption = Annotated[
    bool,
    typer.Option(help="Learn a label only while the text stays on the target's own greedy path."),
]
NoiseOption = Annotated[
    float,
    typer.Option(
        min=0.0,
        help="Gaussian noise on the training inputs' hidden states, in units of each dimension's spread "
        "(a regulariser; 0: none).",
    ),
]


def _train_draft_heads(kind: str, model: str, out: str, texts: str, data_settings, settings, common: dict) -> None:
    from pathlib import Path

    import torch

    import speculum
    from speculum.training import draft_heads
    from speculum.training.texts import training_texts

    try:
        sources = training_texts(texts)
        settings.check()
        extra_data = [Path(file) for file in common["extra_data"] or []]
        for file in extra_data:
            if not file.is_file():
                fail(f"--extra-data {file}: no such file")
        if common["threads"] is not None:
            torch.set_num_threads(common["threads"])
        device = common["device"]
        if device.startswith("cuda") and not torch.cuda.is_available():
            fail(f"--device {device}: no CUDA device here")
        with err.status(f"loading {model}"):
            spec = speculum.load(model, dtype=common["dtype"])  # prepacked where supported: faster data
        draft_heads.run(
            spec,
            sources,
            Path(out),
            data_settings,
            settings,
            device=device,
            regenerate=common["regenerate"],
            resume=common["resume"],
            data_file=Path(common["data"]) if common["data"] else None,
            extra_data=extra_data,
            log=lambda line: err.print(line, highlight=False),
        )
    except SpeculumError as error:
        fail(str(error))
    method = "ctc" if kind == "ctc" else "medusa"
    Console().print(f"use it: speculum generate PROMPT --model {model} --method {method} --param heads={out}")


@train_app.command("medusa")
def train_medusa(
    out: Annotated[str, typer.Option(help="Checkpoint directory (also caches the distillation data).")],
    model: Annotated[str, typer.Option(help="Target model.")] = "gemma-3-270m",
    texts: TextsOption = DEFAULT_HEAD_TEXTS,
    max_tokens: Annotated[int, typer.Option(min=8, help="Tokens per text at most.")] = 512,
    generate: GenerateOption = 0,
    generate_batch: GenerateBatchOption = 16,
    raw_layout: RawLayoutOption = True,
    consistent: ConsistentOption = True,
    noise: NoiseOption = 0.0,
    data: DataOption = None,
    extra_data: ExtraDataOption = None,
    num_heads: Annotated[int, typer.Option(min=1, help="Heads: tokens guessed beyond the next one.")] = 4,
    num_layers: Annotated[int, typer.Option(min=1, help="Residual blocks per head.")] = 1,
    draft_vocab: Annotated[int, typer.Option(min=1, help="Tokens the heads can draft (most predicted).")] = 16384,
    tree_nodes: Annotated[int, typer.Option(min=1, help="Recommended draft tree size, saved with the heads.")] = 16,
    epochs: Annotated[int, typer.Option(min=1)] = 2,
    lr: Annotated[float, typer.Option(min=0.0)] = 1e-3,
    batch_size: Annotated[int, typer.Option(min=1)] = 64,
    max_examples: Annotated[int, typer.Option(min=0, help="Examples per epoch (0: all).")] = 0,
    seed: Annotated[int, typer.Option()] = 0,
    device: Annotated[str, typer.Option(help="Where the heads train: cpu, cuda, ...")] = "cpu",
    dtype: Annotated[str, typer.Option(help="The target's dtype for the data pass.")] = "auto",
    threads: Annotated[int | None, typer.Option(min=1, help="torch.set_num_threads.")] = None,
    regenerate: Annotated[bool, typer.Option(help="Remake the cached data.")] = False,
    resume: Annotated[bool, typer.Option(help="Continue from the checkpoint in --out.")] = False,
    precision: PrecisionOption = "auto",
) -> None:
    """Train Medusa-1 heads on the frozen target (self-distilled: the target's own predictions are the labels)."""
    from speculum.training.draft_heads import DistillSettings, HeadSettings

    settings = HeadSettings(
        "medusa", num_heads=num_heads, num_layers=num_layers, draft_vocab=draft_vocab, epochs=epochs, lr=lr,
        batch_size=batch_size, seed=seed, max_examples=max_examples, tree_nodes=tree_nodes, consistent=consistent,
        precision=precision, noise=noise,
    )  # fmt: skip
    common = dict(device=device, dtype=dtype, threads=threads, regenerate=regenerate, resume=resume, data=data,
                  extra_data=extra_data)  # fmt: skip
    data_settings = DistillSettings(max_tokens, generate, generate_batch, raw_layout)
    _train_draft_heads("medusa", model, out, texts, data_settings, settings, common)


@train_app.command("ctc-drafter")
def train_ctc_drafter(
    out: Annotated[str, typer.Option(help="Checkpoint directory (also caches the distillation data).")],
    model: Annotated[str, typer.Option(help="Target model.")] = "gemma-3-270m",
    texts: TextsOption = DEFAULT_HEAD_TEXTS,
    max_tokens: Annotated[int, typer.Option(min=8, help="Tokens per text at most.")] = 512,
    generate: GenerateOption = 0,
    generate_batch: GenerateBatchOption = 16,
    raw_layout: RawLayoutOption = True,
    consistent: ConsistentOption = True,
    noise: NoiseOption = 0.0,
    data: DataOption = None,
    extra_data: ExtraDataOption = None,
    slots: Annotated[int, typer.Option(min=1, help="Frames predicted at once.")] = 8,
    label_length: Annotated[int, typer.Option(min=1, help="Target tokens the frames spell (CTC labels).")] = 4,
    context: Annotated[int, typer.Option(min=1, help="Hidden states of the recent context it reads.")] = 16,
    draft_vocab: Annotated[int, typer.Option(min=1, help="Tokens it can draft (most predicted).")] = 16384,
    tree_nodes: Annotated[int, typer.Option(min=1, help="Recommended draft tree size, saved with it.")] = 16,
    epochs: Annotated[int, typer.Option(min=1)] = 2,
    lr: Annotated[float, typer.Option(min=0.0)] = 1e-3,
    batch_size: Annotated[int, typer.Option(min=1)] = 64,
    max_examples: Annotated[int, typer.Option(min=0, help="Examples per epoch (0: all).")] = 0,
    seed: Annotated[int, typer.Option()] = 0,
    device: Annotated[str, typer.Option(help="Where it trains: cpu, cuda, ...")] = "cpu",
    dtype: Annotated[str, typer.Option(help="The target's dtype for the data pass.")] = "auto",
    threads: Annotated[int | None, typer.Option(min=1, help="torch.set_num_threads.")] = None,
    regenerate: Annotated[bool, typer.Option(help="Remake the cached data.")] = False,
    resume: Annotated[bool, typer.Option(help="Continue from the checkpoint in --out.")] = False,
    precision: PrecisionOption = "auto",
    standardize: Annotated[
        bool,
        typer.Option(help="Standardise the memory per dimension with the target's hidden-state statistics."),
    ] = False,
    slot_blocks: Annotated[
        bool,
        typer.Option(help="Give every slot its own residual block over the fused state (as a Medusa head has)."),
    ] = True,
    refine: Annotated[
        bool,
        typer.Option(help="A second layer re-reads the frames with each frame's top-1 choice embedded (experiment)."),
    ] = False,
) -> None:
    """Train CTC-drafter's attention draft module (one transformer layer, CTC loss) on the frozen target."""
    from speculum.training.draft_heads import DistillSettings, HeadSettings

    settings = HeadSettings(
        "ctc", slots=slots, label_length=label_length, context=context, draft_vocab=draft_vocab, epochs=epochs,
        lr=lr, batch_size=batch_size, seed=seed, max_examples=max_examples, tree_nodes=tree_nodes,
        consistent=consistent, precision=precision, standardize=standardize, slot_blocks=slot_blocks, noise=noise,
        refine=refine,
    )  # fmt: skip
    common = dict(device=device, dtype=dtype, threads=threads, regenerate=regenerate, resume=resume, data=data,
                  extra_data=extra_data)  # fmt: skip
    data_settings = DistillSettings(max_tokens, generate, generate_batch, raw_layout)
    _train_draft_heads("ctc", model, out, texts, data_settings, settings, common)


@app.command()
def serve(
    model: Annotated[
        str | None, typer.Option(help="Packaged alias, hub id, local path or .gguf file. [default: gemma-3-270m]")
    ] = None,
    draft: Annotated[str | None, typer.Option(help="Draft model, or self:N for the target's first N layers.")] = None,
    method: Annotated[
        str | None,
        typer.Option(help="The method of requests that name none (each request may pick its own). [default: auto]"),
    ] = None,
    config: Annotated[str | None, typer.Option(help="A config file from `speculum tune --out`.")] = None,
    param: Annotated[
        list[str] | None,
        typer.Option(help="Method parameter key=value (repeatable); pool_path=FILE keeps the pool across restarts."),
    ] = None,
    host: Annotated[str, typer.Option(help="Address to bind; loopback by default.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535)] = 8000,
    api_key: Annotated[
        str | None,
        typer.Option(
            envvar="SPECULUM_API_KEY", help="Every endpoint but /health then needs 'Authorization: Bearer KEY'."
        ),
    ] = None,
    served_model_name: Annotated[str | None, typer.Option(help="The name clients send as 'model'.")] = None,
    max_queue: Annotated[int, typer.Option(min=1, help="Requests that may wait; more get 503 + Retry-After.")] = 128,
    max_batch: Annotated[
        int, typer.Option(min=1, help="Requests decoded together, one target forward per step for all of them.")
    ] = 16,
    prefill_chunk: Annotated[
        int, typer.Option(min=1, help="Prompt tokens prefilled between two decoding steps.")
    ] = 256,
    request_timeout: Annotated[
        float, typer.Option(min=0.1, help="Seconds a request may take, queueing included.")
    ] = 600.0,
    max_tokens: Annotated[int, typer.Option(min=1, help="The most tokens a request may ask for.")] = 4096,
    max_body_bytes: Annotated[int, typer.Option(min=1, help="The largest request body; larger get 413.")] = 1048576,
    share_pools: Annotated[
        bool,
        typer.Option(
            help="Keep drafters' pools across requests (persist, reuse_history, pool_path), shared by every "
            "client: one client's statistics may then show what another's requests generated. "
            "Off: each request drafts from its own text only."
        ),
    ] = False,
    pool_save_interval: Annotated[
        float, typer.Option(min=0.0, help="Seconds between saves of pools with a pool_path (and at shutdown).")
    ] = 60.0,
    dtype: Annotated[str, typer.Option(help="auto, float32, bfloat16, float16.")] = "auto",
    device: Annotated[str, typer.Option(help="cpu, cuda, cuda:N or auto.")] = "cpu",
    draft_device: Annotated[str | None, typer.Option(help="Put the draft model on another device.")] = None,
    gguf_file: Annotated[str | None, typer.Option(help="GGUF file name inside --model.")] = None,
    prepack: Annotated[
        bool,
        typer.Option(
            help="oneDNN-prepacked weights on CPU: float32, and bfloat16 where the CPU has it natively (faster)."
        ),
    ] = True,
    log_level: Annotated[str, typer.Option(help="uvicorn's log level.")] = "info",
) -> None:
    """Serve the model over an OpenAI-compatible HTTP API (streaming, speculation statistics) with a
    live page at /. Up to --max-batch requests decode together (continuous batching: a request joins
    the running batch between two steps); the others wait in a bounded queue."""
    import speculum

    try:
        from speculum.server import ServerSettings, server_config
        from speculum.server import serve as run_server
    except ImportError as error:
        fail(f"speculum serve needs the server extra: pip install 'speculum[server]' ({error})")
    try:
        params = parse_params(param or [])
        if config is not None:
            file_config = speculum.SpeculativeConfig.from_file(config)
            if method is not None and method != file_config.method:
                fail(f"--method {method} contradicts the config file's method {file_config.method}")
            spec_config = speculum.SpeculativeConfig.coerce(file_config, **params)
            model = model or file_config.metadata.get("model")
            draft = draft or file_config.metadata.get("draft")
        else:
            spec_config = speculum.SpeculativeConfig.coerce(method or DEFAULT_METHOD, **params)
        server_config(spec_config, share_pools)  # refuses persistent pools without --share-pools, before loading
        model = model or "gemma-3-270m"
        if api_key is None and host not in ("127.0.0.1", "localhost", "::1"):
            err.print(
                f"[yellow]warning:[/yellow] serving on {host} without --api-key: anyone who reaches it may use it"
            )
        with err.status(f"loading {model}" + (f" + {draft}" if draft else "")):
            spec = speculum.load(
                model,
                draft,
                dtype=dtype,
                device=device,
                draft_device=draft_device,
                gguf_file=gguf_file,
                prepack="auto" if prepack else False,
            )
        spec.default_config = spec_config
        settings = ServerSettings(
            model_name=served_model_name or model,
            api_key=api_key or None,
            max_queue=max_queue,
            max_batch=max_batch,
            prefill_chunk=prefill_chunk,
            request_timeout=request_timeout,
            max_tokens_limit=max_tokens,
            default_max_tokens=min(256, max_tokens),
            max_body_bytes=max_body_bytes,
            share_pools=share_pools,
            pool_save_interval=pool_save_interval,
        )
        err.print(f"speculum serve: {model} ({spec_config!r}) on http://{host}:{port}/", highlight=False)
        run_server(spec, settings, host=host, port=port, log_level=log_level)
    except SpeculumError as error:
        fail(str(error))


def _register_bench() -> None:
    from speculum.bench.command import bench

    app.command("bench")(bench)


_register_bench()


def main() -> None:
    try:
        app()
    except SpeculumError as error:  # anything a command did not catch itself
        err.print(f"[red]error:[/red] {error}", highlight=False)
        sys.exit(2)


if __name__ == "__main__":
    main()
