"""speculum: lossless speculative decoding for Hugging Face causal language models."""

from speculum.api import GenerationResult, GenerationStream, Speculum, StreamChunk, load
from speculum.errors import (
    CheckpointError,
    ConfigFileError,
    IncompatibleDraftError,
    InvalidInputError,
    ModelLoadError,
    PoolFileError,
    SpeculumError,
    UnknownMethodError,
)
from speculum.methods import METHODS, SpeculativeConfig
from speculum.sampling import SamplingParams
from speculum.stats import Stats

__version__ = "0.1.0"

__all__ = [
    "METHODS",
    "CheckpointError",
    "ConfigFileError",
    "GenerationResult",
    "GenerationStream",
    "IncompatibleDraftError",
    "InvalidInputError",
    "ModelLoadError",
    "PoolFileError",
    "SamplingParams",
    "Speculum",
    "SpeculativeConfig",
    "SpeculumError",
    "Stats",
    "StreamChunk",
    "UnknownMethodError",
    "load",
]
