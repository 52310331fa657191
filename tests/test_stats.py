"""Stats arithmetic, by hand and as the engine fills it in."""

import pytest

from speculum.engine import Stats

from helpers import RandomTreeDrafter, build_drafter, generate_ids
from tiny_models import VOCAB, reference_greedy, repetitive_prompt, tiny_model


def test_derived_metrics_by_hand():
    s = Stats(
        new_tokens=10, target_forwards=4, drafted_tokens=9, accepted_tokens=6, accept_lengths=[3, 1, 4, 2],
        drafted_per_position=[3, 3, 2], accepted_per_position=[3, 2, 1], wall_time=2.0,
    )  # fmt: skip
    assert s.mean_acceptance_length == pytest.approx(2.5)
    assert s.draft_acceptance_rate == pytest.approx(6 / 9)
    assert s.acceptance_per_position == pytest.approx([1.0, 2 / 3, 0.5])
    assert s.discard_rate == pytest.approx(3 / 10)  # SpecDec++: discarded drafts per generated token
    assert s.verification_rate == pytest.approx(4 / 10)  # SpecDec++: target forwards per generated token
    assert s.tokens_per_second == pytest.approx(5.0)
    d = s.to_dict()
    assert d["mean_acceptance_length"] == pytest.approx(2.5) and d["new_tokens"] == 10


def test_empty_stats_do_not_divide_by_zero():
    s = Stats()
    assert s.mean_acceptance_length == 0 and s.draft_acceptance_rate == 0 and s.tokens_per_second == 0


def test_engine_stats_are_consistent():
    model = tiny_model("qwen2")
    prompt = repetitive_prompt(30, 7, 1)
    ref = reference_greedy(model, prompt, 30)
    for drafter in [build_drafter("prompt_lookup"), RandomTreeDrafter(ref, VOCAB, seed=2)]:
        out, s = generate_ids(model, prompt, drafter, 30)
        assert s.new_tokens == len(out) == sum(s.accept_lengths) == 30
        assert s.target_forwards == len(s.accept_lengths) == len(s.draft_sizes)
        assert s.drafted_tokens == sum(s.draft_sizes)
        assert s.accepted_tokens == sum(s.accepted_per_position)
        # every step commits its accepted drafts plus one token of the target's own (the last may be cut)
        assert s.new_tokens <= s.accepted_tokens + s.target_forwards
        assert s.prompt_tokens == len(prompt) and s.stop_reason == "length"
        assert s.wall_time >= s.time_draft + s.time_verify
        assert s.drafted_per_position[0] == sum(1 for size in s.draft_sizes if size > 0)


def test_eos_stops_generation():
    model = tiny_model("llama")
    prompt = repetitive_prompt(24, 5, 0)
    ref = reference_greedy(model, prompt, 20)
    stop = ref[7]
    out, s = generate_ids(model, prompt, build_drafter("prompt_lookup"), 20, eos=frozenset({stop}))
    assert out == ref[: ref.index(stop) + 1]
    assert s.stop_reason == "eos"
