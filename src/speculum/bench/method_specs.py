"""Method specs: the rows of a bench, named ``name``, ``name:key=value,...`` or a tuned config file."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from speculum.errors import InvalidInputError, SpeculumError
from speculum.methods import METHODS, SpeculativeConfig

HF_METHODS = ("hf_generate", "hf_assisted", "hf_prompt_lookup")
BASELINE_METHODS = ("autoregressive", "hf_generate")
DEFAULT_METHODS = "autoregressive,prompt_lookup"


@dataclass(frozen=True)
class MethodSpec:
    label: str  # the spec string as given (the row label)
    name: str
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def is_transformers(self) -> bool:
        return self.name in HF_METHODS

    def to_config(self):
        """The ``SpeculativeConfig`` for a speculum method."""
        try:
            return SpeculativeConfig(method=self.name, **self.params)
        except SpeculumError:
            raise
        except (TypeError, ValueError) as e:
            raise InvalidInputError(f"method {self.label!r}: {e}") from None


def parse_value(text: str) -> Any:
    """``"5"`` -> 5, ``"0.5"`` -> 0.5, ``"true"``/``"false"`` -> bool, ``"none"`` -> None, else the string."""
    t = text.strip()
    low = t.lower()
    if low in ("true", "yes", "on"):
        return True
    if low in ("false", "no", "off"):
        return False
    if low in ("none", "null"):
        return None
    try:
        return int(t)
    except ValueError:
        pass
    try:
        return float(t)
    except ValueError:
        return t


def parse_method_spec(spec: str, known: Iterable[str] | None = None) -> MethodSpec:
    """Parse ``name``, ``name:key=value,key=value`` (``-`` in keys reads as ``_``) or the path of a
    config file (``tuned.json``, from ``speculum tune --out``), each optionally followed by ``#tag``:
    a row of its own that runs the same method again (``autoregressive#2`` beside ``autoregressive``
    measures the run's noise floor: an A/A comparison).

    ``known``: the accepted method names (speculum's plus :data:`HF_METHODS`); ``None`` skips that check.
    """
    label = spec.strip()
    if not label:
        raise InvalidInputError("empty method spec")
    body, hash_sign, tag = label.rpartition("#")
    if hash_sign:
        if not body.strip() or not tag.replace("-", "").replace("_", "").isalnum():
            raise InvalidInputError(
                f"method spec {label!r}: a tag after '#' is letters, digits, '-' or '_' (e.g. autoregressive#2)"
            )
    else:
        body = label
    body = body.strip()
    if body.endswith(".json"):  # a config file from `speculum tune --out` (optionally written @file.json)
        config = SpeculativeConfig.from_file(body.removeprefix("@"))
        return MethodSpec(label, config.method, config.all_params())
    name, sep, rest = body.partition(":")
    name = name.strip()
    if not name:
        raise InvalidInputError(f"method spec {label!r} has no method name")
    params: dict[str, Any] = {}
    if sep and not rest.strip():
        raise InvalidInputError(f"method spec {label!r}: nothing after ':' (expected key=value,...)")
    if rest.strip():
        for item in rest.split(","):
            key, eq, value = item.partition("=")
            key = key.strip().replace("-", "_")
            if not eq or not key or not value.strip():
                raise InvalidInputError(
                    f"method spec {label!r}: bad parameter {item.strip()!r} (expected key=value, "
                    "e.g. anpd:num_speculative_tokens=5,tree=true)"
                )
            if not key.isidentifier():
                raise InvalidInputError(f"method spec {label!r}: bad parameter name {key!r}")
            if key in params:
                raise InvalidInputError(f"method spec {label!r}: parameter {key!r} given twice")
            params[key] = parse_value(value)
    if known is not None:
        known = list(known)
        if name not in known:
            raise InvalidInputError(f"unknown method {name!r} in {label!r}; known methods: {', '.join(known)}")
    return MethodSpec(label, name, params)


def split_method_specs(text: str | Iterable[str]) -> list[str]:
    """Split ``"a,b:k=1,j=2,c"`` into ``["a", "b:k=1,j=2", "c"]``.

    A comma followed by ``key=`` continues the previous spec's parameters; any other comma starts a
    new spec. Repeated options (a list of strings) are split the same way and concatenated.
    """
    if not isinstance(text, str):
        out: list[str] = []
        for t in text:
            out.extend(split_method_specs(t))
        return out
    specs: list[str] = []
    for part in text.split(","):
        p = part.strip()
        if specs and ":" in specs[-1] and "=" in p and ":" not in p.split("=", 1)[0]:
            specs[-1] = f"{specs[-1]},{p}"
        elif p:
            specs.append(p)
        else:
            raise InvalidInputError(f"empty method name in {text!r}")
    return specs


def known_methods() -> list[str]:
    """speculum's registered methods plus the transformers rows."""
    names = list(METHODS)
    return names + [m for m in HF_METHODS if m not in names]


def parse_methods(text: str | Iterable[str], known: Iterable[str] | None = None) -> list[MethodSpec]:
    specs = [parse_method_spec(s, known) for s in split_method_specs(text)]
    labels = [s.label for s in specs]
    dup = {x for x in labels if labels.count(x) > 1}
    if dup:
        raise InvalidInputError(f"method given twice: {', '.join(sorted(dup))}")
    if not specs:
        raise InvalidInputError("no method given")
    return specs
