"""Typed errors: every bad input ends in one of these (the CLI turns them into exit code 2)."""


class SpeculumError(Exception):
    """Base class of every error speculum raises on purpose."""


class InvalidInputError(SpeculumError, ValueError):
    """A prompt, sampling parameter or method parameter that cannot be used."""


class UnknownMethodError(InvalidInputError):
    """A method name that no drafter answers to."""


class ModelLoadError(SpeculumError):
    """A model that cannot be found, read, or trusted (missing alias, bad path, tampered file)."""


class IncompatibleDraftError(SpeculumError):
    """A draft model whose tokenizer or vocabulary does not match the target's."""


class PoolFileError(SpeculumError):
    """A saved drafter table (n-gram pool, phrase pool) that is corrupt or belongs to another model."""


class ConfigFileError(InvalidInputError):
    """A method config file (``speculum tune --out``) that cannot be read or is not one."""


class CheckpointError(SpeculumError):
    """A trained head checkpoint that is corrupt, half-written, or belongs to another model."""


class ReplayError(InvalidInputError):
    """An exact replay (:mod:`speculum.bench.replay`) asked for something its record cannot give exactly."""
