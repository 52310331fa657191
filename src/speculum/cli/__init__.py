"""Command line: ``speculum generate``, ``models``, ``tune``, ``serve``, ``bench``, ``train``, ``export``
and ``diagnose``.

One module per sub-command (``train`` holds its three, ``export`` and ``diagnose`` one each); this module puts them
on the typer app of :mod:`speculum.cli.common` in the order ``speculum --help`` lists them, and
:func:`main` is the console entry point. Every error a user can cause ends in one line on stderr and
exit code 2, never a traceback.

torch, the modules that load it or transformers (sampling, the tuner, the training loops, the model
table) and the optional server extra are imported inside the commands that use them: the command line
itself then adds none of them to ``speculum --help`` or to a command's argument checks, and ``serve``
can say which extra is missing.
"""

from __future__ import annotations

import sys

from speculum.bench.command import bench
from speculum.cli import diagnose, export, generate, models, serve, train, tune
from speculum.cli.common import app, err
from speculum.errors import SpeculumError

app.command()(generate.generate)
app.command()(models.models)
app.command()(tune.tune)
app.command()(serve.serve)
app.command("bench")(bench)
app.add_typer(train.train_app, name="train")
app.add_typer(export.export_app, name="export")
app.add_typer(diagnose.diagnose_app, name="diagnose")


def main() -> None:
    try:
        app()
    except SpeculumError as error:  # anything a command did not catch itself
        err.print(f"[red]error:[/red] {error}", highlight=False)
        sys.exit(2)
