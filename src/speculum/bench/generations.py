"""One timed generation of one bench row: speculum's ``generate`` or transformers' own, as a record."""

from __future__ import annotations

import time
from typing import Any

import torch

from speculum.accel import unpacked
from speculum.bench.method_specs import MethodSpec
from speculum.sampling import SamplingParams

RECORD_KEYS = (
    "dataset",
    "question_id",
    "category",
    "method",
    "prompt_tokens",
    "new_tokens",
    "wall_time",
    "accept_lengths",
    "tokens_per_second",
    "mean_acceptance_length",
    "draft_acceptance_rate",
    "target_forwards",
    "draft_forwards",
    "drafted_tokens",
    "accepted_tokens",
    "time_prefill",
    "time_draft",
    "time_draft_catch_up",
    "time_verify",
    "time_other",
    "draft_sizes",
    "rounds_drafted",
    "rounds_plain",
    "nodes_pruned",
    "rounds_explored",
    "chains_stopped",
    "time_control",
    "accepted_by",
    "equal_to_baseline",
    "first_mismatch",
    "token_ids",
)


def hf_generate_kwargs(method: MethodSpec, spec, draft: str | None) -> dict | None:
    """transformers' ``generate`` kwargs for a transformers row; None when the row does not apply."""
    kw: dict[str, Any] = {}
    if method.name == "hf_assisted":
        if draft and str(draft).startswith("self:"):
            try:
                kw["assistant_early_exit"] = int(str(draft).split(":", 1)[1])
            except ValueError:
                return None
        elif getattr(spec, "draft_model", None) is not None and spec.draft_model is not spec.model:
            kw["assistant_model"] = spec.draft_model
        else:
            return None
    elif method.name == "hf_prompt_lookup":
        kw["prompt_lookup_num_tokens"] = 10
    kw.update(method.params)
    return kw


def run_transformers(
    spec, ids: list[int], extra: dict, *, max_new_tokens: int, temperature: float, top_p: float, top_k: int, seed
) -> dict:
    """One ``spec.model.generate`` call, timed; transformers' own defaults for everything not set here."""
    model = spec.model
    device = getattr(model, "device", None) or "cpu"
    input_ids = torch.tensor([ids], dtype=torch.long, device=device)
    gc = getattr(model, "generation_config", None)
    eos_set = spec.eos_token_ids  # the engine's own stopping rule, so both sides stop at the same token
    eos = sorted(eos_set) or None
    pad = getattr(gc, "pad_token_id", None) if gc is not None else None
    if pad is None:
        pad = eos[0] if eos else None
    kw: dict[str, Any] = dict(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_new_tokens,
        pad_token_id=pad,
        eos_token_id=eos,
    )
    if temperature and temperature > 0:
        kw.update(do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k or 0)
        if seed is not None:
            torch.manual_seed(seed)
    else:
        kw.update(do_sample=False, temperature=None, top_p=None, top_k=None)
    kw.update(extra)
    # transformers' rows run on the stock model: undo speculum's weight prepacking (not timed).
    with unpacked(model, getattr(spec, "draft_model", None)), torch.inference_mode():
        t0 = time.perf_counter()
        out = model.generate(**kw)
        wall = time.perf_counter() - t0
    new = out[0, input_ids.shape[1] :].tolist()
    for i, t in enumerate(new):
        if t in eos_set:
            new = new[: i + 1]
            break
    rec: dict[str, Any] = {
        "new_tokens": len(new),
        "wall_time": wall,
        "token_ids": new,
        "tokens_per_second": len(new) / wall if wall > 0 else None,
    }
    if not extra:  # plain decoding: one target forward per token
        rec["target_forwards"] = len(new)
        rec["mean_acceptance_length"] = 1.0 if new else None
    return rec


def run_speculum(
    spec, ids: list[int], config, *, max_new_tokens: int, temperature: float, top_p: float, top_k: int, seed
) -> dict:
    t0 = time.perf_counter()
    result = spec.generate(
        ids,
        method=config,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
    )
    outer = time.perf_counter() - t0
    stats = result.stats.to_dict() if hasattr(result.stats, "to_dict") else dict(result.stats)
    rec = {k: stats.get(k) for k in RECORD_KEYS if k in stats}
    token_ids = list(result.token_ids)
    rec["token_ids"] = token_ids
    rec["new_tokens"] = stats.get("new_tokens", len(token_ids))
    # the same clock as the transformers rows: perf_counter around the whole call (prefill included)
    rec["engine_wall_time"] = stats.get("wall_time")
    rec["wall_time"] = outer
    rec["tokens_per_second"] = rec["new_tokens"] / outer if outer > 0 else None
    for k in ("discard_rate", "verification_rate", "stop_reason"):
        if k in stats:
            rec[k] = stats[k]
    drafter = spec.drafter_for(config, not SamplingParams(temperature).greedy) if hasattr(spec, "drafter_for") else None
    drafter_stats = drafter.request_stats() if drafter is not None else {}
    if drafter_stats:
        rec["drafter"] = drafter_stats
    return rec
