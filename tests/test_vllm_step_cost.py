"""What ``Auto`` learns of vLLM's step, on a fake clock: a step that prefilled a prompt is no
decoding step's, for the step cost's fit and for the draft gate alike; and the options key is checked.

vLLM prefills a new prompt in a step and samples its first token there, so the ``propose`` call
that ends that step is the first to see the request. The simulation below is vLLM's side: each
step costs A + B a verified token, plus PREFILL in a step that prefills a prompt; a request joins
every JOIN_EVERY steps. ``propose`` itself takes no time on the fake clock.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from speculum.errors import InvalidInputError
from speculum.integrations.vllm import Anpd, Auto, PromptLookup
from speculum.integrations.vllm import proposers as proposers_module
from test_vllm_proposers import vllm_config as proposers_vllm_config

K = 4
A, B = 0.010, 0.0002  # a step: 10 ms + 0.2 ms a verified token
PREFILL = 0.030  # what a one-step prefill adds to its step
JOIN_EVERY = 15
STEPS = 120  # 8 requests join
NEW = 150  # tokens a request generates
PHRASE = list(range(5, 17))


def vllm_config(options=None):
    """vLLM's config as the proposers read it, room for every request's tokens."""
    return proposers_vllm_config(options=options, max_model_len=512)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def perf_counter(self) -> float:
        return self.t


def request(seed):
    """A prompt of a repeated phrase, continued by that phrase with a few tokens changed (so drafts
    are mostly right, sometimes cut short, and steps verify varying numbers of tokens)."""
    rng = np.random.default_rng(seed)
    phrase = [t + 100 * seed for t in PHRASE]
    prompt = [1, 2] + phrase * 2
    reference = (phrase * (NEW // len(phrase) + 2))[: NEW + K]
    for i in np.flatnonzero(rng.random(len(reference)) < 0.08):
        reference[i] = int(rng.integers(3000, 4000))
    return prompt, reference


def simulate(proposer, clock, chunks=1):
    """Run vLLM's side for STEPS steps; each propose call's (whether the step it ended prefilled a
    prompt, cost.steps after the call). A prompt takes ``chunks`` steps to prefill; its row holds no
    sampled token until the last one."""
    token_ids = np.zeros((16, 512), dtype=np.int32)
    rows = []  # [prompt length, reference, tokens generated, chunks left, draft]
    calls = []
    joined = 0
    for step in range(STEPS):
        # vLLM's step: the rows' drafts verified, and a prompt prefilled beside them
        verified = sum(1 + len(row[4]) for row in rows if row[3] == 0)
        prefilled = any(row[3] > 0 for row in rows)
        if step % JOIN_EVERY == 0:
            prompt, reference = request(joined)
            joined += 1
            rows.append([len(prompt), reference, 0, chunks, []])
            token_ids[len(rows) - 1, : len(prompt)] = prompt
            prefilled = True
        clock.t += A + B * verified + (PREFILL / chunks if prefilled else 0.0)
        sampled = []
        for r, row in enumerate(rows):
            n_prompt, reference, generated, chunks_left, draft = row
            if chunks_left > 1:
                row[3] -= 1
                sampled.append([])
                continue
            if chunks_left == 1:  # the prompt's last chunk: its first token sampled
                row[3] = 0
                new = reference[:1]
            else:
                accepted = 0
                while accepted < len(draft) and draft[accepted] == reference[generated + accepted]:
                    accepted += 1
                new = reference[generated : generated + accepted + 1]
            token_ids[r, n_prompt + generated : n_prompt + generated + len(new)] = new
            row[2] += len(new)
            sampled.append(list(new))
        # finished requests leave (the proposer is not asked for them again); the batch is condensed
        keep = [r for r, row in enumerate(rows) if row[2] < NEW]
        rows, sampled = [rows[r] for r in keep], [sampled[r] for r in keep]
        token_ids = np.concatenate([token_ids[keep], np.zeros((16 - len(keep), 512), dtype=np.int32)])
        num_tokens = np.array([row[0] + row[2] for row in rows] + [0] * (16 - len(rows)))
        drafts = proposer.propose(sampled, num_tokens, token_ids)
        calls.append((prefilled, proposer.cost.steps))
        for row, draft in zip(rows, drafts, strict=True):
            row[4] = draft
    return calls


@pytest.fixture
def clock(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(proposers_module, "time", SimpleNamespace(perf_counter=clock.perf_counter))
    return clock


def _recorded(calls):
    """Per call: whether it ended a prefill step, and whether that step was recorded."""
    out, before = [], 0
    for prefilled, steps in calls:
        out.append((prefilled, steps > before))
        before = steps
    return out


@pytest.mark.parametrize("chunks", [1, 3])
def test_step_cost_leaves_out_the_steps_that_prefilled_a_prompt(clock, chunks):
    auto = Auto(vllm_config())
    recorded = _recorded(simulate(auto, clock, chunks=chunks))
    a, b = auto.cost.fit()
    assert b == pytest.approx(B, rel=0.1)
    assert a == pytest.approx(A, rel=0.1)
    prefill_steps = [r for p, r in recorded if p]
    assert len(prefill_steps) == (STEPS // JOIN_EVERY) * chunks
    assert not any(prefill_steps)
    # every decoding step alone is recorded, the one after a prompt's last chunk included
    assert all(r for p, r in recorded[1:] if not p)


class _FakeDraftDrafter:
    """A draft model's drafter that never drafts and holds no cache."""

    def __init__(self):
        self.state = SimpleNamespace(seen=[], reset=lambda: None)

    def start(self, ctx):
        pass

    def observe(self, ctx, outcome):
        pass


def test_draft_gate_takes_no_evidence_from_steps_that_prefilled_a_prompt(clock, monkeypatch):
    auto = Auto(vllm_config(options={"draft": "a-draft-never-loaded"}))
    monkeypatch.setattr(auto.draft, "new_drafter", _FakeDraftDrafter)
    monkeypatch.setattr(auto.draft, "propose_rows", lambda drafters, ctxs: [None] * len(ctxs))
    evidence = []  # per call: the plain steps each record took
    record = auto.gate.record

    def spy(drafted, tokens_per_row, plain_steps):
        evidence[-1].append(plain_steps)
        record(drafted, tokens_per_row, plain_steps)

    monkeypatch.setattr(auto.gate, "record", spy)
    propose = auto.propose

    def propose_logged(*args, **kwargs):
        evidence.append([])
        return propose(*args, **kwargs)

    monkeypatch.setattr(auto, "propose", propose_logged)
    calls = simulate(auto, clock)
    assert len(evidence) == len(calls) == STEPS
    assert not any(ev for (prefilled, _), ev in zip(calls, evidence, strict=True) if prefilled)
    ordinary = [ev for (prefilled, _), ev in zip(calls[1:], evidence[1:], strict=True) if not prefilled]
    assert all(len(ev) == 1 for ev in ordinary)
    # a decoding step's time over a plain step's predicted time: 1 to 1.4 (drafts verified), a prefill step's ~4
    assert max(ev[0] for ev in ordinary) < 2.0


@pytest.mark.parametrize("cls", [PromptLookup, Anpd, Auto])
@pytest.mark.parametrize("given", ["max_requests=8", [["max_requests", 8]], 8, True])
def test_speculum_options_must_be_a_json_object(cls, given):
    with pytest.raises(InvalidInputError, match=r"additional_config\[.speculum.\] must be a JSON object") as info:
        cls(vllm_config(options=given))
    assert repr(given) in str(info.value)


def test_speculum_options_may_be_absent_or_empty():
    assert Anpd(vllm_config()).options.max_ngram_size == Anpd(vllm_config(options={})).options.max_ngram_size
    Anpd(SimpleNamespace(**{**vars(vllm_config()), "additional_config": None}))
