"""Replay (acceptance without running the target at every step) gives exactly the acceptance of a real greedy run."""

import pytest

from speculum.bench.replay import ReplayRunner, replay
from speculum.errors import ReplayError

from helpers import RandomTreeDrafter, build_drafter, generate_ids
from tiny_models import VOCAB, perturbed_copy, reference_greedy, repetitive_prompt, tiny_model


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
        # given the model, a drafter that reads only the accepted path still costs no target forward
        runner = ReplayRunner(prompt, reference, model=model)
        assert runner.run(make()).accept_lengths == real.accept_lengths
        assert runner.target_forwards == 0


def pool_contents(drafter):
    """The phrase pool, keys in their eviction order."""
    return [(key, drafter.pool.get(key)) for key in drafter.pool.keys()]


# Small windows and pools, so that drafts are partly rejected and the pool turns over.
OFF_PATH_READERS = [
    (  # one pool reused across the prompts, phrases from verification, drafts lengthened by phrases
        "ouroboros",
        dict(
            num_speculative_tokens=4,
            window_size=3,
            ngram_size=4,
            guess_set_size=3,
            num_phrase_candidates=2,
            verification_phrases=True,
            reuse_history=True,
        ),
    ),
    ("lookahead", dict(window_size=3, ngram_size=3, guess_set_size=3, persist=True)),
    ("lookahead", dict(window_size=4, ngram_size=4, guess_set_size=2)),
]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("method, params", OFF_PATH_READERS)
def test_replay_with_the_model_matches_drafters_that_read_off_the_path(arch, method, params):
    """Lookahead's window and Ouroboros' verification phrases learn from the target's predictions at
    rejected nodes: given the model, the replay computes those and stays exact step by step, pool
    included, over several requests (sharing one pool where the drafter keeps it)."""
    model = tiny_model(arch)
    draft = perturbed_copy(model, scale=0.4) if method == "ouroboros" else None
    real_drafter = build_drafter(method, draft, VOCAB, **params)
    replayed_drafter = build_drafter(method, draft, VOCAB, **params)
    prompts = [repetitive_prompt(24, 5, 0), repetitive_prompt(20, 7, 3), repetitive_prompt(26, 6, 5)]
    for prompt in prompts:
        reference = reference_greedy(model, prompt, 40)
        out, real = generate_ids(model, prompt, real_drafter, 40)
        assert out == reference
        simulated = replay(prompt, reference, replayed_drafter, model=model)
        assert simulated.accept_lengths == real.accept_lengths
        assert simulated.drafted_tokens == real.drafted_tokens
        assert simulated.accepted_per_position == real.accepted_per_position
        assert pool_contents(replayed_drafter) == pool_contents(real_drafter)


@pytest.mark.parametrize("method, params", OFF_PATH_READERS)
def test_replay_without_the_model_refuses_drafters_that_read_off_the_path(method, params):
    model = tiny_model("llama")
    draft = perturbed_copy(model, scale=0.4) if method == "ouroboros" else None
    prompt = repetitive_prompt(24, 5, 0)
    reference = reference_greedy(model, prompt, 40)
    with pytest.raises(ReplayError, match="off the accepted path.*model="):
        replay(prompt, reference, build_drafter(method, draft, VOCAB, **params))


SAMPLED_DRAFTERS = [
    ("draft_model", dict(num_speculative_tokens=4)),  # a chain sampled by the request's noise
    ("ouroboros", dict(num_speculative_tokens=3, window_size=3, ngram_size=3, num_phrase_candidates=2)),
    ("prompt_lookup", {}),
    ("lookahead", dict(window_size=3, ngram_size=3, guess_set_size=3)),
]


@pytest.mark.parametrize("method, params", SAMPLED_DRAFTERS)
def test_a_seeded_sampled_run_replays_exactly(method, params):
    """A seeded request at T > 0: with the seed's plain-sampling text as the reference, the replay
    gives the real run's acceptance step by step (the draft model sampling its chain by the same
    noise); a sampled replay without its seed is refused."""
    import torch

    from speculum.sampling import PositionNoise, SamplingParams

    model = tiny_model("llama")
    draft = perturbed_copy(model, scale=0.2) if method in ("draft_model", "ouroboros") else None
    sampling = SamplingParams(temperature=0.7, top_p=0.95)
    accepted = 0
    for seed, prompt in enumerate([repetitive_prompt(24, 5, 0), repetitive_prompt(20, 7, 3)]):

        def noise(seed=seed):
            return PositionNoise(torch.Generator().manual_seed(seed))

        plain_noise = noise()
        reference, _ = generate_ids(model, prompt, build_drafter("autoregressive"), 32, sampling,
                                    plain_noise.generator, noise=plain_noise)  # fmt: skip
        real_noise = noise()
        out, real = generate_ids(model, prompt, build_drafter(method, draft, VOCAB, **params), 32, sampling,
                                 real_noise.generator, noise=real_noise)  # fmt: skip
        assert out == reference
        simulated = replay(prompt, reference, build_drafter(method, draft, VOCAB, **params), model=model,
                           sampling=sampling, seed=seed)  # fmt: skip
        assert simulated.accept_lengths == real.accept_lengths
        assert simulated.drafted_tokens == real.drafted_tokens
        assert simulated.accepted_per_position == real.accepted_per_position
        accepted += real.accepted_tokens
    assert accepted > 0
    with pytest.raises(ReplayError, match="seed"):
        replay(prompt, reference, build_drafter("prompt_lookup"), sampling=sampling, vocab_size=VOCAB)
