"""Plain decoding through the same engine: the baseline every speedup is measured against."""

from __future__ import annotations

from dataclasses import dataclass

from speculum.drafters.base import Drafter, Resources


@dataclass
class Options:
    pass


class AutoregressiveDrafter(Drafter):
    name = "autoregressive"

    def __init__(self, options: Options | None = None, resources: Resources | None = None):
        self.options = options
