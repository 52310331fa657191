"""``speculum models``: the packaged model aliases and whether they are installed."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table


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
            escape(row["pip"]),  # "[gemma]" is an extra, not rich markup
        )
    Console().print(table)
