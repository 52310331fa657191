"""Whether a draft model can propose tokens the target verifies as the same tokens."""

from __future__ import annotations

import hashlib
from typing import Any

from speculum.errors import IncompatibleDraftError


def device_of(module: Any) -> Any:
    """Where a module's tensors live: its first parameter's device, else its first buffer's (a
    quantized embedding holds only buffers)."""
    for tensor in (*module.parameters(), *module.buffers()):
        return tensor.device
    return None


def vocab_fingerprint(tokenizer: Any) -> str:
    """SHA-256 over the tokenizer's sorted (token, id) pairs: equal iff the vocabularies are equal."""
    vocab = tokenizer.get_vocab()
    h = hashlib.sha256()
    for token, idx in sorted(vocab.items(), key=lambda kv: kv[1]):
        h.update(f"{idx}\t{token}\n".encode("utf-8", "surrogatepass"))
    return h.hexdigest()


def _embedding_rows(model: Any) -> int | None:
    try:
        return int(model.get_input_embeddings().num_embeddings)
    except Exception:
        config = getattr(model, "config", None)
        text = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
        return getattr(text, "vocab_size", None)


def _output_rows(model: Any) -> int | None:
    try:
        head = model.get_output_embeddings()
        if head is None:
            return _embedding_rows(model)
        return int(getattr(head, "out_features", None) or head.weight.shape[0])
    except Exception:
        return _embedding_rows(model)


def check_draft_compatible(target_model: Any, target_tokenizer: Any, draft_model: Any, draft_tokenizer: Any) -> None:
    """Raise IncompatibleDraftError unless the draft can propose tokens the target verifies as the same tokens.

    The vocabularies (token -> id) must be identical. The models' embedding tables may differ in padding rows,
    but each must cover every id the tokenizer can produce, and the draft must be able to embed every id
    the target can emit (the target's output rows) that maps to a real token.
    """
    if target_tokenizer is not draft_tokenizer:
        tv, dv = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
        if tv != dv:
            only_t = sorted(set(tv.items()) - set(dv.items()), key=lambda kv: kv[1])
            only_d = sorted(set(dv.items()) - set(tv.items()), key=lambda kv: kv[1])
            raise IncompatibleDraftError(
                "the draft's tokenizer does not match the target's: "
                f"{len(tv):,} vs {len(dv):,} tokens, {len(only_t):,} (token, id) pairs only in the target "
                f"(e.g. {only_t[:3]}), {len(only_d):,} only in the draft (e.g. {only_d[:3]}). "
                "Speculative decoding needs a draft with the same tokenizer (e.g. qwen2.5-coder-0.5b for "
                "qwen2.5-coder-1.5b); use a model-free drafter or 'self:N' otherwise."
            )
        vocab = tv
    else:
        vocab = target_tokenizer.get_vocab()
    needed = max(vocab.values(), default=-1) + 1
    for role, model in (("target", target_model), ("draft", draft_model)):
        rows = _embedding_rows(model)
        if rows is not None and rows < needed:
            raise IncompatibleDraftError(
                f"the {role} model embeds {rows:,} token ids but its tokenizer uses ids up to {needed - 1:,}"
            )
    t_out, d_in = _output_rows(target_model), _embedding_rows(draft_model)
    if t_out is not None and d_in is not None and d_in < min(t_out, needed):
        raise IncompatibleDraftError(  # pragma: no cover - covered by the check above in practice
            f"the draft embeds {d_in:,} token ids but the target can emit {t_out:,}"
        )
