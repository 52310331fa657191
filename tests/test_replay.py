"""Replay (acceptance without the model) gives exactly the acceptance of a real greedy run."""

import pytest

from speculum.bench.replay import replay

from helpers import RandomTreeDrafter, build_drafter, generate_ids
from tiny_models import VOCAB, reference_greedy, repetitive_prompt, tiny_model


@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_replay_matches_engine(arch):
    model = tiny_model(arch)
    prompt = repetitive_prompt(30, 7, 1)
    reference = reference_greedy(model, prompt, 40)
    makers = [
        lambda: build_drafter("prompt_lookup"),
        lambda: build_drafter("anpd"),
        lambda: build_drafter("anpd", tree=True),
        lambda: RandomTreeDrafter(reference, VOCAB, seed=4),
    ]
    for make in makers:
        out, real = generate_ids(model, prompt, make(), 40)
        assert out == reference
        simulated = replay(prompt, reference, make())
        assert simulated.accept_lengths == real.accept_lengths
        assert simulated.drafted_tokens == real.drafted_tokens
        assert simulated.accepted_per_position == real.accepted_per_position
