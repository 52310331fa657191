"""``python -m speculum.cli``: the ``speculum`` command."""

from speculum.cli import main

main()
