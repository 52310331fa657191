"""The method registry and ``SpeculativeConfig``: the one place a method and its parameters are named."""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
from typing import Any

import torch

from speculum import machine
from speculum.errors import ConfigFileError, InvalidInputError, UnknownMethodError
from speculum.poolfile import write_atomic

CONFIG_FORMAT = "speculum-config"
CONFIG_VERSION = 1

# method name -> "module:DrafterClass"; each module also defines an ``Options`` dataclass.
METHODS: dict[str, str] = {
    "autoregressive": "speculum.drafters.autoregressive:AutoregressiveDrafter",
    "draft_model": "speculum.drafters.draft_model:DraftModelDrafter",
    "prompt_lookup": "speculum.drafters.prompt_lookup:PromptLookupDrafter",
    "anpd": "speculum.drafters.anpd:AnpdDrafter",
    "lookahead": "speculum.drafters.lookahead:LookaheadDrafter",
    "ouroboros": "speculum.drafters.ouroboros:OuroborosDrafter",
    "medusa": "speculum.drafters.medusa:MedusaDrafter",
    "ctc": "speculum.drafters.ctc:CTCDrafter",
    "auto": "speculum.drafters.auto:AutoDrafter",
}


def _frozen(value: Any) -> Any:
    if isinstance(value, dict):
        return tuple((k, _frozen(v)) for k, v in sorted(value.items(), key=str))
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [_frozen(v) for v in value]
        return tuple(sorted(items, key=repr)) if isinstance(value, (set, frozenset)) else tuple(items)
    return value


# Whether the controller (speculum.controller) runs when a config does not say: it decides each
# round whether drafting pays on this machine and which draft nodes to verify. On by default: with
# it no n-gram, lookahead or head method runs meaningfully slower than plain decoding, where heads
# without it can, and draft_model gains by it too (without it, it can fall below plain decoding on
# short requests; see docs/results.md). preset="paper" turns it off (the published method).
DEFAULT_CONTROLLER = True

# The method of generate(), `speculum generate` and `speculum serve` when none is named.
DEFAULT_METHOD = "auto"

# Defaults measured on a class of machine. A method's Options hold the published settings (the
# "paper" preset); on a device listed here the "machine" preset (the default) replaces them with
# the setting measured best there, chosen on tuning prompts, never on the report sets (see
# docs/tuning.md). A setting is one combination: when a config gives any of its parameters, the rest
# stay the published ones (a fixed length policy must not inherit a confidence stop's bound of 20).
# A machine class ("cpu/avx2", see machine_class) listed here replaces its device's setting of each
# method it names, whole.
PRESETS = ("machine", "paper")
MACHINE_DEFAULTS: dict[str, dict[str, dict[str, Any]]] = {
    "cpu": {
        # `speculum tune --method ouroboros --dataset mbpp` chooses K=4, W=0 and context phrases; the
        # chain stops on the draft's confidence and takes one pool guess, as tuned for T=1, which
        # also beats a fixed chain of 4 with two guesses greedy. The confidence stop is only a floor:
        # the controller's chain stop decides the depth above it (see docs/tuning.md)
        "ouroboros": {
            "num_speculative_tokens": 4,
            "window_size": 0,
            "draft_guesses": 1,
            "context_phrases": True,
            "length_policy": "confidence",
            "confidence_threshold": 0.2,
        },
        # the confidence stop, best on the SpecDec++ tuning prompts, as a floor: the controller's
        # chain stop decides the depth above it
        "draft_model": {"length_policy": "confidence", "confidence_threshold": 0.5, "num_speculative_tokens": 20},
        # one Jacobi column (W=1, N=G=4) with the prompt's n-grams in the pool: LADE's 7x5x7 window
        # and guess set cost more than they return on CPU verification, and so does W=N=G=4, on each
        # class of CPU (AVX2, AVX-512 with and without native bf16; see docs/results.md). The
        # window's probes verify 3 nodes instead of 12; the guesses bring most accepted tokens
        "lookahead": {"window_size": 1, "ngram_size": 4, "guess_set_size": 4, "pool_from_prompt": True},
        # the likeliest output prefixes: chosen by `speculum tune` for the Qwen 1.5B module (mbpp), and
        # more accepted tokens for Gemma's shipped module on its tuning prompts
        "ctc": {"tree": "prefix"},
    },
    # A class of CPU whose measurements differ from the device's gets an entry here ("cpu/avx2":
    # {...}); none does: a setting that wins on every class measured is the device's.
}


# Where a method's best setting differs for sampled requests (temperature > 0): what changes over the
# device's setting above, for those requests only (the drafter of a sampled request is built with it).
SAMPLED_MACHINE_DEFAULTS: dict[str, dict[str, dict[str, Any]]] = {
    # (empty: Ouroboros' T=1 setting, the confidence stop and one pool guess, wins greedy too, so it
    # is its one CPU setting)
    "cpu": {},
}


def machine_class(device_type: str | None) -> str:
    """The class of machine whose measured settings apply on a device of ``device_type``: on a CPU,
    "cpu/" and the vector instruction set torch computes with (``torch.backends.cpu.
    get_cpu_capability()``: "cpu/avx2", "cpu/avx512", ...; ``ATEN_CPU_CAPABILITY`` overrides it),
    with "_bf16" where an AVX-512 CPU computes bfloat16 natively ("cpu/avx512_bf16"),
    since what a tree of n nodes costs to verify against one token differs most between them
    (see docs/results.md); elsewhere the device type itself."""
    if device_type != "cpu":
        return device_type or ""
    capability = torch.backends.cpu.get_cpu_capability().lower().replace(" ", "_")
    # native bfloat16 changes what runs (dtype="auto" picks it) and what a tree costs: its own class
    if capability.startswith("avx512") and "bf16" not in capability and machine.cpu_has_fast_bf16():
        capability += "_bf16"
    return "cpu/" + capability


def machine_defaults(method: str, device_type: str | None, sampled: bool = False) -> dict[str, Any]:
    """The measured setting of ``method`` on a device of ``device_type`` ("cpu", "cuda") for greedy
    or ``sampled`` requests, or {}: its machine class's (see :func:`machine_class`) where that class
    has one for the method, else the device's."""
    klass = machine_class(device_type)
    where = klass if method in MACHINE_DEFAULTS.get(klass, {}) else device_type or ""
    measured = dict(MACHINE_DEFAULTS.get(where, {}).get(method, {}))
    if sampled:  # what changes for sampled requests over that same setting
        measured.update(SAMPLED_MACHINE_DEFAULTS.get(where, {}).get(method, {}))
    return measured


class SpeculativeConfig:
    """A method and its parameters, vLLM-style::

        SpeculativeConfig(method="draft_model", num_speculative_tokens=5, length_policy="fixed")

    Parameters other than ``method``, ``num_speculative_tokens`` and ``controller`` are
    method-specific; unknown ones are refused with the list of valid names. ``controller``: let the
    controller decide each round whether to draft and what to verify (None: ``DEFAULT_CONTROLLER``,
    off with ``preset="paper"``; False: the method exactly as published, for ablations and
    reproductions).
    """

    def __init__(
        self,
        method: str = "autoregressive",
        num_speculative_tokens: int | None = None,
        controller: bool | None = None,
        preset: str = "machine",
        **params: Any,
    ):
        if method not in METHODS:
            raise UnknownMethodError(f"unknown method {method!r}; choose one of: {', '.join(METHODS)}")
        if controller is not None and not isinstance(controller, bool):
            raise InvalidInputError(f"controller must be true or false, got {controller!r}")
        if preset not in PRESETS:
            raise InvalidInputError(f"preset must be one of {', '.join(PRESETS)}, got {preset!r}")
        self.method = method
        self.preset = preset
        self.num_speculative_tokens = num_speculative_tokens
        self.controller = controller
        self.params = dict(params)
        self.metadata: dict[str, Any] = {}  # what a config file said besides the method (model, draft, tuning)
        self.options()  # validate now, not in the middle of a generation

    def drafter_class(self) -> type:
        module_name, class_name = METHODS[self.method].split(":")
        return getattr(importlib.import_module(module_name), class_name)

    def options(self, device_type: str | None = None, sampled: bool = False):
        """The method's Options: the parameters given, over the measured setting for ``device_type``
        and greedy or ``sampled`` requests (preset "machine", when no parameter of that setting is
        given), over the published defaults."""
        options_cls = importlib.import_module(METHODS[self.method].split(":")[0]).Options
        names = {f.name for f in dataclasses.fields(options_cls)}
        values = dict(self.params)
        if self.num_speculative_tokens is not None:
            values["num_speculative_tokens"] = self.num_speculative_tokens
        measured = machine_defaults(self.method, device_type, sampled) if self.preset == "machine" else {}
        if not set(measured) & set(values):
            values = {**measured, **values}
        unknown = sorted(set(values) - names)
        if unknown:
            valid = ", ".join(sorted(names)) or "none"
            raise InvalidInputError(f"method {self.method!r} has no parameter {', '.join(unknown)}; valid: {valid}")
        try:
            return options_cls(**values)
        except TypeError as err:
            raise InvalidInputError(f"bad parameters for {self.method!r}: {err}") from None

    def key(self) -> tuple:
        """A hashable identity of the drafter (drafters are cached by it; the controller setting is not
        part of it); list values such as tree choices become tuples."""
        return (self.method, self.num_speculative_tokens, self.preset, _frozen(sorted(self.params.items(), key=str)))

    def controlled(self) -> bool:
        """Whether the controller runs for this config (never for plain decoding: nothing to decide;
        always for ``auto`` unless turned off: choosing what pays is what ``auto`` is).

        The controller decides on measured times, so which rounds draft changes from run to run; a
        seed still pins a sampled text, which is sampled by noise fixed per position
        (``PositionNoise``) and so does not depend on what was drafted."""
        if self.method == "auto":
            default = True
        else:  # the published settings are the published method: no controller unless asked for
            default = DEFAULT_CONTROLLER and self.preset != "paper"
        wanted = default if self.controller is None else self.controller
        return wanted and self.method != "autoregressive"

    def __repr__(self) -> str:
        extra = "".join(f", {k}={v!r}" for k, v in self.params.items())
        k = f", num_speculative_tokens={self.num_speculative_tokens}" if self.num_speculative_tokens else ""
        c = f", controller={self.controller}" if self.controller is not None else ""
        c += f", preset={self.preset!r}" if self.preset != "machine" else ""
        return f"SpeculativeConfig(method={self.method!r}{k}{c}{extra})"

    def all_params(self) -> dict[str, Any]:
        """The parameters as given, ``num_speculative_tokens`` and ``controller`` included when set."""
        extra = {} if self.num_speculative_tokens is None else {"num_speculative_tokens": self.num_speculative_tokens}
        if self.controller is not None:
            extra["controller"] = self.controller
        if self.preset != "machine":
            extra["preset"] = self.preset
        return {**extra, **self.params}

    # ------------------------------------------------------------------ config files

    def save(self, path: str | os.PathLike[str], **metadata: Any) -> None:
        """Write this configuration as a JSON config file (atomically), with ``metadata`` such as
        ``model``, ``draft`` and how it was tuned; ``load(config=...)``, ``generate`` and ``bench`` read it."""
        doc = {
            "format": CONFIG_FORMAT,
            "version": CONFIG_VERSION,
            "method": self.method,
            "params": self.all_params(),
            **{k: v for k, v in {**self.metadata, **metadata}.items() if v is not None},
        }
        data = (json.dumps(doc, indent=2, sort_keys=False) + "\n").encode("utf-8")
        write_atomic(path, data, what="config file", error=ConfigFileError)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> SpeculativeConfig:
        """Read a config file written by :meth:`save` (``speculum tune --out``); ConfigFileError if it is not one."""
        where = str(path)
        try:
            with open(path, encoding="utf-8") as f:
                doc = json.load(f)
        except OSError as exc:
            raise ConfigFileError(f"cannot read config file {where!r}: {exc.strerror or exc}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ConfigFileError(f"config file {where!r} is not valid JSON: {exc}") from None
        if not isinstance(doc, dict) or doc.get("format") != CONFIG_FORMAT:
            raise ConfigFileError(f'{where!r} is not a speculum config file (no "format": "{CONFIG_FORMAT}")')
        if doc.get("version") != CONFIG_VERSION:
            found = doc.get("version")
            raise ConfigFileError(f"config file {where!r} has version {found!r}; this speculum reads {CONFIG_VERSION}")
        params = doc.get("params", {})
        if not isinstance(doc.get("method"), str) or not isinstance(params, dict):
            raise ConfigFileError(f'config file {where!r} needs a "method" name and a "params" object')
        try:
            config = cls.coerce(doc["method"], **params)
        except InvalidInputError as exc:
            raise ConfigFileError(f"config file {where!r}: {exc}") from None
        config.metadata = {k: v for k, v in doc.items() if k not in ("format", "version", "method", "params")}
        return config

    @staticmethod
    def is_file_reference(method: Any) -> bool:
        """Whether ``method`` names a config file rather than a method (a path ending in .json)."""
        return isinstance(method, (str, os.PathLike)) and str(method).endswith(".json")

    @classmethod
    def coerce(cls, method: str | SpeculativeConfig, **params: Any) -> SpeculativeConfig:
        """A config from a method name, a config file path (``*.json``) or a config, with ``params`` on top."""
        if cls.is_file_reference(method):
            method = cls.from_file(method)
        if isinstance(method, SpeculativeConfig):
            if params:
                merged = {**method.params, **params}
                k = merged.pop("num_speculative_tokens", method.num_speculative_tokens)
                controller = merged.pop("controller", method.controller)
                preset = merged.pop("preset", method.preset)
                config = cls(method.method, k, controller, preset, **merged)
                config.metadata = dict(method.metadata)
                return config
            return method
        if not isinstance(method, str):
            raise InvalidInputError(f"method must be a name or a SpeculativeConfig, got {type(method).__name__}")
        k = params.pop("num_speculative_tokens", None)
        controller = params.pop("controller", None)
        preset = params.pop("preset", "machine")
        return cls(method, k, controller, preset, **params)
