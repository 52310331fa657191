"""``speculum diagnose divergence``: the first op whose output parts from plain decoding's, per layout."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from speculum.cli.common import (
    DEFAULT_MODEL,
    DeviceOption,
    ModelOption,
    PrepackOption,
    QuantizationOption,
    err,
    fail,
    load_models,
)
from speculum.errors import SpeculumError

diagnose_app = typer.Typer(no_args_is_help=True, help="Diagnostics of what a forward computes.")

DEFAULT_PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return"


@diagnose_app.command()
def divergence(
    prompt: Annotated[str, typer.Option(help="The prompt whose last token's position is compared.")] = DEFAULT_PROMPT,
    prompt_ids: Annotated[
        str | None, typer.Option(help="The prompt as comma-separated token ids, instead of --prompt.")
    ] = None,
    model: ModelOption = None,
    dtype: Annotated[str, typer.Option(help="auto, float32, bfloat16, float16.")] = "bfloat16",
    draft_tokens: Annotated[int, typer.Option(help="Draft tokens after the compared one (K).")] = 4,
    batch: Annotated[int, typer.Option(help="Rows of the batched layouts (1: none).")] = 4,
    row: Annotated[int, typer.Option(help="The compared row of the batch.")] = 0,
    node: Annotated[int, typer.Option(help="Compare the K-th draft token's position instead of the root's.")] = 0,
    other: Annotated[
        list[str] | None, typer.Option(help="Another row's prompt (repeatable; default: the prompt rotated).")
    ] = None,
    origins: Annotated[
        bool, typer.Option(help="Also list every module that parts with its input unchanged (where differences start).")
    ] = False,
    json_output: Annotated[bool, typer.Option("--json", help="Print one JSON object instead.")] = False,
    device: DeviceOption = "cpu",
    prepack: PrepackOption = True,
    quantization: QuantizationOption = "none",
) -> None:
    """Run one position as plain decoding and as a verification, a tree and a batch row; report the
    first module whose output differs bitwise, and whether the logits' argmax does."""
    from speculum.models.divergence import find_divergence

    if not prompt.strip() and not prompt_ids:
        fail("the prompt is empty")
    ids = None
    if prompt_ids is not None:
        try:
            ids = [int(t) for t in prompt_ids.split(",") if t.strip()]
        except ValueError:
            fail(f"--prompt-ids expects comma-separated integers, got {prompt_ids!r}")
    if other and len(other) != batch - 1:
        fail(f"--other given {len(other)} times; a batch of {batch} needs {batch - 1}")
    try:
        spec = load_models(
            model or DEFAULT_MODEL,
            None,
            dtype=dtype,
            device=device,
            draft_device=None,
            gguf_file=None,
            prepack=prepack,
            quantization=quantization,
        )
        ids = spec.encode_prompt(prompt) if ids is None else ids
        others = [spec.encode_prompt(text) for text in other] if other else None
        report = find_divergence(
            spec.runner, ids, draft_tokens=draft_tokens, batch=batch, row=row, node=node, others=others
        )
    except SpeculumError as error:
        fail(str(error))
    if json_output:
        print(json.dumps(_as_dict(report, spec)))
        return
    Console().print(_table(report, spec))
    if origins:
        Console().print(_origins_table(report))
    if spec.row_padding is not None:
        err.print(f"linear layers: {spec.row_padding.describe()}", soft_wrap=True, markup=False, highlight=False)


def _table(report, spec) -> Table:
    title = (
        f"{spec.name}, {str(spec.runner.dtype).removeprefix('torch.')}: the first module whose output parts from plain "
        f"decoding's at node {report.node} (reference argmax {report.reference_argmax})"
    )
    table = Table(title=escape(title), title_justify="left")
    for column in ("layout", "first differing module", "type", "rows in that call (plain -> layout)"):
        table.add_column(column, overflow="fold")
    for column in ("max |diff|", "input equal", "logits max |diff|", "argmax equal"):
        table.add_column(column, justify="right")
    for result in report.layouts:
        first = result.first
        layout = f"{result.layout}\n[dim]{escape(result.description)}[/dim]"
        argmax = "yes" if result.argmax_equal else f"[red]no ({result.argmax})[/red]"
        logits = f"{result.logits_max_abs:.3g}"
        if first is None:
            table.add_row(layout, "none: bitwise equal", "", "", "", "", logits, argmax)
            continue
        calls = escape(f"{first.reference_shape} -> {first.shape}")
        inputs = {True: "yes", False: "no", None: "-"}[first.input_equal]
        table.add_row(layout, escape(first.name), first.kind, calls, f"{first.max_abs:.3g}", inputs, logits, argmax)
    return table


def _origins_table(report) -> Table:
    table = Table(title="modules that part with an unchanged input, in execution order", title_justify="left")
    for column in ("layout", "module", "type", "plain -> layout", "max |diff|"):
        table.add_column(column, overflow="fold")
    for result in report.layouts:
        for d in result.origins:
            shapes = escape(f"{d.reference_shape} -> {d.shape}")
            table.add_row(result.layout, escape(d.name), d.kind, shapes, f"{d.max_abs:.3g}")
    return table


def _as_dict(report, spec) -> dict:
    def difference(d) -> dict:
        return {
            "module": d.name,
            "type": d.kind,
            "plain_call": d.reference_shape,
            "layout_call": d.shape,
            "max_abs": d.max_abs,
            "input_equal": d.input_equal,
        }

    return {
        "model": spec.name,
        "dtype": str(spec.runner.dtype).removeprefix("torch."),
        "node": report.node,
        "reference_argmax": report.reference_argmax,
        "row_padding": spec.row_padding.describe() if spec.row_padding is not None else None,
        "layouts": [
            {
                "layout": r.layout,
                "description": r.description,
                "first": difference(r.first) if r.first else None,
                "origins": [difference(d) for d in r.origins],
                "differing_modules": len(r.differences),
                "logits_max_abs": r.logits_max_abs,
                "argmax_equal": r.argmax_equal,
                "argmax": r.argmax,
            }
            for r in report.layouts
        ],
    }
