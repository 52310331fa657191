"""Drafters a Speculum keeps between requests hold no request's draft cache, and the next request
still runs exactly."""

import pytest

import speculum
from speculum import cache as cache_ops
from speculum.costs import CostModel
from speculum.drafters.draft_model import DraftModelState

from tiny_models import perturbed_copy, repetitive_prompt, tiny_model, word_tokenizer

PROMPTS = [repetitive_prompt(40, 5, seed) for seed in range(4)]
METHODS = [
    ("draft_model", {}),
    ("ouroboros", {}),
    ("auto", {}),
    ("auto", {"drafters": "anpd,draft_model"}),
]


def draft_states(drafters) -> list[DraftModelState]:
    """The draft-model states of ``drafters`` and of their parts (``auto``)."""
    found = []
    for drafter in drafters:
        inner = [part.drafter for part in getattr(drafter, "parts", [])] or [drafter]
        found += [d.state for d in inner if isinstance(getattr(d, "state", None), DraftModelState)]
    return found


@pytest.fixture(scope="module")
def spec():
    target = tiny_model("llama")
    spec = speculum.Speculum(target, word_tokenizer(), perturbed_copy(target, scale=0.3))
    spec.cost_model = CostModel([(1, 0.010), (64, 0.011)])  # (not measured: a fixed, cheap verification)
    return spec


@pytest.mark.parametrize("method,params", METHODS, ids=[f"{m}-{'-'.join(p.values())}" for m, p in METHODS])
def test_kept_drafters_drop_the_last_requests_draft_cache(spec, method, params):
    config = speculum.SpeculativeConfig(method, **params)
    plain = [spec.generate(p, "autoregressive", max_new_tokens=40).token_ids for p in PROMPTS]
    for _ in range(2):  # the next request starts from the idle drafter and stays exact
        assert spec.generate(PROMPTS[0], config, max_new_tokens=40).token_ids == plain[0]
        states = draft_states(spec.drafters_for(config, 1))
        assert states and all(cache_ops.cache_length(s.cache) == 0 and not s.seen for s in states)
    for _ in range(2):  # a batch of four rows, each with a drafter of its own
        assert [r.token_ids for r in spec.generate(PROMPTS, config, max_new_tokens=40)] == plain
        states = draft_states(spec.drafters_for(config, len(PROMPTS)))
        assert len(states) == len(PROMPTS)
        assert all(cache_ops.cache_length(s.cache) == 0 and not s.seen for s in states)
