"""What a vLLM proposer keeps between steps: request states and the draft model's caches.

vLLM never tells a proposer that a request ended, so what it holds is bounded by what the rows of
each step claim: states claimed in a step are never evicted in it, the draft caches of states no row
claimed are released, and the draft caches held are capped in positions.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from speculum.cache import cache_length
from speculum.errors import InvalidInputError
from speculum.integrations.vllm import Anpd, Auto
from speculum.integrations.vllm.requests import RequestStates
from test_vllm_proposers import Harness, random_text, repetitive, vllm_config


def _count_starts(proposer, monkeypatch) -> list:
    """The states the proposer starts (one per request it sees as new), in order."""
    started = []
    start = proposer._start

    def counted(state, ctx):
        started.append(state)
        start(state, ctx)

    monkeypatch.setattr(proposer, "_start", counted)
    return started


def test_states_claimed_in_a_step_are_not_evicted_by_more_rows_than_max_requests(monkeypatch):
    """8 rows in flight with max_requests=6: each request's state is started once, not again and
    again as rows of the same step evict each other's."""
    proposer = Anpd(vllm_config(options={"max_requests": 6}))
    started = _count_starts(proposer, monkeypatch)
    requests = [repetitive(offset=o) for o in range(0, 1200, 100)]
    h = Harness(proposer, requests, slots=8).run(max_new=24, condense=True)
    assert len(h.outputs) == 12
    assert len(started) == 12
    assert len(proposer.requests) == 6  # once fewer rows are in flight, the capacity holds again


def test_request_states_evict_only_states_no_row_claimed_this_step():
    states = RequestStates(capacity=2)
    prompts = [np.array([i, i + 1, i + 2]) for i in range(0, 40, 10)]
    taken: set[int] = set()
    claimed = [states.claim(p, taken)[0] for p in prompts]
    for state, p in zip(claimed, prompts, strict=True):
        state.moved_to(p)
    assert len(states) == 4  # more rows than the capacity in one step: all of them kept
    states.end_step(taken)
    assert len(states) == 4
    taken = set()
    for p in prompts[2:]:
        again, new = states.claim(np.append(p, 99), taken)
        assert not new
    states.end_step(taken)
    assert len(states) == 2
    # the two states left are the ones claimed in the last step
    assert {id(s) for s in states} == {id(s) for s in claimed[2:]}


def _config_with_max_num_seqs(max_num_seqs, options=None):
    config = vllm_config(options=options)
    config.scheduler_config = SimpleNamespace(max_num_seqs=max_num_seqs)
    return config


def test_max_requests_defaults_to_vllms_max_num_seqs():
    assert Anpd(_config_with_max_num_seqs(5)).requests.capacity == 5
    assert Anpd(vllm_config()).requests.capacity == 256  # no scheduler config: vLLM's usual default
    assert Anpd(_config_with_max_num_seqs(5, {"max_requests": 9})).requests.capacity == 9
    proposer = Anpd(_config_with_max_num_seqs(3))
    Harness(proposer, [repetitive(offset=o) for o in range(0, 1000, 100)], slots=2).run(max_new=8)
    assert len(proposer.requests) == 3


# ---------------------------------------------------------------------------------- draft caches


def _draft_positions(state) -> int:
    """Positions of the draft model's KV cache a request state holds."""
    drafter = state.data["drafters"]["draft_model"]
    return cache_length(drafter.state.cache)


def _auto_with_draft(model_dir, monkeypatch, **options):
    auto = Auto(vllm_config(options={"draft": model_dir, "draft_confidence": 0.0, **options}, vocab_size=64))
    auto.load_model()
    # the gate's and the step cost's timing are not what is tested here: the draft runs in every
    # step and its tokens are proposed whatever the (real, noisy) clock says a token costs
    monkeypatch.setattr(auto.gate, "wants", lambda: True)
    monkeypatch.setattr(auto.cost, "token_share", lambda verified: 0.0)
    return auto


def _requests(n, seed=0):
    return [random_text(seed + i, new=12, vocab=(3, 64)) for i in range(n)]


def test_ended_requests_hold_no_draft_cache(model_dir, monkeypatch):
    auto = _auto_with_draft(model_dir, monkeypatch)
    started = _count_starts(auto, monkeypatch)
    h = Harness(auto, _requests(12), slots=4, step_seconds=None).run(max_new=12, condense=True)
    assert len(h.outputs) == 12 and len(started) == 12
    assert auto.by_drafter["draft_model"][0] > 0  # the draft ran
    # the last step's rows may still hold theirs; the requests that ended before it hold none
    assert sum(_draft_positions(s) > 0 for s in started) <= 4
    # the next step (a new request, one still prefilling) claims none of them: none holds a cache
    prompt, _ = random_text(99, vocab=(3, 64))
    token_ids = np.zeros((2, 256), dtype=np.int32)
    token_ids[0, : len(prompt)] = prompt
    auto.propose([[prompt[-1]], []], np.array([len(prompt), 0]), token_ids)
    assert [_draft_positions(s) for s in started[:12]] == [0] * 12
    assert len(started) == 13 and _draft_positions(started[12]) > 0


def test_ended_requests_hold_no_draft_cache_in_steps_without_the_draft(model_dir, monkeypatch):
    auto = _auto_with_draft(model_dir, monkeypatch)
    started = _count_starts(auto, monkeypatch)
    Harness(auto, _requests(2), slots=2, step_seconds=None).run(max_new=12)
    assert sum(_draft_positions(s) for s in started) > 0
    monkeypatch.setattr(auto.gate, "wants", lambda: False)
    prompt, _ = random_text(99, vocab=(3, 64))
    token_ids = np.zeros((1, 256), dtype=np.int32)
    token_ids[0, : len(prompt)] = prompt
    auto.propose([[prompt[-1]]], np.array([len(prompt)]), token_ids)
    assert [_draft_positions(s) for s in started] == [0, 0, 0]


def test_draft_cache_positions_are_capped(model_dir, monkeypatch):
    """With room for about one request's draft cache, the rows share it: what is held never passes
    the cap, the draft still drafts, and the output is vLLM's."""
    cap = 60  # a prompt of 30, 12 new tokens and a draft of K: one row's cache fits, not two
    auto = _auto_with_draft(model_dir, monkeypatch, max_draft_positions=cap)
    started = _count_starts(auto, monkeypatch)
    held = []
    propose = auto.propose

    def propose_and_measure(*args, **kwargs):
        drafts = propose(*args, **kwargs)
        held.append(sum(_draft_positions(s) for s in started))
        return drafts

    monkeypatch.setattr(auto, "propose", propose_and_measure)
    requests = _requests(6)
    h = Harness(auto, requests, slots=3, step_seconds=None).run(max_new=12, condense=True)
    assert h.outputs == Harness(Auto(vllm_config()), requests, slots=3, step_seconds=None).run(max_new=12).outputs
    assert max(held) <= cap
    assert max(held) > 0 and auto.by_drafter["draft_model"][0] > 0


def test_draft_cache_cap_is_an_option():
    config = vllm_config(options={"draft": "x"}, vocab_size=64)
    assert Auto(config).draft.options.max_draft_positions == 32768
    with pytest.raises(InvalidInputError, match="max_draft_positions"):
        Auto(vllm_config(options={"draft": "x", "max_draft_positions": 0}))
    with pytest.raises(InvalidInputError, match="without a draft"):
        Auto(vllm_config(options={"max_draft_positions": 100}))
