"""method="auto": every available drafter composed into one tree; exact, greedy and sampled."""

import pytest
import torch

from speculum import engine
from speculum.controller import Controller
from speculum.costs import CostModel
from speculum.drafters.auto import AutoDrafter, ModelGate, Options
from speculum.drafters.base import Draft, Drafter, Outcome, Resources, TargetOutputs
from speculum.errors import InvalidInputError
from speculum.methods import SpeculativeConfig
from speculum.runner import ModelRunner
from speculum.sampling import SamplingParams
from speculum.stats import Stats
from speculum.tree import TokenTree

from helpers import build_drafter, fit_pvalue, slow_catch_up
from tiny_models import ARCHS, VOCAB, perturbed_copy, reference_greedy, repetitive_prompt, tiny_model


def auto(model, draft=None, **params):
    return build_drafter("auto", draft, VOCAB, target=model, **params)


def test_auto_takes_what_the_model_has():
    model = tiny_model("llama")
    assert auto(model).names == ["anpd", "prompt_lookup"]  # no heads ship for a random model, no draft
    assert auto(model, perturbed_copy(model)).names == ["anpd", "prompt_lookup", "ouroboros"]
    assert auto(model, perturbed_copy(model)).whole_sources == {"draft_model"}  # its chain verified as drafted
    assert auto(model).whole_sources == frozenset()
    assert auto(model, perturbed_copy(model), drafters="draft_model,anpd").names == ["draft_model", "anpd"]
    with pytest.raises(InvalidInputError, match="needs a draft model"):
        auto(model, drafters="draft_model")
    with pytest.raises(InvalidInputError, match="drafters must name"):
        SpeculativeConfig("auto", drafters="telepathy")
    with pytest.raises(InvalidInputError, match="medusa"):
        auto(model, drafters="medusa")  # asked for by name, and none found: said so


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("controlled", [False, True])
@pytest.mark.parametrize("part", ["draft_model", "ouroboros"])
def test_auto_equals_plain_greedy(arch, controlled, part):
    model = tiny_model(arch)
    draft = perturbed_copy(model, scale=0.3)
    prompt = repetitive_prompt(24, 5, seed=3)
    reference = reference_greedy(model, prompt, 30)
    drafter = auto(model, draft, drafters=f"anpd,prompt_lookup,{part}")
    controller = Controller(CostModel([(1, 0.01), (4, 0.012), (16, 0.03)])) if controlled else None
    for _ in range(2):
        stats = Stats()
        steps = engine.run(ModelRunner(model), prompt, drafter, SamplingParams(), 30, frozenset(), None, stats,
                           controller)  # fmt: skip
        assert [t for step in steps for t in step] == reference
        assert sum(stats.accepted_by.values()) == stats.accepted_tokens
        assert set(stats.accepted_by) <= {"anpd", "prompt_lookup", "draft_model", "phrases"}


@pytest.mark.parametrize("part", ["draft_model", "ouroboros"])
def test_auto_sampling_follows_the_target(part):
    """Sampled draft-model chains merged with deterministic n-gram branches, or Ouroboros' chains
    picked by the request's noise with phrases below them: exact (chi-square)."""
    from speculum.sampling import PositionNoise, warp

    model = tiny_model("llama", vocab_size=16)
    draft = perturbed_copy(model, scale=0.3)
    prompt = [3, 4, 5, 3, 4, 5, 3, 4]
    sampling = SamplingParams(temperature=1.0, top_k=4)
    with torch.no_grad():
        p1 = warp(model(torch.tensor([prompt], device=model.device)).logits[0, -1], sampling)[0]
        exact = {}
        for a in torch.nonzero(p1 > 0).flatten().tolist():
            p2 = warp(model(torch.tensor([prompt + [a]], device=model.device)).logits[0, -1], sampling)[0]
            for b in torch.nonzero(p2 > 0).flatten().tolist():
                exact[(a, b)] = p1[a].item() * p2[b].item()
    drafter = build_drafter("auto", draft, 16, target=model, num_speculative_tokens=3, draft_depth=3,
                            drafters=f"anpd,prompt_lookup,{part}")  # fmt: skip
    assert drafter.samples_by_noise == (part == "ouroboros")
    gen = torch.Generator(model.device).manual_seed(5)
    counts = dict.fromkeys(exact, 0)
    trials, mixed = 1500, 0
    for _ in range(trials):
        stats = Stats()
        noise = PositionNoise(gen) if drafter.samples_by_noise else None  # (as the API gives it)
        steps = engine.run(ModelRunner(model), prompt, drafter, sampling, 2, frozenset(), gen, stats, None, noise)
        counts[tuple(t for step in steps for t in step)] += 1
        mixed += len(stats.accepted_by) > 0
    assert mixed > 0
    assert fit_pvalue(counts, exact, trials) > 1e-3


class _Fixed(Drafter):
    """Proposes a fixed draft and records what it observed."""

    def __init__(self, draft):
        self.draft, self.seen = draft, []

    def propose(self, ctx):
        return self.draft

    def observe(self, ctx, outcome):
        self.seen.append(outcome)


def test_each_drafter_observes_the_step_in_its_own_numbering():
    a = _Fixed(Draft([5, 6], [-1, 0]))  # 5 -> 6
    b = _Fixed(Draft([7, 5, 8], [-1, -1, 1]))  # 7 ; 5 -> 8 (its 5 merges with a's)
    drafter = AutoDrafter.__new__(AutoDrafter)
    from speculum.drafters.merged_draft import Part as _Part

    drafter.parts = [_Part("a", a, a.draft), _Part("b", b, b.draft)]
    merged = drafter._merged()
    assert merged.tokens == [5, 6, 7, 8] and merged.parents == [-1, 0, -1, 0]
    assert merged.sources == ["a", "a", "b", "b"]
    tree = TokenTree.from_draft(1, merged)
    path = [0, tree.node_of[0], tree.node_of[3]]  # the target accepted 5 then 8
    logits = torch.zeros(len(tree), VOCAB)
    target = TargetOutputs(tree, logits, SamplingParams(), None)
    outcome = Outcome([5, 8], tree.draft_path(path, merged), 9, len(tree) - 1, merged, target)
    for_a = drafter._outcome_for(drafter.parts[0], outcome)
    for_b = drafter._outcome_for(drafter.parts[1], outcome)
    assert (for_a.accepted, for_a.accepted_nodes, for_a.drafted) == ([5], [0], 2)  # its 5, not its 6
    assert (for_b.accepted, for_b.accepted_nodes, for_b.drafted) == ([5, 8], [1, 2], 3)
    assert for_b.target.argmax_of([2]) == [0] and for_b.target.tree.node_of == [3, 1, 4]


def test_the_model_gate_stops_running_a_model_that_does_not_pay_and_tries_again():
    gate = ModelGate(max_backoff=8)
    used = []
    for i in range(60):
        use = gate.use()
        used.append(use)
        # without the model: 1 token in 10 ms; with it: 1.2 tokens in 30 ms (worse), then 5 tokens (better)
        good = i >= 40
        gate.record(use, (5 if good else 1) if use else 1, 0.030 if use else 0.010)
    assert sum(used[10:40]) <= 3 * (30 // 8 + 1)  # backed off: a probe of 3 rounds per 8 at most
    assert all(used[52:])  # noticed it pays within one back-off, then kept it


def test_auto_with_ouroboros_sees_its_chain_verified_and_runs_one_draft_model():
    """Named, Ouroboros is auto's draft-model part: its chain is verified whole as the draft model's,
    and it observes the target's outputs at its own nodes through auto's view of the step (what its
    phrase harvest reads); it cannot run beside draft_model (the same chain drafted twice)."""
    model = tiny_model("llama")
    drafter = auto(model, perturbed_copy(model, scale=0.1), drafters="anpd,prompt_lookup,ouroboros")
    assert drafter.names == ["anpd", "prompt_lookup", "ouroboros"] and drafter.whole_sources == {"draft_model"}
    ouroboros = drafter.parts[2].drafter
    assert ouroboros.options.length_policy == "confidence" and ouroboros.options.window_size == 0
    seen = []
    observe = ouroboros.observe

    def spy(ctx, outcome):
        chain = list(ouroboros._chain)
        if chain:
            seen.append(
                (chain, outcome.accepted, outcome.target.argmax_of(list(range(len(chain)))), outcome.next_token)
            )
        observe(ctx, outcome)

    ouroboros.observe = spy
    prompt = repetitive_prompt(24, 5, seed=3)
    stats = Stats()
    steps = engine.run(ModelRunner(model), prompt, drafter, SamplingParams(), 40, frozenset(), None, stats)
    assert [t for step in steps for t in step] == reference_greedy(model, prompt, 40)
    assert stats.accepted_by.get("draft_model", 0) > 0 and len(ouroboros.pool) > 0  # (the context's phrases)
    assert seen and all(None not in after for _, _, after, _ in seen)  # the chain was verified whole
    whole = [(after, nxt) for chain, accepted, after, nxt in seen if accepted == chain]
    assert whole and all(after[-1] == nxt for after, nxt in whole)  # its numbering: the bonus follows its last
    with pytest.raises(InvalidInputError, match="both run the draft model"):
        SpeculativeConfig("auto", drafters="draft_model,ouroboros")
    with pytest.raises(InvalidInputError, match="needs a draft model"):
        auto(model, drafters="ouroboros")


def test_auto_options():
    from speculum.drafters.auto import _sub_config

    assert Options().names() == ["anpd", "prompt_lookup", "medusa", "ctc", "ouroboros"]
    with pytest.raises(InvalidInputError):
        Options(num_speculative_tokens=0)
    with pytest.raises(InvalidInputError):
        Options(draft_depth=0)
    for bad in (1.0, -0.1, "high", True):
        with pytest.raises(InvalidInputError, match="draft_confidence"):
            Options(draft_confidence=bad)
    r = Resources()
    assert AutoDrafter(Options(drafters="anpd"), r).names == ["anpd"]
    # the draft model's stop reaches its part
    part = _sub_config("ouroboros", Options(draft_confidence=0.4, draft_depth=4)).options("cpu")
    assert part.confidence_threshold == 0.4 and part.num_speculative_tokens == 4
    # the controller's chain stop: off in auto unless asked for, and then on in both draft-model parts
    assert not _sub_config("ouroboros", Options()).options("cpu").chain_stop
    assert all(_sub_config(name, Options(chain_stop=True)).options("cpu").chain_stop
               for name in ("draft_model", "ouroboros"))  # fmt: skip
    with pytest.raises(InvalidInputError, match="chain_stop"):
        Options(chain_stop="yes")


def test_the_draft_models_sampled_chain_comes_first_and_takes_equal_tokens_in():
    """At T > 0 siblings are tried in order: the draft model's chain first (as it would be alone),
    an n-gram node holding its sampled token joined to it (its subtree below), other nodes after
    it, calibrated apart (they are tried against the residual)."""
    from speculum.controller import calibration_labels
    from speculum.drafters.merged_draft import Part as _Part

    q = torch.full((VOCAB,), 1.0 / VOCAB)
    ngram = _Fixed(Draft([5, 7, 9], [-1, 0, -1]))  # 5 -> 7 ; 9
    model = _Fixed(Draft([5, 6], [-1, 0], torch.stack([q, q])))  # sampled 5 -> 6
    drafter = AutoDrafter.__new__(AutoDrafter)
    drafter.parts = [_Part("anpd", ngram, ngram.draft), _Part("draft_model", model, model.draft)]
    merged = drafter._merged()
    assert merged.tokens == [5, 6, 7, 9] and merged.parents == [-1, 0, 0, -1]
    assert merged.sources == ["draft_model", "draft_model", "anpd", "anpd"]
    assert merged.q(0) is not None and merged.q(2) is None
    assert drafter.parts[0].nodes == [0, 2, 3] and drafter.parts[1].nodes == [0, 1]
    assert calibration_labels(merged) == ["draft_model", "draft_model", "anpd after a sample", "anpd after a sample"]
    tree = TokenTree.from_draft(1, merged)
    assert tree.children[0] == [1, 4] and tree.q(1) is not None  # the sample is tried first
    # greedy (nothing sampled): one node per token, the draft model's, and plain labels
    model.draft = Draft([5, 6], [-1, 0])
    drafter.parts[1].draft = model.draft
    greedy = drafter._merged()
    assert greedy.tokens == [5, 6, 7, 9] and greedy.sources[0] == "draft_model"
    assert calibration_labels(greedy) == greedy.sources


def test_the_draft_model_and_heads_are_gated_apart():
    """Heads that stopped paying beside the draft model (T=1) stop running; the draft model does not."""
    from types import SimpleNamespace

    from speculum.drafters.merged_draft import Part as _Part

    drafter = AutoDrafter.__new__(AutoDrafter)
    drafter.options, drafter._gates = Options(), {}
    parts = {"anpd": [7], "medusa": [6], "draft_model": [5]}
    drafter.parts = [_Part(name, _Fixed(Draft(tokens, [-1]))) for name, tokens in parts.items()]
    drafter.groups = ["heads", "draft model"]
    assert drafter.gate(1, "heads") is not drafter.gate(1, "draft model")
    assert drafter.gate(1) is drafter.gate(1, "heads")  # the first group, by default
    ctx = SimpleNamespace(rows=1, tokens=[1] * 30, prompt_length=20, max_depth=8, sampling=SamplingParams())
    assert drafter.propose(ctx).tokens == [5, 7, 6]  # every group runs while nothing says otherwise
    drafter.gate(1, "heads")._skip = 10_000  # the heads stopped paying
    assert drafter.propose(ctx).tokens == [5, 7]
    drafter.gate(1, "draft model")._skip = 10_000
    assert drafter.propose(ctx).tokens == [7]


def test_a_sampled_round_that_runs_the_draft_model_verifies_its_draft_alone():
    """At T > 0 the other drafters' nodes would only be tried after the draft's sample is rejected:
    a round that runs the draft model proposes its draft alone, and the heads' gate learns nothing
    from it; without the draft model the others propose as before."""
    from types import SimpleNamespace

    from speculum.drafters.merged_draft import Part as _Part

    drafter = AutoDrafter.__new__(AutoDrafter)
    drafter.options, drafter._gates = Options(), {}
    parts = {"anpd": [7], "medusa": [6], "draft_model": [5]}
    drafter.parts = [_Part(name, _Fixed(Draft(tokens, [-1]))) for name, tokens in parts.items()]
    drafter.groups = ["heads", "draft model"]
    sampled = SamplingParams(temperature=1.0)
    ctx = SimpleNamespace(rows=1, tokens=[1] * 30, prompt_length=20, max_depth=8, sampling=sampled, cost=None)
    assert drafter.propose(ctx).tokens == [5]
    assert drafter.parts[0].draft is None and drafter.parts[1].draft is None  # they did not run
    assert set(drafter._deciding) == {"draft model"}  # the heads' gate is not told about this round
    drafter.gate(1, "draft model")._skip = 10_000
    assert drafter.propose(ctx).tokens == [7, 6]
    assert set(drafter._deciding) == {"heads", "draft model"}
    # rows of a batch decide each by their own sampling
    twin = AutoDrafter.__new__(AutoDrafter)
    twin.options, twin._gates, twin.groups = Options(), drafter._gates, drafter.groups
    twin.parts = [_Part(name, _Fixed(Draft(tokens, [-1]))) for name, tokens in parts.items()]
    drafter.gate(2, "draft model")._skip = 0
    greedy = SimpleNamespace(
        rows=2, tokens=[1] * 30, prompt_length=20, max_depth=8, sampling=SamplingParams(), cost=None
    )
    rows = AutoDrafter.propose_rows([drafter, twin], [SimpleNamespace(**{**vars(ctx), "rows": 2}), greedy])
    assert [d.tokens for d in rows] == [[5], [5, 7, 6]]


def test_a_draft_model_whose_catch_up_would_not_pay_sits_the_request_out():
    """Alone, the draft model runs in a request only where what it saves per token, over the tokens
    the request likely has left, pays for its catch-up (its prefill of the prompt); the cheap
    drafters still propose; once the tokens decoded without it make a probe worth its cost, one
    request uses it anyway."""
    import math
    from types import SimpleNamespace

    from speculum.controller import CATCH_UP_PROBE_SHARE
    from speculum.drafters.merged_draft import Part as _Part

    drafter = AutoDrafter.__new__(AutoDrafter)
    drafter.options, drafter._gates = Options(), {}
    model = _Fixed(Draft([5], [-1]))
    catch_up = 0.045
    model.catch_up_estimate = lambda ctx: catch_up  # seconds of prefill first
    drafter.parts = [_Part("draft_model", model), _Part("anpd", _Fixed(Draft([7], [-1])))]
    drafter.groups = ["draft model"]
    gate = drafter.gate(1, "draft model")
    for _ in range(10):  # rounds with the draft model: 2 tokens in 0.012 s; without it: 1 in 0.010 s
        gate._learn(True, 2.0, 0.012, 1, (1.0, 0.010, 1))
    saving, step = 0.010 - 0.006, 0.010  # seconds a token
    ctx = SimpleNamespace(rows=1, tokens=[1] * 30, prompt_length=20, max_depth=200, sampling=SamplingParams())
    assert drafter.propose(ctx).tokens == [5, 7]  # request lengths unknown: 200 tokens may be left
    drafter._proposed = False
    assert 10 * saving < catch_up < 200 * saving  # 10 tokens a request: the catch-up does not pay
    # a probe (the catch-up and a plain step) is due once this many tokens went without it
    due = (catch_up + step) / (CATCH_UP_PROBE_SHARE * step)
    without = math.ceil(due / 10) - 1  # requests of 10 tokens, the probing one's counted as it runs
    runs = []
    for _ in range(1 + 2 * (without + 1)):
        drafter.start(ctx)
        runs.append(drafter.propose(ctx).tokens == [5, 7])
        drafter._proposed = False
        drafter.finish(ctx)
    # the first request's length was not known when it started
    assert runs == [True] + ([False] * without + [True]) * 2


def test_the_catch_up_rule_weighs_a_longer_memory_than_the_gates_last_window():
    """A draft model that paid over many rounds still starts a request after the gate stopped it on
    a short losing window: the gate stops right after such a window, and the catch-up rule reading
    that window kept the draft model off for whole requests at T=1. A long losing record still
    keeps it off."""
    gate = ModelGate()
    for _ in range(40):  # with the draft model: 2 tokens in 0.012 s; without: 1 in 0.010 s
        gate._learn(True, 2.0, 0.012, 1, (1.0, 0.010, 1))
    while gate._skip == 0:  # a bad patch: 1 token in 0.014 s, until the gate stops the group
        gate._learn(True, 1.0, 0.014, 1, (1.0, 0.010, 1))
    assert gate.with_model.rate < gate.without_model.rate  # the window the gate stopped on lost
    catch_up, left = 0.2, 100  # at the long-run saving (~0.004 s a token) 100 tokens pay 0.2 s
    assert gate.worth_catching_up(catch_up, 0, left)
    for _ in range(120):  # it keeps losing
        gate._learn(True, 1.0, 0.014, 1, (1.0, 0.010, 1))
    assert not gate.worth_catching_up(catch_up, 0, left)


def test_a_groups_round_without_it_is_estimated_on_the_same_round():
    """What heads brought in a round: the accepted path cut before their first own node (the target's
    token committed there instead), their drafting and their nodes' share of the forward saved."""
    from speculum.drafters.merged_draft import Part as _Part

    ngram = _Fixed(Draft([5, 6], [-1, 0]))  # 5 -> 6
    heads = _Fixed(Draft([5, 7, 9], [-1, 0, -1]))  # 5 -> 7 ; 9 (its 5 is the n-gram's too)
    drafter = AutoDrafter.__new__(AutoDrafter)
    drafter.parts = [_Part("anpd", ngram, ngram.draft), _Part("medusa", heads, heads.draft)]
    drafter._drafting = {"heads": 0.004}
    merged = drafter._merged()
    assert merged.tokens == [5, 6, 7, 9]
    tree = TokenTree.from_draft(1, merged)
    target = TargetOutputs(tree, torch.zeros(len(tree), VOCAB), SamplingParams(), None)
    cost = CostModel([(1, 0.010), (3, 0.012), (5, 0.020)])
    outcome = Outcome([5, 7], [0, 2], 4, len(tree) - 1, merged, target, stats={"node_cost": cost})
    tokens, seconds = drafter._without({"heads"}, outcome, 0.030)
    assert tokens == 2  # 5, then the target's own 7 (the bonus), not 5, 7 and the bonus
    assert seconds == pytest.approx(0.030 - 0.004 - (0.020 - 0.012))  # 2 of the 4 nodes were the heads'
    # a round where the n-gram chain was accepted whole: the heads brought nothing
    outcome = Outcome([5, 6], [0, 1], 4, len(tree) - 1, merged, target, stats={"node_cost": cost})
    assert drafter._without({"heads"}, outcome, 0.030)[0] == 3
    assert drafter._without({"heads"}, Outcome([5, 6], [0, 1], 4, 4, merged, target), 0.03) is None  # no cost model


def test_the_paired_gate_stops_heads_that_cost_more_than_they_bring_through_bursts():
    """Bursty rounds (an n-gram copy of 8 tokens now and then) do not hide heads that add 0.2 tokens
    a round for a fifth more time, and once they add 2 tokens a round they run again within one
    back-off, every round (no round is spent without them to measure that side)."""
    gate = ModelGate(max_backoff=8)
    used = []
    for i in range(120):
        use = gate.use()
        used.append(use)
        base = 8 if i % 5 == 0 else 1  # what the n-gram drafters give this round, with or without heads
        adds = 0.2 if i < 60 else 2.0
        if use:
            gate.record(True, base + adds, 0.012, without=(base, 0.010))
        else:
            gate.record(False, base, 0.010)
    assert sum(used[20:60]) <= 3 * (40 // 8 + 1)  # backed off: probes only
    assert all(used[60 + 8 + 3 :])  # noticed within a back-off and a probe, then kept


def test_the_model_gate_judges_the_draft_model_without_its_prefill():
    """The draft model's catching up (its prefill of the prompt) is not held against it by auto's
    gate: the round it falls in counts what the draft model's drafting costs per round."""
    model = tiny_model("llama")
    draft = perturbed_copy(model, scale=0.1)
    prompt = repetitive_prompt(24, 5, seed=3)
    # (a first request loads what kernels the models use, a second per kernel on CUDA: not under test)
    warm_up = auto(model, draft, drafters="draft_model")
    list(engine.run(ModelRunner(model), prompt, warm_up, SamplingParams(), 20, frozenset(), None, Stats(), Controller(
        CostModel([(1, 0.01), (4, 0.012), (16, 0.03)]))))  # fmt: skip
    drafter = auto(model, draft, drafters="draft_model")
    slow_catch_up(drafter.parts[0].drafter, 0.5)
    gate = drafter.gate(1, "draft model")
    judged = []  # the seconds of each round the gate was told of
    record = gate.record
    gate.record = lambda used, tokens, seconds, *rest: (
        judged.append(seconds),
        record(used, tokens, seconds, *rest),
    )
    stats = Stats()
    controller = Controller(CostModel([(1, 0.01), (4, 0.012), (16, 0.03)]))
    steps = engine.run(ModelRunner(model), prompt, drafter, SamplingParams(), 20, frozenset(), None, stats, controller)
    assert [t for step in steps for t in step] == reference_greedy(model, prompt, 20)
    assert stats.time_draft_catch_up >= 0.5
    assert len(judged) >= 2 and max(judged) < 0.5  # the first round's, had the prefill counted, is over 0.5 s


def test_the_controller_hears_what_a_round_would_have_given_without_the_gated_parts(monkeypatch):
    """Alone, a round that ran a gated group (here the draft model) tells the controller what it
    would have committed and cost without it (``lean``): never more tokens, never more time. A
    round that ran none says nothing, and the output is plain greedy's."""
    model = tiny_model("llama")
    prompt = repetitive_prompt(24, 5, seed=3)
    drafter = auto(model, perturbed_copy(model, scale=0.3), drafters="anpd,draft_model")
    controller = Controller(CostModel([(1, 0.01), (4, 0.012), (16, 0.03)]))
    heard = []
    observe = Controller.observe_round

    def hearing(self, tree, path, draft, **kwargs):
        heard.append((kwargs["asked"], kwargs["committed"], kwargs["round_seconds"], kwargs.get("lean")))
        return observe(self, tree, path, draft, **kwargs)

    monkeypatch.setattr(Controller, "observe_round", hearing)
    steps = engine.run(ModelRunner(model), prompt, drafter, SamplingParams(), 30, frozenset(), None, Stats(),
                       controller)  # fmt: skip
    assert [t for step in steps for t in step] == reference_greedy(model, prompt, 30)
    lean_rounds = [(committed, seconds, lean) for asked, committed, seconds, lean in heard if lean is not None]
    assert lean_rounds  # the draft model ran, and the controller heard the round without it
    for committed, seconds, (tokens, lean_seconds, nodes) in lean_rounds:
        assert 1 <= tokens <= committed and 0 < lean_seconds <= seconds and nodes >= 0
    assert all(lean is None for asked, _, _, lean in heard if not asked)


def test_a_lean_round_counts_the_cheap_drafters_nodes_verified_not_proposed(monkeypatch):
    """When the controller prunes every node of a round, the lean round (the n-gram drafter
    alone) verified nothing: it reports no nodes, so the controller takes it for no evidence, as it
    takes ``anpd``'s own rounds that verify nothing. Counting the nodes proposed made such rounds
    evidence against asking, slightly lost, where ``anpd`` alone would not have counted them."""
    model = tiny_model("llama")
    prompt = repetitive_prompt(24, 5, seed=3)
    drafter = auto(model, perturbed_copy(model, scale=0.3), drafters="anpd,draft_model")
    controller = Controller(CostModel([(1, 0.01), (4, 0.012), (16, 0.03)]))
    heard, proposed = [], []
    plan, observe = Controller.plan, Controller.observe_round

    def pruning_everything(self, draft, *args, **kwargs):
        planned = plan(self, draft, *args, **kwargs)
        proposed.append(sum(1 for source in draft.sources if source == "anpd"))
        planned.keep = [False] * len(draft)
        return planned

    def hearing(self, tree, path, draft, **kwargs):
        heard.append((len(tree), kwargs.get("lean")))
        return observe(self, tree, path, draft, **kwargs)

    monkeypatch.setattr(Controller, "plan", pruning_everything)
    monkeypatch.setattr(Controller, "observe_round", hearing)
    steps = engine.run(ModelRunner(model), prompt, drafter, SamplingParams(), 30, frozenset(), None, Stats(),
                       controller)  # fmt: skip
    assert [t for step in steps for t in step] == reference_greedy(model, prompt, 30)
    assert sum(proposed) > 0  # the n-gram drafter proposed nodes, all pruned
    lean_rounds = [lean for size, lean in heard if lean is not None]
    assert lean_rounds and all(size == 1 for size, _ in heard)
    assert all(nodes == 0 for _, _, nodes in lean_rounds)


def test_a_measured_batch_runs_the_draft_model_only_where_its_saving_pays_the_catch_up():
    """At a batch size where the draft model has run, it runs again only where what it saves per
    token there, over the tokens the rows likely have left, pays for the rows' catch-up (in a server
    rows keep joining with a whole prompt for the draft to catch up)."""
    from speculum.drafters.model_gate import BatchRound

    gate = ModelGate()
    gate.with_model.add(4.0, 0.2, rows=4)  # 20 tokens/s with it
    gate.without_model.add(1.0, 0.1, rows=4)  # 10 tokens/s without: it saves 0.05 s a token
    cost = CostModel([(1, 0.01), (64, 0.011)])

    def batch(catch_up, left):
        return BatchRound(cost, 4, 4, 0.01, catch_up, left, 1.0)

    assert gate.catch_up_pays(batch(0.0, 10))
    assert gate.catch_up_pays(batch(0.9, 20))  # 1 s saved
    assert not gate.catch_up_pays(batch(1.1, 20))
    gate.with_model.add(1.0, 0.2, fresh=True, rows=4)  # now it loses: no catch-up is worth it
    assert not gate.catch_up_pays(batch(0.01, 1000))
