"""Models: choosing a dtype, the packaged registry, the GGUF conversion cache, loading, self-drafts,
draft compatibility. Each job has its own module; this package re-exports the public names."""

from speculum.machine import cache_dir
from speculum.models.compat import check_draft_compatible, vocab_fingerprint
from speculum.models.convert import ensure_converted
from speculum.models.dtypes import DtypeChoice, choose_dtype, resolve_dtype
from speculum.models.loading import check_quantization, eos_token_ids, list_models, load_model, load_with_dtype_choice
from speculum.models.registry import DEFAULT_MODEL, PACKAGED_MODELS, PackagedModel
from speculum.models.self_draft import make_self_draft, parse_draft_spec

__all__ = [
    "DEFAULT_MODEL",
    "DtypeChoice",
    "PACKAGED_MODELS",
    "PackagedModel",
    "cache_dir",
    "check_draft_compatible",
    "choose_dtype",
    "check_quantization",
    "ensure_converted",
    "eos_token_ids",
    "list_models",
    "load_model",
    "load_with_dtype_choice",
    "make_self_draft",
    "parse_draft_spec",
    "resolve_dtype",
    "vocab_fingerprint",
]
