"""speculum's vLLM proposers called as vLLM's V1 model runner calls them, without vLLM installed.

A small harness stands in for vLLM's step: rows are batch slots holding a request's tokens in a
``token_ids_cpu`` array; each step a row's draft is verified against the request's reference
continuation (what the target would generate), the accepted tokens and one of the target's own are
appended, finished requests free their slot and waiting ones take it (slots are reused, and the
batch is condensed as vLLM does, so requests move between slots).
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest

from speculum.errors import InvalidInputError
from speculum.integrations.vllm import Anpd, Auto, PromptLookup
from speculum.integrations.vllm.requests import RequestStates
from speculum.integrations.vllm.step_cost import StepCost

K = 4


def vllm_config(k=K, max_model_len=256, options=None, eos=None, vocab_size=None, dtype=None):
    return SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=k),
        model_config=SimpleNamespace(
            max_model_len=max_model_len, dtype=dtype, hf_config=SimpleNamespace(eos_token_id=eos, vocab_size=vocab_size)
        ),
        additional_config={"speculum": options} if options is not None else {},
    )


class Harness:
    """vLLM's side of the protocol: slots, verification against each request's reference, reuse."""

    def __init__(self, proposer, requests, slots=2, max_model_len=256, step_seconds=(0.002, 0.0001)):
        self.proposer = proposer
        self.step_seconds = step_seconds  # (a, b): each step takes a + b * tokens verified, as vLLM's would
        self.waiting = list(requests)  # (prompt, reference continuation)
        self.token_ids = np.zeros((slots, max_model_len), dtype=np.int32)
        self.slots = [None] * slots  # slot -> [request index, prompt length, tokens generated]
        self.sampled = [[] for _ in range(slots)]
        self.num_tokens = np.zeros(slots, dtype=np.int64)
        self.outputs = {}
        self.proposed = self.accepted = 0
        self.max_model_len = max_model_len
        self.next_request = 0

    def _admit(self):
        for s in range(len(self.slots)):
            if self.slots[s] is None and self.waiting:
                prompt, reference = self.waiting.pop(0)
                self.token_ids[s, : len(prompt)] = prompt
                # the prefill step samples the first token
                self.token_ids[s, len(prompt)] = reference[0]
                self.num_tokens[s] = len(prompt) + 1
                self.slots[s] = [self.next_request, reference, 1]
                self.sampled[s] = [reference[0]]
                self.next_request += 1

    def run(self, max_new=40, condense=False):
        self._admit()
        drafts = None
        while any(slot is not None for slot in self.slots):
            # a condensed batch is the requests in flight, as vLLM's is (the slots after them are not rows)
            rows = sum(slot is not None for slot in self.slots) if condense else len(self.slots)
            drafts = self.proposer.propose(
                [list(x) for x in self.sampled[:rows]], self.num_tokens.copy(), self.token_ids, slot_mappings=None
            )
            assert len(drafts) == rows
            drafts += [[] for _ in range(len(self.slots) - rows)]
            if self.step_seconds is not None:
                a, b = self.step_seconds
                verified = sum(1 + len(d) for d, slot in zip(drafts, self.slots, strict=True) if slot is not None)
                time.sleep(a + b * verified)
            for s, draft in enumerate(drafts):
                assert all(isinstance(t, int) for t in draft) and len(draft) <= self.proposer.k
                if self.slots[s] is None or not self.sampled[s]:
                    assert draft == []
                    continue
                assert self.num_tokens[s] + len(draft) + 1 <= self.max_model_len
                request, reference, generated = self.slots[s]
                accepted = 0
                for t in draft:
                    if generated + accepted < len(reference) and t == reference[generated + accepted]:
                        accepted += 1
                    else:
                        break
                self.proposed += len(draft)
                self.accepted += accepted
                new = reference[generated : generated + accepted + 1]
                n = int(self.num_tokens[s])
                self.token_ids[s, n : n + len(new)] = new
                self.num_tokens[s] = n + len(new)
                self.slots[s][2] = generated + len(new)
                self.sampled[s] = list(new)
                if self.slots[s][2] >= min(max_new, len(reference)) or self.num_tokens[s] >= self.max_model_len:
                    self.outputs[request] = self.token_ids[s, : self.num_tokens[s]].tolist()
                    self.slots[s] = None
                    self.sampled[s] = []
            if condense:  # vLLM moves the last requests into freed slots
                order = sorted(range(len(self.slots)), key=lambda s: self.slots[s] is None)
                self.slots = [self.slots[s] for s in order]
                self.sampled = [self.sampled[s] for s in order]
                self.token_ids = self.token_ids[order].copy()
                self.num_tokens = self.num_tokens[order].copy()
            self._admit()
        return self


REPEAT = [5, 6, 7, 8, 9, 10, 11, 12]


def repetitive(prompt_repeats=2, new=40, offset=0):
    """A prompt of a repeated phrase whose continuation repeats it again (n-gram drafters copy it)."""
    phrase = [t + offset for t in REPEAT]
    prompt = [1, 2] + phrase * prompt_repeats + phrase[:3]  # ends mid-phrase
    return prompt, (phrase[3:] + phrase * 8)[:new]


def random_text(seed, new=40, vocab=(20, 200)):
    rng = np.random.default_rng(seed)
    return rng.integers(*vocab, 30).tolist(), rng.integers(*vocab, new).tolist()


@pytest.mark.parametrize("cls", [PromptLookup, Anpd, Auto])
def test_drafts_copy_repeated_text_and_respect_vllm_limits(cls):
    h = Harness(cls(vllm_config()), [repetitive(offset=o) for o in (0, 100, 200)]).run()
    assert len(h.outputs) == 3
    assert h.accepted >= 20  # most of the 3 x 40 tokens come from accepted drafts
    assert h.accepted / h.proposed > 0.8


@pytest.mark.parametrize("cls", [Anpd, Auto])
def test_summary_counts_what_was_proposed_and_accepted(cls):
    proposer = cls(vllm_config())
    h = Harness(proposer, [repetitive(offset=o) for o in (0, 100)]).run()
    assert proposer.proposed_tokens == h.proposed
    # the last step of each request is never seen again: its acceptance is not counted
    assert h.accepted - 2 * K <= proposer.accepted_tokens <= h.accepted
    assert f"{h.proposed} draft tokens proposed" in proposer.summary()


@pytest.mark.parametrize("cls", [PromptLookup, Anpd, Auto])
def test_rows_at_max_model_len_get_no_draft(cls):
    prompt, reference = repetitive(new=60)
    h = Harness(
        cls(vllm_config(max_model_len=len(prompt) + 12)), [(prompt, reference)], slots=1, max_model_len=len(prompt) + 12
    )
    h.run(max_new=60)
    assert len(h.outputs[0]) == len(prompt) + 12


def test_empty_rows_and_prefilling_rows_get_empty_lists():
    proposer = Anpd(vllm_config())
    prompt, _ = repetitive()
    token_ids = np.zeros((3, 256), dtype=np.int32)
    token_ids[1, : len(prompt)] = prompt
    drafts = proposer.propose([[], [prompt[-1]], []], np.array([0, len(prompt), 0]), token_ids)
    assert drafts[0] == [] and drafts[2] == [] and drafts[1] == [8, 9, 10, 11]


def test_request_state_follows_its_request_through_reused_and_moved_slots():
    """Anpd's table is per request: found again after the batch is condensed, a new one per request."""
    requests = [repetitive(offset=o) for o in (0, 100, 200, 300, 400)]
    proposer = Anpd(vllm_config())
    h = Harness(proposer, requests, slots=2).run(condense=True)
    assert len(h.outputs) == 5
    assert len(proposer.requests) == 5  # one state per request, none confused with another's
    moved = Anpd(vllm_config())
    h2 = Harness(moved, requests, slots=2).run(condense=False)
    assert h2.accepted == h.accepted  # moving slots costs no acceptance


def test_request_states_are_bounded():
    proposer = Anpd(vllm_config(options={"max_requests": 3}))
    Harness(proposer, [repetitive(offset=o) for o in range(0, 1000, 100)], slots=2).run(max_new=8)
    assert len(proposer.requests) == 3


def test_shared_table_carries_phrases_across_requests():
    phrase_prompt = [1, 2, 3]
    text = [40, 41, 42, 43, 44, 45, 46, 47, 48, 49] * 2
    own = Harness(Anpd(vllm_config()), [(phrase_prompt, text), ([4, 5, 6], text)], slots=1).run()
    shared = Harness(
        Anpd(vllm_config(options={"shared_table": True})), [(phrase_prompt, text), ([4, 5, 6], text)], slots=1
    ).run()
    assert shared.outputs == own.outputs
    assert shared.accepted > own.accepted


def test_auto_stops_drafting_where_drafts_are_rejected():
    """On text whose repeats mislead (every n-gram continues differently), Anpd keeps proposing
    what the target rejects; Auto's calibration learns that and proposes far less."""
    rng = np.random.default_rng(0)
    requests = []
    for _ in range(6):
        # each context [a, b] recurs with a new continuation: the table's guess is always wrong
        prompt = [1, 2, 3]
        cont = []
        for _ in range(30):
            cont += [7, 8, int(rng.integers(20, 2000))]
        requests.append((prompt, cont))
    anpd = Harness(Anpd(vllm_config()), requests, slots=2).run(max_new=90)
    auto = Harness(Auto(vllm_config()), requests, slots=2).run(max_new=90)
    assert anpd.outputs == auto.outputs
    assert anpd.accepted / anpd.proposed < 0.7
    assert auto.proposed - auto.accepted < 0.5 * (anpd.proposed - anpd.accepted)


def test_auto_drafts_nothing_when_tokens_cost_as_much_as_a_step(monkeypatch):
    auto = Auto(vllm_config())
    monkeypatch.setattr(auto.cost, "fit", lambda: (1.0, 100.0))  # a draft token costs 100 steps
    h = Harness(auto, [repetitive(offset=o) for o in (0, 100)], slots=2).run()
    plain_steps = 2 * 40
    assert h.proposed <= plain_steps // 16 + 4  # only the calibration's probes


def test_options_are_checked():
    with pytest.raises(InvalidInputError, match="unknown option"):
        Anpd(vllm_config(options={"max_ngram": 4}))
    with pytest.raises(InvalidInputError, match="max_ngram_size"):
        Anpd(vllm_config(options={"max_ngram_size": 1}))
    with pytest.raises(InvalidInputError, match="shared_table"):
        Auto(vllm_config(options={"shared_table": "yes"}))
    with pytest.raises(InvalidInputError, match="num_speculative_tokens"):
        PromptLookup(vllm_config(k=0))
    assert Anpd(vllm_config(options={"max_ngram_size": 3})).options.max_ngram_size == 3
    assert PromptLookup(vllm_config(options={"max_matching_ngram_size": 3})).options.max_matching_ngram_size == 3


def test_drafts_stop_at_eos():
    proposer = PromptLookup(vllm_config(eos=9))
    prompt, _ = repetitive()
    token_ids = np.zeros((1, 256), dtype=np.int32)
    token_ids[0, : len(prompt)] = prompt
    assert proposer.propose([[prompt[-1]]], np.array([len(prompt)]), token_ids) == [[8]]


def test_step_cost_learns_a_and_b():
    cost = StepCost()
    t = 0.0
    rng = np.random.default_rng(0)
    for _ in range(200):
        tokens = int(rng.integers(1, 33))
        cost.step_started(tokens, now=t)
        t += 0.010 + 0.002 * tokens
        cost.step_ended(now=t)
    a, b = cost.fit()
    assert a == pytest.approx(0.010, rel=0.05) and b == pytest.approx(0.002, rel=0.05)
    cost.step_started(4, now=t)
    cost.step_ended(now=t + 10.0)  # an idle gap is not a step
    assert cost.fit()[0] == pytest.approx(0.010, rel=0.05)


def test_step_cost_prior_decides_where_tokens_do_not_vary():
    cost = StepCost(prior_token_share=0.05)
    for i in range(50):
        cost.step_started(2, now=float(i))
        cost.step_ended(now=i + 0.1)
    a, b = cost.fit()
    assert b / a == pytest.approx(0.05, rel=0.2)
    assert a + 2 * b == pytest.approx(0.1, rel=0.01)


def test_request_states_match_by_content():
    states = RequestStates(capacity=4)
    a = np.array([1, 2, 3, 4])
    s, new = states.claim(a, set())
    assert new
    s.moved_to(a)
    again, new = states.claim(np.array([1, 2, 3, 4, 5, 6]), set())
    assert again is s and not new
    other, new = states.claim(np.array([1, 2, 3, 9, 5, 6]), set())  # same head, different past
    assert new and other is not s
    taken = set()
    first, _ = states.claim(np.array([1, 2, 3, 4, 5, 6]), taken)
    second, new = states.claim(np.array([1, 2, 3, 4, 5, 6]), taken)  # two rows alike in one step
    assert first is s and new and second is not s


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """A tiny target, requests with its greedy continuations, and two draft directories: the target
    itself (every draft token right) and an unrelated model. A wide vocabulary and a flat output
    keep the continuations from looping, so the n-gram drafters find little to copy."""
    import torch

    from tiny_models import reference_greedy, tiny_model, word_tokenizer

    vocab = 512
    target, other_model = tiny_model("llama", vocab_size=vocab), tiny_model("llama", seed=7, vocab_size=vocab)
    with torch.no_grad():
        for model in (target, other_model):
            model.get_output_embeddings().weight.mul_(0.25)
    rng = np.random.default_rng(3)
    requests = []
    for _ in range(3):
        prompt = rng.integers(3, vocab, 12).tolist()
        requests.append((prompt, reference_greedy(target, prompt, 40)))
    same, other = tmp_path_factory.mktemp("same-draft"), tmp_path_factory.mktemp("other-draft")
    target.save_pretrained(same)
    other_model.save_pretrained(other)
    for path in (same, other):
        word_tokenizer().save_pretrained(path)
    return requests, str(same), str(other), vocab, torch.float32


def _auto_with_draft(draft, vocab, dtype, **options):
    return Auto(vllm_config(options={"draft": draft, **options}, vocab_size=vocab, dtype=dtype))


def test_auto_drafts_with_a_draft_model_where_it_pays(tiny_pair):
    requests, same, _, vocab, dtype = tiny_pair
    auto = _auto_with_draft(same, vocab, dtype, draft_confidence=0.0)
    auto.load_model()
    h = Harness(auto, requests, slots=2, step_seconds=(0.02, 0.001)).run(max_new=40, condense=True)
    plain = Harness(Auto(vllm_config()), requests, slots=2).run(max_new=40)
    assert h.outputs == plain.outputs
    proposed, accepted = auto.by_drafter["draft_model"]
    # the draft is the target: every token it drafts is right, but for what runs past a request's end
    assert proposed >= 30 and accepted >= proposed - len(requests)
    assert h.accepted > plain.accepted
    assert auto.gate.drafted_steps > 0.7 * auto.gate.steps
    assert "draft ran in" in auto.summary()


def test_auto_keeps_a_draft_that_does_not_pay_mostly_off(tiny_pair, monkeypatch):
    requests, _, other, vocab, dtype = tiny_pair
    auto = _auto_with_draft(other, vocab, dtype, draft_confidence=0.0)
    auto.load_model()
    propose_rows = auto.draft.propose_rows

    def slow_propose_rows(drafters, ctxs):  # a draft whose forwards cost about a step, as a big draft's would
        time.sleep(0.005)
        return propose_rows(drafters, ctxs)

    monkeypatch.setattr(auto.draft, "propose_rows", slow_propose_rows)
    h = Harness(auto, requests, slots=2, step_seconds=(0.005, 0.0)).run(max_new=40, condense=True)
    assert h.outputs == Harness(Auto(vllm_config()), requests, slots=2).run(max_new=40).outputs
    assert auto.gate.steps > 40
    assert auto.gate.drafted_steps < 0.5 * auto.gate.steps
    proposed, accepted = auto.by_drafter.get("draft_model", [0, 0])
    assert accepted <= 0.3 * proposed


def test_draft_gate_turns_the_draft_off_and_probes_it_again():
    from speculum.integrations.vllm.draft import DraftGate

    gate = DraftGate()
    history = []
    for _ in range(200):
        drafted = gate.wants()
        history.append(drafted)
        # drafting commits 1.2 tokens a row in 1.5 plain steps: less than plain's 1 in 1
        gate.record(drafted, 1.2 if drafted else 1.0, 1.5 if drafted else 1.0)
    assert sum(history[:6]) == 3  # alternation until both sides are measured
    assert sum(history[100:]) < 20 and any(history[100:])  # mostly off, probed now and then
    gate = DraftGate()
    drafted_steps = 0
    for _ in range(200):
        drafted = gate.wants()
        drafted_steps += drafted
        gate.record(drafted, 3.0 if drafted else 1.0, 1.5 if drafted else 1.0)
    assert drafted_steps > 180  # it pays: on but for the steps that keep "without" measured


def test_draft_options_are_checked():
    with pytest.raises(InvalidInputError, match="without a draft"):
        Auto(vllm_config(options={"draft_depth": 4}))
    with pytest.raises(InvalidInputError, match="draft_confidence"):
        Auto(vllm_config(options={"draft": "x", "draft_confidence": 1.5}))
    with pytest.raises(InvalidInputError, match="draft_depth"):
        Auto(vllm_config(options={"draft": "x", "draft_depth": 0}))
    with pytest.raises(InvalidInputError, match="draft must be"):
        Auto(vllm_config(options={"draft": ""}))


def test_auto_drafts_phrases_one_request_wrote_in_the_next():
    rng = np.random.default_rng(5)
    phrase = rng.integers(300, 400, 24).tolist()
    first = (rng.integers(20, 200, 20).tolist(), phrase + rng.integers(20, 200, 10).tolist())
    second = (rng.integers(20, 200, 19).tolist() + phrase[:1], phrase[1:] + rng.integers(20, 200, 10).tolist())
    with_pool = Auto(vllm_config(k=8))
    h = Harness(with_pool, [first, second], slots=1).run(max_new=33)
    without = Harness(Auto(vllm_config(k=8, options={"phrases": False})), [first, second], slots=1).run(max_new=33)
    assert h.outputs == without.outputs
    proposed, accepted = with_pool.by_drafter["phrases"]
    assert accepted >= 10
    assert h.accepted >= without.accepted + 10


def test_draft_gate_does_not_run_the_draft_on_while_no_step_is_timed():
    from speculum.integrations.vllm.draft import MAX_PROBE_STEPS, DraftGate

    gate = DraftGate()
    drafted = [gate.wants() for _ in range(100)]  # no step is recorded (say, prompts always prefilling)
    assert sum(drafted) <= 100 // 2 + 1 and sum(drafted[-20:]) <= MAX_PROBE_STEPS
