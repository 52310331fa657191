"""The drafter protocol: target outputs reach drafters (hidden states, argmax, probabilities), the
prefill feeds them, nothing is computed for drafters that ask for nothing, ``finish`` ends every
request, length policies see the draft's logits and hidden state, configs may hold lists."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from speculum import methods
from speculum.drafters.anpd import AnpdDrafter, Options
from speculum.drafters.base import DraftContext, Outcome
from speculum.methods import SpeculativeConfig
from speculum.policies import DraftStep, LengthPolicy
from speculum.runner import ModelRunner

from helpers import RandomTreeDrafter, brute_counts, build_drafter, generate_ids
from tiny_models import VOCAB, perturbed_copy, reference_greedy, repetitive_prompt, tiny_model

NEW = 30


class ProbeDrafter(RandomTreeDrafter):
    """Random partly-right trees; records what the engine hands back after each step."""

    wants_hidden_states = True

    def start(self, ctx: DraftContext) -> None:
        super().start(ctx)
        self.prefill_hidden = ctx.prefill_hidden
        self.steps = []

    def propose(self, ctx):
        self.context = list(ctx.tokens)
        self.draft = super().propose(ctx)
        return self.draft

    def observe(self, ctx: DraftContext, outcome: Outcome) -> None:
        target = outcome.target
        self.steps.append(
            dict(
                context=self.context,
                draft=outcome.draft,
                accepted_nodes=outcome.accepted_nodes,
                hidden=target.hidden_states,
                root_argmax=target.argmax(-1),
                argmaxes=target.argmaxes(),
                root_probs=target.probs(-1),
            )
        )


def last_token_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0, -1]


@pytest.mark.parametrize("arch,lazy", [("llama", False), ("llama", True), ("gemma3", False), ("gpt2", False)])
def test_hidden_states_and_target_outputs_arrive_and_are_right(arch, lazy):
    model = tiny_model(arch)
    prompt = repetitive_prompt(20, 6, 2)
    reference = reference_greedy(model, prompt, NEW)
    drafter = ProbeDrafter(reference, VOCAB, seed=3, max_nodes=8)
    out, stats = generate_ids(model, prompt, drafter, NEW, lazy_head=lazy or None)
    assert out == reference
    full = prompt + out
    with torch.no_grad():
        ref = model(torch.tensor([full]), output_hidden_states=True)
    hidden = ref.hidden_states[-1][0]
    if arch == "llama":  # they are the LM head's input: the head of them gives the logits
        torch.testing.assert_close(model.lm_head(hidden), ref.logits[0], atol=1e-5, rtol=1e-5)

    # the prefill feeds the drafter: hidden states of every prompt token but the last (the first root)
    torch.testing.assert_close(drafter.prefill_hidden, hidden[: len(prompt) - 1], atol=1e-5, rtol=1e-5)
    assert len(drafter.steps) == stats.target_forwards - 1  # the last step ends the request: finish, not observe
    checked_rejected = 0
    for step in drafter.steps:
        root = len(step["context"]) - 1
        n_acc = len(step["accepted_nodes"])
        # hidden states along the accepted path, root first
        torch.testing.assert_close(step["hidden"], hidden[root : root + 1 + n_acc], atol=1e-5, rtol=1e-5)
        # target argmax at the root and at every accepted node is the next committed token
        assert step["root_argmax"] == full[root + 1]
        for k, node in enumerate(step["accepted_nodes"]):
            assert step["argmaxes"][node] == full[root + 2 + k]
        # ... and at every other node it is what the target says after that node's own path
        draft = step["draft"]
        max_depth = NEW - (len(step["context"]) - len(prompt)) - 1
        for node, depth in enumerate(draft.depths()):
            if depth > max_depth:  # dropped: deeper than the tokens left to generate
                assert step["argmaxes"][node] == -1
                continue
            if node in step["accepted_nodes"]:
                continue
            path, j = [], node
            while j >= 0:
                path.append(draft.tokens[j])
                j = draft.parents[j]
            logits = last_token_logits(model, step["context"] + path[::-1])
            assert step["argmaxes"][node] == int(logits.argmax())
            checked_rejected += 1
        probs = torch.softmax(last_token_logits(model, step["context"]), dim=-1)
        torch.testing.assert_close(step["root_probs"], probs, atol=1e-5, rtol=1e-4)
    assert checked_rejected > 20


def test_nothing_extra_is_computed_for_drafters_that_ask_nothing(monkeypatch):
    """With the lazy head, a drafter that reads no target output costs only the rows on the walked path."""
    model = tiny_model("llama")
    prompt = repetitive_prompt(20, 6, 2)
    reference = reference_greedy(model, prompt, NEW)
    rows = []
    original = ModelRunner._head

    def counting_head(self, hidden):
        rows.append(hidden.shape[0])
        return original(self, hidden)

    monkeypatch.setattr(ModelRunner, "_head", counting_head)
    calls = []
    original_forward = ModelRunner.forward

    def recording_forward(self, cache, tree, **kwargs):
        calls.append(kwargs.get("hidden", False))
        return original_forward(self, cache, tree, **kwargs)

    monkeypatch.setattr(ModelRunner, "forward", recording_forward)
    out, stats = generate_ids(model, prompt, RandomTreeDrafter(reference, VOCAB, seed=1), NEW, lazy_head=True)
    assert out == reference
    assert not any(calls)  # no hidden states asked for
    assert sum(rows) == stats.target_forwards + stats.accepted_tokens  # one row per node on each accepted path
    assert sum(rows) < sum(stats.draft_sizes)  # far fewer than the trees' nodes


class FinishRecorder(RandomTreeDrafter):
    def start(self, ctx):
        super().start(ctx)
        self.finished = None

    def finish(self, ctx):
        self.finished = list(ctx.tokens)


def test_finish_ends_every_request_and_anpd_learns_the_last_tokens():
    model = tiny_model("qwen2")
    prompt = repetitive_prompt(24, 5, 0)
    reference = reference_greedy(model, prompt, NEW)
    recorder = FinishRecorder(reference, VOCAB)
    out, _ = generate_ids(model, prompt, recorder, NEW)
    assert recorder.finished == prompt + out
    anpd = AnpdDrafter(Options(persist=True))
    out, _ = generate_ids(model, prompt, anpd, NEW)
    assert anpd.table.counts() == brute_counts([prompt + out])  # the last step's tokens included


def test_closing_a_stream_early_still_finishes():
    from speculum import engine
    from speculum.sampling import SamplingParams
    from speculum.stats import Stats

    model = tiny_model("llama")
    prompt = repetitive_prompt(24, 5, 0)
    recorder = FinishRecorder(reference_greedy(model, prompt, NEW), VOCAB)
    stats = Stats()
    steps = engine.run(ModelRunner(model), prompt, recorder, SamplingParams(), NEW, frozenset(), None, stats)
    first = next(steps)
    steps.close()
    assert recorder.finished == prompt + first
    assert stats.stop_reason == "cancelled"


class RecordingPolicy(LengthPolicy):
    needs_hidden = True

    def __init__(self):
        super().__init__(4)
        self.steps: list[tuple[list[int], DraftStep]] = []
        self.context: list[int] = []

    def should_stop(self, step: DraftStep) -> bool:
        self.steps.append(step)
        return False


OUROBOROS = {"window_size": 3, "ngram_size": 3, "guess_set_size": 3, "lengthen": False}


@pytest.mark.parametrize("method", ["draft_model", "ouroboros"])
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_length_policy_sees_draft_logits_and_hidden_state(arch, method):
    """Also for Ouroboros, whose draft forwards produce several tokens at once (phrase drafting)."""
    model = tiny_model(arch)
    draft_model = perturbed_copy(model, scale=0.4)
    prompt = repetitive_prompt(24, 5, 0)
    params = OUROBOROS if method == "ouroboros" else {}
    drafter = build_drafter(method, draft_model, VOCAB, num_speculative_tokens=4, length_policy="fixed", **params)
    policy = drafter.policy = RecordingPolicy()
    contexts = []
    original = drafter.propose

    def propose(ctx):
        draft = original(ctx)
        contexts.append((list(ctx.tokens), draft.tokens))
        return draft

    drafter.propose = propose
    out, _ = generate_ids(model, prompt, drafter, 20)
    assert out == reference_greedy(model, prompt, 20)
    steps = iter(policy.steps)
    checked = 0
    for context, drafted in contexts:
        for i in range(len(drafted) - 1):  # the policy is asked after each token but the last
            step = next(steps)
            assert step.position == i and step.token == drafted[i] and step.probs is None
            with torch.no_grad():
                ref = draft_model(torch.tensor([context + drafted[:i]]), output_hidden_states=True)
            torch.testing.assert_close(step.logits, ref.logits[0, -1], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(step.hidden, ref.hidden_states[-1][0, -1], atol=1e-5, rtol=1e-5)
            assert 0.0 < step.confidence <= 1.0
            checked += 1
    assert checked > 5


@dataclasses.dataclass
class ListOptions:
    num_speculative_tokens: int = 3
    tree_choices: list = dataclasses.field(default_factory=lambda: [[0], [0, 0], [1]])


def test_config_values_may_be_lists(monkeypatch):
    import sys
    import types

    module = types.ModuleType("speculum_test_list_method")
    module.Options = ListOptions
    module.Drafter = type("ListDrafter", (RandomTreeDrafter,), {})
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(methods.METHODS, "list_method", f"{module.__name__}:Drafter")
    a = SpeculativeConfig("list_method", tree_choices=[[0], [0, 0], [1]])
    b = SpeculativeConfig("list_method", tree_choices=[[0], [0, 0], [1]])
    c = SpeculativeConfig("list_method", tree_choices=[[0], [1]])
    assert hash(a.key()) == hash(b.key()) and a.key() == b.key() and a.key() != c.key()
    assert {a.key(): 1}[b.key()] == 1
