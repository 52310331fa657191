"""A draft model's batched forward that raises once (a transient fault): with isolation (the server's
batch), its rows draft alone for that round and every one of them still gives exactly its
single-request text; no row fails for a fault that its own drafting alone does not raise."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest

from speculum.engine import Batch, Request
from speculum.runner import ModelRunner
from speculum.sampling import SamplingParams

from helpers import build_drafter
from tiny_models import VOCAB, perturbed_copy, reference_greedy, repetitive_prompt, tiny_model

PROMPTS = [repetitive_prompt(20, 5, 10), repetitive_prompt(9, 4, 11), repetitive_prompt(30, 7, 12)]
LENGTHS = [24, 16, 20]
OUROBOROS_SMALL = {"num_speculative_tokens": 4, "window_size": 3, "ngram_size": 3, "guess_set_size": 3}
PARAMS = {"draft_model": {"num_speculative_tokens": 4}, "ouroboros": OUROBOROS_SMALL, "auto": {}}


@contextmanager
def transient_fault(draft, nth: int):
    """The draft model's ``nth`` forward over several rows raises, once, in its last layer: the
    layers before it have already appended their keys to the joined cache. Yields the count of
    batched forwards so far."""
    batched = [0]

    def hook(module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        if hidden.shape[0] > 1:
            batched[0] += 1
            if batched[0] == nth:
                raise RuntimeError("a transient fault in the draft's forward")

    handle = draft.model.layers[-1].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield batched
    finally:
        handle.remove()


def run_isolated(model, drafters):
    """The rows decoded together in an isolating batch (as the server runs them): each row's tokens,
    the rows that failed, and each request's stats."""
    requests = [Request(p, d, SamplingParams(), n) for p, d, n in zip(PROMPTS, drafters, LENGTHS, strict=True)]
    batch = Batch(ModelRunner(model), isolate=True)
    rows = [batch.join(request) for request in requests]
    outputs, failed = {id(row): [] for row in rows}, []
    while batch.rows:
        for row, new in batch.step():
            outputs[id(row)].extend(new)
        failed += batch.failed
    return [outputs[id(row)] for row in rows], failed, [r.stats for r in requests]


@pytest.fixture(scope="module")
def models():
    model = tiny_model("llama")
    refs = [reference_greedy(model, p, n) for p, n in zip(PROMPTS, LENGTHS, strict=True)]
    return model, perturbed_copy(model, scale=0.4), refs


@pytest.mark.parametrize("nth", [1, 4])
@pytest.mark.parametrize("method", ["draft_model", "ouroboros", "auto"])
def test_a_transient_fault_in_a_batched_draft_forward_fails_no_row(models, method, nth):
    """The draft's first batched forward (the rows' first catch-up) or its 4th (mid-round) raises
    once: no row fails, each finishes with its single-request text, and the rows go on drafting
    together afterwards."""
    model, draft, refs = models

    def drafters():
        return [build_drafter(method, draft, VOCAB, target=model, **PARAMS[method]) for _ in PROMPTS]

    _, _, clean = run_isolated(model, drafters())
    with transient_fault(draft, nth) as batched:
        outputs, failed, stats = run_isolated(model, drafters())
    assert [repr(error) for _, error in failed] == []
    assert batched[0] > nth  # the fault happened, and batched drafting went on after it
    assert outputs == refs
    assert all(s.stop_reason == "length" for s in stats)
    if method == "draft_model":  # the round drafted alone drafts the chains the batch would have
        assert [(s.drafted_tokens, s.accepted_tokens) for s in stats] == [
            (s.drafted_tokens, s.accepted_tokens) for s in clean
        ]


def test_a_transient_draft_fault_in_the_server_fails_no_request():
    """Three requests drafting with the server's draft model, side by side: its first forward over
    several of them raises once, and each still gets 200 with exactly its single-request text."""
    pytest.importorskip("fastapi", reason="the server tests need the server extra: pip install -e '.[server,test]'")
    from fastapi.testclient import TestClient

    from server_launcher import build_spec
    from speculum.server import ServerSettings, create_app

    prompts = [" ".join(f"w{t}" for t in p) for p in PROMPTS]
    expected = [build_spec().generate(p, "autoregressive", max_new_tokens=24).text for p in prompts]
    served = build_spec(step_delay=0.02)  # every target forward slowed down: the requests overlap
    config = {"method": "draft_model", "controller": False, "num_speculative_tokens": 4}
    bodies = [{"prompt": p, "max_tokens": 24, "speculative_config": config} for p in prompts]
    with (
        transient_fault(served.draft_model, 1) as batched,
        TestClient(create_app(served, ServerSettings(max_batch=4)), raise_server_exceptions=False) as client,
        ThreadPoolExecutor(len(bodies)) as pool,
    ):
        responses = list(pool.map(lambda body: client.post("/v1/completions", json=body), bodies))
    got = [(r.status_code, r.json()["choices"][0]["text"] if r.status_code == 200 else r.json()) for r in responses]
    assert got == [(200, text) for text in expected]
    assert batched[0] > 1  # the fault happened, and batched drafting went on after it
