"""``speculum export``: trained parts in another engine's layout. ``vllm-medusa`` writes Medusa heads
as the checkpoint vLLM's ``medusa`` method loads (:mod:`speculum.integrations.vllm.medusa_export`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from speculum.cli.common import DEFAULT_MODEL, err, fail
from speculum.errors import SpeculumError

# vLLM 0.32 registers a truncated vocabulary's token_map as a parameter while loading, then
# refuses it as one the checkpoint did not initialise, unless this check is off
LOADER_CONFIG = {"enable_weights_track": False}

export_app = typer.Typer(no_args_is_help=True, help="Write trained heads in another engine's layout (vLLM).")


@export_app.command("vllm-medusa")
def export_vllm_medusa(
    heads: Annotated[str, typer.Argument(help="Medusa heads: a checkpoint directory from `speculum train medusa`.")],
    out: Annotated[str, typer.Argument(help="Directory to write vLLM's Medusa checkpoint into.")],
    model: Annotated[
        str, typer.Option(help="The target the heads were trained for (its LM-head rows are written).")
    ] = DEFAULT_MODEL,
    force: Annotated[bool, typer.Option(help="Replace OUT if it is not empty.")] = False,
) -> None:
    """Export Medusa heads for vLLM: speculative_config {"method": "medusa", "model": OUT}."""
    if not Path(heads).is_dir():
        fail(f"{heads!r} is not a directory of Medusa heads")
    try:
        from speculum.heads import load_draft_head
        from speculum.integrations.vllm.medusa_export import export_vllm_medusa as export
        from speculum.models import load_model

        load_draft_head(heads, "medusa")  # not Medusa heads: said before the model loads
        with err.status(f"loading {model}"):
            target, _ = load_model(model, dtype="float32")  # the LM-head rows as they are, unrounded
        config = export(heads, target, out, force=force)
    except SpeculumError as error:
        fail(str(error))
    spec = {"method": "medusa", "model": out, "num_speculative_tokens": config["num_heads"]}
    loader = ""
    if config["truncated_vocab_size"] < config["vocab_size"]:
        loader = f" --model-loader-extra-config '{json.dumps(LOADER_CONFIG)}'"
    Console(soft_wrap=True).print(
        f"use it: vllm serve {model} --speculative-config '{json.dumps(spec)}'{loader}", highlight=False
    )
