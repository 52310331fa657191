"""What the sub-commands share: the typer app, the one-line error exit, ``--param`` parsing, the
method's configuration from ``--method``/``--config``, and the options several commands declare alike."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.console import Console

import speculum
from speculum.bench.method_specs import parse_value
from speculum.methods import DEFAULT_METHOD, SpeculativeConfig

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Lossless speculative decoding for Hugging Face causal language models.",
    pretty_exceptions_enable=False,
)
err = Console(stderr=True)

DEFAULT_MODEL = "gemma-3-270m"


def fail(message: str) -> None:
    """End the command with ``message`` on one line of stderr and exit code 2."""
    err.print(f"[red]error:[/red] {message}", highlight=False)
    raise typer.Exit(2)


def parse_params(items: list[str]) -> dict:
    """``key=value`` pairs with typed values (int, float, bool, null, str)."""
    params = {}
    for item in items:
        if "=" not in item:
            fail(f"--param expects key=value, got {item!r}")
        key, value = item.split("=", 1)
        params[key.strip().replace("-", "_")] = parse_value(value.strip())
    return params


def resolve_config(
    method: str | None, config_file: str | None, params: dict, model: str | None, draft: str | None
) -> tuple[SpeculativeConfig, str | None, str | None]:
    """The configuration to run and the target and draft to load.

    With ``--config`` the file's method runs with ``params`` over its parameters, and the file's model and
    draft stand in for the ones not given; otherwise ``method`` (or the default one) runs with ``params``."""
    if config_file is None:
        return SpeculativeConfig.coerce(method or DEFAULT_METHOD, **params), model, draft
    file_config = SpeculativeConfig.from_file(config_file)
    if method is not None and method != file_config.method:
        fail(f"--method {method} contradicts the config file's method {file_config.method}")
    model = model or file_config.metadata.get("model")
    draft = draft or file_config.metadata.get("draft")
    return SpeculativeConfig.coerce(file_config, **params), model, draft


def loading(model: str, draft: str | None = None):
    """A spinner on stderr while the models load."""
    return err.status(f"loading {model}" + (f" + {draft}" if draft else ""))


def load_models(
    model: str,
    draft: str | None,
    *,
    dtype: str,
    device: str,
    draft_device: str | None,
    gguf_file: str | None,
    prepack: bool,
    exact: str = "auto",
    quantization: str = "auto",
):
    """``speculum.load`` as ``generate`` and ``serve`` call it, under the loading spinner."""
    if exact not in ("auto", "on", "off"):
        fail(f"--exact must be auto, on or off, got {exact!r}")

    with loading(model, draft):
        return speculum.load(
            model,
            draft,
            dtype=dtype,
            device=device,
            draft_device=draft_device,
            gguf_file=gguf_file,
            prepack="auto" if prepack else False,
            exact={"on": True, "off": False}.get(exact, exact),
            quantization=quantization,
        )


# Options that mean the same in every command that has them
ModelOption = Annotated[
    str | None, typer.Option(help="Packaged alias, hub id, local path or .gguf file. [default: gemma-3-270m]")
]
DraftOption = Annotated[str | None, typer.Option(help="Draft model, or self:N for the target's first N layers.")]
DtypeOption = Annotated[str, typer.Option(help="auto, float32, bfloat16, float16.")]
ExactOption = Annotated[
    str,
    typer.Option(help="auto, on or off: output independent of drafts and batch rows (auto: on in half precision)."),
]
QuantizationOption = Annotated[
    str,
    typer.Option(
        help="auto, none or gguf: a GGUF model's linear layers on the file's own quantized weights (CPU; auto: "
        "where measured faster)."
    ),
]
DeviceOption = Annotated[str, typer.Option(help="cpu, cuda, cuda:N or auto.")]
DraftDeviceOption = Annotated[str | None, typer.Option(help="Put the draft model on another device.")]
GgufFileOption = Annotated[str | None, typer.Option(help="GGUF file name inside --model.")]
PrepackOption = Annotated[
    bool,
    typer.Option(help="oneDNN-prepacked weights on CPU: float32, and bfloat16 where the CPU has it natively (faster)."),
]
ThreadsOption = Annotated[int | None, typer.Option(min=1, help="torch.set_num_threads.")]
