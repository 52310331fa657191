"""The method registry and ``SpeculativeConfig``: the one place a method and its parameters are named."""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

from speculum.errors import InvalidInputError, UnknownMethodError

# method name -> "module:DrafterClass"; each module also defines an ``Options`` dataclass.
METHODS: dict[str, str] = {
    "autoregressive": "speculum.drafters.autoregressive:AutoregressiveDrafter",
    "draft_model": "speculum.drafters.draft_model:DraftModelDrafter",
    "prompt_lookup": "speculum.drafters.prompt_lookup:PromptLookupDrafter",
    "anpd": "speculum.drafters.anpd:AnpdDrafter",
    "lookahead": "speculum.drafters.lookahead:LookaheadDrafter",
    "ouroboros": "speculum.drafters.ouroboros:OuroborosDrafter",
}


def _frozen(value: Any) -> Any:
    if isinstance(value, dict):
        return tuple((k, _frozen(v)) for k, v in sorted(value.items(), key=str))
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [_frozen(v) for v in value]
        return tuple(sorted(items, key=repr)) if isinstance(value, (set, frozenset)) else tuple(items)
    return value


class SpeculativeConfig:
    """A method and its parameters, vLLM-style::

        SpeculativeConfig(method="draft_model", num_speculative_tokens=5, length_policy="fixed")

    Parameters other than ``method`` and ``num_speculative_tokens`` are method-specific; unknown
    ones are refused with the list of valid names.
    """

    def __init__(self, method: str = "autoregressive", num_speculative_tokens: int | None = None, **params: Any):
        if method not in METHODS:
            raise UnknownMethodError(f"unknown method {method!r}; choose one of: {', '.join(METHODS)}")
        self.method = method
        self.num_speculative_tokens = num_speculative_tokens
        self.params = dict(params)
        self.options()  # validate now, not in the middle of a generation

    def drafter_class(self) -> type:
        module_name, class_name = METHODS[self.method].split(":")
        return getattr(importlib.import_module(module_name), class_name)

    def options(self):
        options_cls = importlib.import_module(METHODS[self.method].split(":")[0]).Options
        names = {f.name for f in dataclasses.fields(options_cls)}
        values = dict(self.params)
        if self.num_speculative_tokens is not None:
            values["num_speculative_tokens"] = self.num_speculative_tokens
        unknown = sorted(set(values) - names)
        if unknown:
            valid = ", ".join(sorted(names)) or "none"
            raise InvalidInputError(f"method {self.method!r} has no parameter {', '.join(unknown)}; valid: {valid}")
        try:
            return options_cls(**values)
        except TypeError as err:
            raise InvalidInputError(f"bad parameters for {self.method!r}: {err}") from None

    def key(self) -> tuple:
        """A hashable identity (drafters are cached by it); list values such as tree choices become tuples."""
        return (self.method, self.num_speculative_tokens, _frozen(sorted(self.params.items(), key=str)))

    def __repr__(self) -> str:
        extra = "".join(f", {k}={v!r}" for k, v in self.params.items())
        k = f", num_speculative_tokens={self.num_speculative_tokens}" if self.num_speculative_tokens else ""
        return f"SpeculativeConfig(method={self.method!r}{k}{extra})"

    @classmethod
    def coerce(cls, method: str | SpeculativeConfig, **params: Any) -> SpeculativeConfig:
        if isinstance(method, SpeculativeConfig):
            if params:
                merged = {**method.params, **params}
                k = merged.pop("num_speculative_tokens", method.num_speculative_tokens)
                return cls(method.method, k, **merged)
            return method
        if not isinstance(method, str):
            raise InvalidInputError(f"method must be a name or a SpeculativeConfig, got {type(method).__name__}")
        k = params.pop("num_speculative_tokens", None)
        return cls(method, k, **params)
