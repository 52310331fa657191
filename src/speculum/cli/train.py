"""``speculum train``: the parts some methods learn. ``acceptance-head`` trains SpecDec++'s acceptance
head (:mod:`speculum.training.acceptance`); ``medusa`` and ``ctc-drafter`` train draft heads on the frozen
target's own predictions (:mod:`speculum.training.draft_heads`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

import speculum
from speculum.cli.common import DEFAULT_MODEL, ThreadsOption, err, fail
from speculum.errors import SpeculumError
from speculum.training.texts import training_texts

train_app = typer.Typer(
    no_args_is_help=True,
    help="Train the parts some methods learn (acceptance heads, Medusa heads, the CTC draft module).",
)

# Options the three commands (or the two draft-head ones) declare alike
TargetOption = Annotated[str, typer.Option(help="Target model.")]
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


@train_app.command("acceptance-head")
def train_acceptance_head(
    draft: Annotated[str, typer.Option(help="The draft model the head reads (a model or self:N).")],
    out: Annotated[str, typer.Option(help="Checkpoint directory (also caches the training data).")],
    model: TargetOption = DEFAULT_MODEL,
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
    threads: ThreadsOption = None,
    regenerate: Annotated[bool, typer.Option(help="Remake the cached training data.")] = False,
    resume: Annotated[bool, typer.Option(help="Continue from the checkpoint in --out.")] = False,
) -> None:
    """Train SpecDec++'s acceptance head for a target/draft pair (teacher-forced data, weighted BCE)."""
    import torch

    from speculum.training import acceptance

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


def _train_draft_heads(kind: str, model: str, out: str, texts: str, data_settings, settings, common: dict) -> None:
    """Load the target, make (or reuse) the distillation data and train ``kind``'s heads into ``out``."""
    import torch

    from speculum.training import draft_heads

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
    model: TargetOption = DEFAULT_MODEL,
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
    threads: ThreadsOption = None,
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
    model: TargetOption = DEFAULT_MODEL,
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
    threads: ThreadsOption = None,
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
