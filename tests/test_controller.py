"""The controller: what it verifies under a synthetic cost model, when it drafts, and exactness with it on."""

import copy
import random

import pytest
import torch

from speculum import engine
from speculum.controller import Calibration, Controller, source_depths
from speculum.costs import CostModel
from speculum.errors import InvalidInputError
from speculum.runner import ModelRunner
from speculum.sampling import SamplingParams
from speculum.stats import Stats
from speculum.tree import Draft, TokenTree

from helpers import RandomTreeDrafter, build_drafter, fit_pvalue, generate_ids, slow_catch_up
from tiny_models import ARCHS, VOCAB, perturbed_copy, reference_greedy, repetitive_prompt, tiny_model

FLAT = CostModel([(1, 0.010), (64, 0.011)])  # verifying 64 nodes costs what one does (a GPU-like curve)
STEEP = CostModel([(1, 0.010), (2, 0.020), (64, 0.640)])  # every node costs a whole step


@pytest.fixture(autouse=True)
def _fresh_curves():
    """Every test starts from the module's curves as written: a controller refines (and, when real
    forwards land far off, rescales) the cost model it was given."""
    shared = [FLAT, STEEP, BATCHED, PHRASE_COST]
    saved = [copy.deepcopy(vars(curve)) for curve in shared]
    yield
    for curve, state in zip(shared, saved, strict=True):
        vars(curve).update(state)


def chain_draft(n, score):
    return Draft.chain(list(range(3, 3 + n)), scores=[score] * n)


def run_rounds(controller, rounds, accepted_of, drafted=4, seconds=0.010, draft_seconds=0.002):
    """Feed ``controller`` synthetic rounds: a 4-token chain whose first ``accepted_of(i)`` tokens are
    accepted; returns which rounds asked the drafter."""
    asked_rounds = []
    for i in range(rounds):
        asked = controller.wants_draft()
        asked_rounds.append(asked)
        if asked:
            draft = chain_draft(drafted, 0.5)
            plan = controller.plan(draft, 10)
            tree = TokenTree.from_draft(1, draft, keep=plan.keep)
            accepted = min(accepted_of(i), len(tree) - 1)
            path = list(range(accepted + 1))
            controller.observe_round(
                tree, path, draft, asked=True, committed=accepted + 1,
                forward_seconds=seconds, round_seconds=seconds + draft_seconds,
            )  # fmt: skip
        else:
            controller.observe_round(
                TokenTree([1], [-1]), [0], None, asked=False, committed=1,
                forward_seconds=seconds, round_seconds=seconds,
            )  # fmt: skip
    return asked_rounds


def test_a_steep_cost_curve_prunes_and_a_flat_one_keeps():
    draft = chain_draft(8, 0.7)
    flat = Controller(FLAT).plan(draft, 10)
    steep = Controller(STEEP).plan(draft, 10)
    assert flat.keep is not None and sum(flat.keep) == 8  # nearly free: verify everything likely
    assert sum(steep.keep) == 0  # each node costs a full step: P(accept) < 1 never pays
    assert steep.expected_tokens == 1.0


def test_pruning_keeps_the_most_likely_nodes_and_their_ancestors():
    # root -> a (0.9) -> b (0.9); root -> c (0.05) -> d (0.9)
    draft = Draft([5, 6, 7, 8], [-1, 0, -1, 2], scores=[0.9, 0.9, 0.05, 0.9])
    cost = CostModel([(1, 0.010), (2, 0.0105), (3, 0.011), (4, 0.030), (5, 0.040)])
    plan = Controller(cost).plan(draft, 10)
    assert plan.keep == [True, True, False, False]
    tree = TokenTree.from_draft(1, draft, keep=plan.keep)
    assert tree.tokens == [1, 5, 6] and tree.node_of == [1, 2, -1, -1]


def test_nodes_beyond_the_depth_left_are_not_counted():
    plan = Controller(FLAT).plan(chain_draft(8, 0.9), max_depth=3)
    assert sum(plan.keep) == 3


def test_a_whole_source_is_verified_as_proposed_and_the_rest_pruned():
    # a draft model's chain (scores 0.3: the calibration would prune it) and an n-gram branch beside it
    draft = Draft([5, 6, 7, 8, 9], [-1, 0, 1, -1, 3], scores=[0.3, 0.3, 0.3, 0.3, 0.3],
                  sources=["draft_model"] * 3 + ["anpd"] * 2)  # fmt: skip
    assert sum(Controller(STEEP).plan(draft, 10).keep) == 0
    plan = Controller(STEEP).plan(draft, 10, whole_sources=frozenset({"draft_model"}))
    assert plan.keep == [True, True, True, False, False]
    assert Controller(STEEP).plan(draft, 2, whole_sources=frozenset({"draft_model"})).keep[:3] == [True, True, False]
    sampled = Draft(draft.tokens, draft.parents, [torch.full((VOCAB,), 1.0 / VOCAB)] * 5, draft.scores, draft.sources)
    assert Controller(STEEP).plan(sampled, 10, whole_sources=frozenset({"draft_model"})).keep[:3] == [True] * 3


def test_a_batch_thins_speculation_out():
    # one row's tree of 5 costs about a plain step; 16 rows padded to 5 nodes cost 5 times 16 rows of one
    cost = CostModel([(1, 0.010), (8, 0.011), (16, 0.040), (64, 0.160)])
    draft = chain_draft(4, 0.7)
    assert sum(Controller(cost).plan(draft, 10).keep) == 4
    assert sum(Controller(cost).plan(draft, 10, rows=16).keep) == 0  # the gain of one row, the cost of all
    assert sum(Controller(cost).plan(draft, 10, rows=16, floor=5).keep) == 4  # padded to 5 anyway: free


def test_the_batch_cost_is_learnt_per_batch_size_from_its_forwards():
    cost = CostModel([(1, 0.010), (4, 0.011), (16, 0.040), (64, 0.160)])
    assert cost.batch(16, 1) == pytest.approx(cost.base(16))  # before any batch: 16 nodes of one tree
    for _ in range(100):
        cost.observe_batch(16, 1, 0.080)
    assert cost.batch(16, 1) == pytest.approx(0.080, rel=0.01)
    assert cost.batch(16, 2) == pytest.approx(2 * cost.base(32), rel=0.01)  # the nearest size's correction
    assert cost.batch(4, 1) == pytest.approx(cost.base(4))  # another batch size: not learnt yet
    assert cost(1) == 0.010  # the single-row curve is untouched


def run_batch_steps(rows, steps, accepted_of, cost, draft_seconds=0.004, controllers=None, first_step=0):
    """Feed the row controllers of one configuration synthetic batched steps of ``rows`` rows (each
    drafting row accepts ``accepted_of(step)`` of a 4-token chain, verified whole); which steps drafted."""
    shared = Controller(cost)
    controllers = controllers or [shared.for_row() for _ in range(rows)]
    drafted = []
    for step in range(first_step, first_step + steps):
        asks = [c.wants_draft(rows, step) for c in controllers]
        assert len(set(asks)) == 1  # one decision for the rows of a step
        drafted.append(asks[0])
        padded = 5 if asks[0] else 1
        forward = cost.batch(rows, padded)
        for c in controllers:
            if asks[0]:
                draft = chain_draft(4, 0.5)
                tree = TokenTree.from_draft(1, draft)
                accepted = accepted_of(step)
                c.observe_round(
                    tree, list(range(accepted + 1)), draft, asked=True, committed=accepted + 1,
                    forward_seconds=forward, round_seconds=forward + draft_seconds,
                    draft_seconds=draft_seconds, rows=rows, padded=padded,
                )  # fmt: skip
            else:
                c.observe_round(
                    TokenTree([1], [-1]), [0], None, asked=False, committed=1, forward_seconds=forward,
                    round_seconds=forward, rows=rows, padded=1,
                )  # fmt: skip
    return drafted, controllers


# 8 rows: a plain batched step costs 20 ms, 8 rows of 5 nodes 60 ms (the forward is compute-bound)
BATCHED = CostModel([(1, 0.010), (8, 0.020), (40, 0.060), (64, 0.090)])


def test_rows_of_a_batch_stop_drafting_together_when_it_does_not_pay_at_that_batch_size():
    # 2 of 4 tokens accepted: 3 tokens a row for 3x the step, plus drafting: a loss at 8 rows
    drafted, controllers = run_batch_steps(8, 200, lambda step: 2, BATCHED)
    assert drafted[0] and sum(drafted[-100:]) <= 100 // 32 + 1  # a probe: one step (8 rows of evidence)
    # what was learnt holds for the next requests' rows (new controllers of the configuration)
    later = [controllers[0].for_row() for _ in range(8)]
    for controller in later:
        controller.start()  # a greedy request's own back-off starts afresh
    assert sum(run_batch_steps(8, 20, lambda step: 2, BATCHED, controllers=later, first_step=200)[0]) <= 3
    # and says nothing of another batch size, nor of a request decoding alone
    alone = controllers[0].for_row()
    alone.start()
    assert controllers[0].verdict(2) is not controllers[0].verdict(8) and alone.wants_draft()


def test_rows_of_a_batch_draft_again_when_drafts_become_good():
    drafted, controllers = run_batch_steps(8, 200, lambda step: 0, BATCHED)
    assert sum(drafted[-100:]) <= 3 * (100 // 32 + 1)
    # all 4 accepted: 5 tokens a row for 3x the step pays; noticed within the back-off cap
    again, _ = run_batch_steps(8, 300, lambda step: 4, BATCHED, controllers=controllers, first_step=200)
    first = again.index(True)
    assert first <= 8 * 32 and all(again[first + 1 :])


def test_calibration_learns_what_the_target_accepts():
    cal = Calibration()
    assert cal.estimate(0.95, 1) > 0.8  # before any evidence: the drafter's own belief
    for _ in range(200):
        cal.update(0.95, 1, accepted=False)
    assert cal.estimate(0.95, 1) < 0.1
    # unscored nodes: by depth, from 0.5 (another source: the first one's misses are not its own)
    assert cal.estimate(None, 2, "ngram") == pytest.approx(0.5)
    for _ in range(50):
        cal.update(None, 2, accepted=True, source="ngram")
    assert cal.estimate(None, 2, "ngram") > 0.9
    assert cal.estimate(None, 3, "other") == pytest.approx(0.5)


def test_a_source_whose_nodes_fall_short_of_their_estimates_is_corrected_in_every_bin():
    """A drafter's belief (its score, the prior of ~30 bins) is far above what the target accepts: after
    a few dozen of its nodes, even bins that saw none of them estimate near what the source gets,
    while another source keeps its own estimates; bins that learnt the truth stay near it."""
    cal = Calibration()
    rng = random.Random(0)
    for i in range(60):  # heads sure of themselves at every depth, accepted 5% of the time
        cal.update(0.9, 1 + i % 2, accepted=rng.random() < 0.05, source="medusa")
    assert cal.estimate(0.9, 3, "medusa") < 0.35  # depth 3: no node of its own yet (prior 0.95)
    assert cal.estimate(0.9, 3, "anpd") > 0.9
    for _ in range(300):  # a source whose bins are right: its correction stays near one
        cal.update(0.35, 1, accepted=rng.random() < 0.35, source="anpd")
    assert 0.25 < cal.estimate(0.35, 1, "anpd") < 0.45


def test_calibration_tells_a_first_guess_from_the_rest_of_a_copied_phrase():
    # an n-gram drafter's first token is a guess (30% accepted), the ones after it follow a phrase the
    # text already contains (90% accepted once the first is); both come with the same score
    cal = Calibration()
    rng = random.Random(0)
    for _ in range(300):
        cal.update(1.0, 1, accepted=rng.random() < 0.3)
        cal.update(1.0, 2, accepted=rng.random() < 0.9)
        cal.update(1.0, 5, accepted=rng.random() < 0.9)
    assert cal.estimate(1.0, 1) < 0.45
    assert cal.estimate(1.0, 2) > 0.8 and cal.estimate(1.0, 4) > 0.8


def test_a_drafter_that_is_never_right_gets_plain_steps():
    controller = Controller(FLAT)
    asked = run_rounds(controller, 200, accepted_of=lambda i: 0)
    # back-off: one probe (3 asked rounds) per 32 plain rounds at most, after a ramp
    assert sum(asked[-100:]) <= 3 * (100 // 32 + 1)


def test_a_drafter_that_becomes_perfect_is_asked_again_within_the_backoff():
    controller = Controller(FLAT, max_backoff=32)
    run_rounds(controller, 200, accepted_of=lambda i: 0)  # long useless stretch: fully backed off
    asked = run_rounds(controller, 80, accepted_of=lambda i: 4)
    first = asked.index(True)
    assert first <= 32  # noticed within one back-off
    assert all(asked[first + 1 :])  # and then asked every round (plus it keeps verifying the draft)


def test_a_bursty_drafter_that_pays_on_average_keeps_drafting():
    # a quarter of the rounds, at random, accept all 4 tokens and the others nothing (a copied phrase
    # now and then): asking gives 2 tokens per 1.2 steps on average. Judged on one probe round and a
    # short memory, the failure streaks made the controller back off for up to 2/3 of the rounds.
    for seed in range(5):
        rng = random.Random(seed)
        hits = [4 if rng.random() < 0.25 else 0 for _ in range(400)]
        asked = run_rounds(Controller(FLAT), 400, accepted_of=hits.__getitem__)
        assert sum(asked[-200:]) >= 180


def chance_rounds(controller, rounds, rng, chance, accepted, forward_seconds, draft_seconds, plain_seconds=0.010):
    """Rounds where a 4-token chain, verified whole, has its first ``accepted`` tokens taken with
    probability ``chance`` (else none); plain rounds take ``plain_seconds``. Which rounds asked."""
    asked = []
    for _ in range(rounds):
        asked.append(controller.wants_draft())
        if asked[-1]:
            draft = chain_draft(4, 0.5)
            tree = TokenTree.from_draft(1, draft, keep=[True] * 4)
            taken = accepted if rng.random() < chance else 0
            controller.observe_round(
                tree, list(range(taken + 1)), draft, asked=True, committed=taken + 1,
                forward_seconds=forward_seconds, round_seconds=forward_seconds + draft_seconds,
                draft_seconds=draft_seconds,
            )  # fmt: skip
        else:
            controller.observe_round(
                TokenTree([1], [-1]), [0], None, asked=False, committed=1,
                forward_seconds=plain_seconds, round_seconds=plain_seconds,
            )  # fmt: skip
    return asked


def test_lucky_probes_of_a_losing_drafter_do_not_restart_the_back_off():
    """Lookahead at T=1 (issue #18): asked rounds cost 1.4 plain steps and commit one token, but one
    in nine commits three. Asking loses 13%, yet a 3-round probe that catches a 3-token round looks
    like a win; when a win restarted the back-off at one round, such a drafter was asked in about
    half of the rounds. A win halves it now, so the losses keep it backed off."""
    for seed in range(4):
        rng = random.Random(seed)
        controller = Controller(FLAT, carry_backoff=True)
        asked = sum(chance_rounds(controller, 3000, rng, 1 / 9, 2, forward_seconds=0.012, draft_seconds=0.002))
        assert asked / 3000 < 0.12, f"seed {seed}: asked in {asked / 3000:.0%} of the rounds"  # (restarting: 27%)


def asked_share(controller, rounds, asked_round_seconds, plain_seconds=0.010):
    """Rounds where asking gains nothing and costs ``asked_round_seconds``: the share that asked."""
    asked = 0
    for _ in range(rounds):
        if controller.wants_draft():
            asked += 1
            draft = chain_draft(4, 0.5)
            tree = TokenTree.from_draft(1, draft, keep=controller.plan(draft, 10).keep)
            controller.observe_round(
                tree, [0], draft, asked=True, committed=1, forward_seconds=plain_seconds,
                round_seconds=asked_round_seconds, draft_seconds=asked_round_seconds - plain_seconds,
            )  # fmt: skip
        else:
            controller.observe_round(
                TokenTree([1], [-1]), [0], None, asked=False, committed=1,
                forward_seconds=plain_seconds, round_seconds=plain_seconds,
            )  # fmt: skip
    return asked / rounds


def test_a_probe_that_loses_much_backs_off_past_the_usual_cap():
    # a lookahead window at T=1: asking costs two plain steps and gains nothing. One probe per 32
    # rounds would lose 3 of every 35 steps; the back-off grows until probing loses ~1.5% of them
    costly = asked_share(Controller(FLAT, max_backoff=32), 3000, asked_round_seconds=0.020)
    cheap = asked_share(Controller(FLAT, max_backoff=32), 3000, asked_round_seconds=0.0105)
    assert costly < 0.03  # ~3 asked per 200 rounds, after the ramp (it was 3 per 35)
    assert 3 / 35 * 0.8 < cheap < 0.12  # a cheap probe keeps the usual cap: one per 32 rounds


def test_a_probe_prunes_with_the_drafters_own_belief_not_the_whole_tree():
    steep = CostModel([(1, 0.010), (2, 0.011), (3, 0.012), (4, 0.020), (16, 0.160)])
    controller = Controller(steep)
    for _ in range(300):  # calibration: nodes scored 0.9 are never accepted
        controller.calibration.update(0.9, 1, accepted=False)
    draft = Draft(list(range(3, 15)), [-1] + list(range(11)), scores=[0.9] * 12)
    assert sum(controller.plan(draft, 20).keep) == 0  # not a probe: nothing pays
    controller.probing = True
    kept = sum(controller.plan(draft, 20).keep)
    assert 1 <= kept <= 3  # a probe: what the drafter's belief (0.9 a node) says pays, not all 12


def chain_and_phrase(chain=4, phrase=4):
    """A draft model's chain (scored 0.9, kept whole) with an unscored pool phrase below its end, as
    Ouroboros proposes."""
    tokens = list(range(3, 3 + chain + phrase))
    parents = [-1] + list(range(chain + phrase - 1))
    return Draft(tokens, parents, scores=[0.9] * chain + [None] * phrase,
                 sources=["draft_model"] * chain + ["phrases"] * phrase)  # fmt: skip


def phrase_rounds(controller, rounds, phrase_accepted):
    """Rounds of ``chain_and_phrase`` where the chain is always accepted and the phrase whole or not
    at all; returns (rounds that verified the phrase, rounds that explored)."""
    whole = frozenset({"draft_model"})
    verified = explored = 0
    for _ in range(rounds):
        if not controller.wants_draft():  # a plain round that measures a plain step
            controller.observe_round(
                TokenTree([1], [-1]), [0], None, asked=False, committed=1,
                forward_seconds=controller.cost(1), round_seconds=controller.cost(1),
            )  # fmt: skip
            continue
        draft = chain_and_phrase()
        plan = controller.plan(draft, 20, whole_sources=whole)
        tree = TokenTree.from_draft(1, draft, keep=plan.keep)
        verified += len(tree) > 5
        explored += plan.explored
        path = list(range(len(tree) if phrase_accepted else 5))
        seconds = controller.cost(len(tree))
        controller.observe_round(
            tree, path, draft, asked=True, committed=len(path), forward_seconds=seconds, round_seconds=seconds,
        )  # fmt: skip
    return verified, explored


# verifying the chain (5 nodes) costs 0.011 s, the chain and the phrase 0.014 s
PHRASE_COST = CostModel([(1, 0.010), (5, 0.011), (6, 0.0125), (9, 0.014)])


def test_nodes_pruning_would_always_drop_are_explored_on_a_budget():
    controller = Controller(PHRASE_COST)
    first = controller.plan(chain_and_phrase(), 20, whole_sources=frozenset({"draft_model"}))
    assert first.keep == [True] * 4 + [False] * 4  # before any evidence the phrase does not pay
    controller = Controller(PHRASE_COST)
    verified, explored = phrase_rounds(controller, 100, phrase_accepted=True)
    assert 1 <= explored <= 4  # the budget allows one whole tree per ~12 rounds, then it is known
    assert verified > 80  # once learnt (the target takes the phrase), pruning keeps it by itself
    assert not controller.plan(chain_and_phrase(), 20, whole_sources=frozenset({"draft_model"})).explored


def test_dear_drafting_makes_extra_nodes_a_smaller_share_of_the_round():
    # the same phrase costs 0.003 s more to verify: 27% of a round with no drafting time, 14% of one
    # that spent 0.011 s drafting; its ~0.75 expected tokens pay only in the second
    whole = frozenset({"draft_model"})
    cheap = Controller(PHRASE_COST).plan(chain_and_phrase(), 20, whole_sources=whole)
    dear = Controller(PHRASE_COST).plan(chain_and_phrase(), 20, whole_sources=whole, draft_seconds=0.011)
    assert sum(cheap.keep) == 4 and sum(dear.keep) > 4


def test_a_phrase_below_a_chain_is_calibrated_by_its_own_depth_whatever_the_chain_length():
    assert source_depths(chain_and_phrase(3, 4)) == [1, 2, 3, 1, 2, 3, 4]
    controller, rng = Controller(PHRASE_COST), random.Random(0)
    for _ in range(200):  # chains of 2..6 tokens; a phrase's first token is a guess, the rest a copy
        draft = chain_and_phrase(rng.randint(2, 6), 4)
        tree = TokenTree.from_draft(1, draft)
        chain = sum(1 for s in draft.sources if s == "draft_model")
        accepted = chain + (4 if rng.random() < 0.3 else 0)
        controller._calibrate(tree, list(range(accepted + 1)), draft)
    cal = controller.calibration
    assert cal.estimate(None, 1, "phrases") < 0.45 and cal.estimate(None, 2, "phrases") > 0.9


def test_exploring_stops_when_the_frontier_is_known_to_lose():
    controller = Controller(PHRASE_COST)
    verified, explored = phrase_rounds(controller, 600, phrase_accepted=False)
    # each exploring round is one sample of the phrase's first node (the nodes below it are learnt
    # of only once it is accepted): EXPLORE_EVIDENCE of them, then no more
    assert explored == verified and 6 <= explored <= 10
    extra = PHRASE_COST(9) - PHRASE_COST(5)
    assert explored * extra <= 0.02 * 600 * PHRASE_COST(5) + 4 * PHRASE_COST(1)  # within the budget


def test_a_round_that_explores_is_judged_as_its_plan_would_have_gone():
    """Exploring buys calibration out of its own budget. A round that verified a whole tree to
    explore is judged as the pruned plan would have gone, so the extra nodes' cost does not also
    back asking off: here the chain's rounds pay (2 tokens for 0.011 s against a 0.010 s plain
    step) and a phrase below the chain's end, never reached, is explored again and again (its
    first node is learnt of only when the chain's end is accepted) at 0.030 s a whole tree."""
    cost = CostModel([(1, 0.010), (5, 0.011), (9, 0.030)])
    controller = Controller(cost, explore_share=1.0)
    whole = frozenset({"draft_model"})
    asked = explored = 0
    for _ in range(300):
        if not controller.wants_draft():
            controller.observe_round(
                TokenTree([1], [-1]), [0], None, asked=False, committed=1,
                forward_seconds=cost(1), round_seconds=cost(1),
            )  # fmt: skip
            continue
        draft = chain_and_phrase()
        plan = controller.plan(draft, 20, whole_sources=whole)
        tree = TokenTree.from_draft(1, draft, keep=plan.keep)
        asked, explored = asked + 1, explored + plan.explored
        seconds = cost(len(tree))
        controller.observe_round(
            tree, [0, 1], draft, asked=True, committed=2, forward_seconds=seconds, round_seconds=seconds,
        )  # fmt: skip
    assert explored > 20  # it kept exploring
    assert asked > 290  # and kept asking (judged whole, the explored rounds backed it off: 29 of 300)


def test_sampled_requests_carry_the_back_off_over_and_greedy_ones_restart_it():
    for carry in (False, True):
        controller = Controller(FLAT, carry_backoff=carry)
        run_rounds(controller, 200, accepted_of=lambda i: 0)  # fully backed off
        controller.start()  # the next request
        assert controller.wants_draft() is not carry


def test_rounds_with_nothing_to_verify_count_neither_way():
    controller = Controller(FLAT)
    for _ in range(50):  # an n-gram drafter with no match: asked, proposes nothing, costs nothing
        assert controller.wants_draft()
        controller.observe_round(
            TokenTree([1], [-1]), [0], None, asked=True, committed=1,
            forward_seconds=0.010, round_seconds=0.0101, draft_seconds=0.00001,
        )  # fmt: skip
    assert controller.asked.tokens is None  # no verdict from rounds that verified nothing
    # an expensive drafter whose draft was all pruned did cost its drafting time: that counts
    for _ in range(3):
        controller.observe_round(
            TokenTree([1], [-1]), [0], None, asked=True, committed=1,
            forward_seconds=0.010, round_seconds=0.015, draft_seconds=0.005,
        )  # fmt: skip
    assert not controller.wants_draft()


def test_a_good_drafter_keeps_drafting_but_for_plain_rounds_that_measure_a_plain_step():
    controller = Controller(FLAT)
    asked = run_rounds(controller, 400, accepted_of=lambda i: 3)
    # one plain round after 16 drafting rounds, one after 64 more, then one per 256
    assert [i for i, a in enumerate(asked) if not a] == [16, 81, 338]
    assert controller.plain_round == pytest.approx(0.010)


def test_a_plain_step_dearer_by_the_cost_model_than_in_fact_is_found_out():
    """Issue #18: the cost model's t(1), measured once from a few forwards, read up to 1.2x what plain
    decoding cost, and a drafter that never lost a round was never backed off, so nothing measured a
    plain round: prompt lookup drafted a whole request at 0.92x plain. Here t(1) reads twice the
    truth (the other sizes right) and asking gives 1.3 tokens per 1.5 plain steps (0.87x plain,
    1.7x what the model says)."""
    controller = Controller(CostModel([(1, 0.020), (5, 0.0125), (64, 0.050)]))
    asked = chance_rounds(controller, 600, random.Random(0), 0.3, 1, forward_seconds=0.0125, draft_seconds=0.0025)
    assert all(asked[:16])  # the model's word is taken until a plain round is measured
    assert controller.plain_round == pytest.approx(0.010)
    assert sum(asked[-300:]) < 0.15 * 300  # then the drafter is backed off (probes only)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize(
    "method,params",
    [
        ("draft_model", {"num_speculative_tokens": 4}),
        ("anpd", {"tree": True}),
        ("prompt_lookup", {}),
        ("lookahead", {"window_size": 3, "ngram_size": 3}),
        ("ouroboros", {"num_speculative_tokens": 3, "window_size": 2, "ngram_size": 3}),
    ],
)
@pytest.mark.parametrize("cost", ["steep", "middle"])
def test_greedy_output_is_unchanged_with_the_controller(arch, method, params, cost):
    """Whatever the controller prunes or skips, the output is plain greedy decoding's."""
    model = tiny_model(arch)
    draft = perturbed_copy(model, scale=0.3)
    prompt = repetitive_prompt(24, 5, seed=2)
    reference = reference_greedy(model, prompt, 30)
    curve = {"steep": STEEP, "middle": CostModel([(1, 0.01), (4, 0.012), (16, 0.03)])}[cost]
    controller = Controller(CostModel(list(curve.points)))
    drafter = build_drafter(method, draft, VOCAB, target=model, **params)
    decided = 0
    for _ in range(2):  # a second request: what the controller learned carries over
        stats = Stats()
        runner = ModelRunner(model)
        steps = engine.run(runner, prompt, drafter, SamplingParams(), 30, frozenset(), None, stats, controller)
        assert [t for step in steps for t in step] == reference
        assert stats.rounds_drafted + stats.rounds_plain == stats.target_forwards
        decided += stats.nodes_pruned + stats.rounds_plain
    if cost == "steep":
        assert decided > 0  # it did cut drafts or skip drafting


def test_stats_report_what_the_controller_did():
    model = tiny_model("llama")
    prompt = repetitive_prompt(24, 5, seed=2)
    drafter = build_drafter("anpd", None, VOCAB, tree=True)
    stats = Stats()
    steps = engine.run(ModelRunner(model), prompt, drafter, SamplingParams(), 30, frozenset(), None, stats,
                       Controller(CostModel([(1, 0.01), (64, 0.011)])))  # fmt: skip
    out = [t for step in steps for t in step]
    assert out == reference_greedy(model, prompt, 30)
    assert stats.rounds_drafted > 0 and stats.predicted_tokens_per_second > 0
    assert stats.drafted_tokens_per_second > 0 and stats.time_control > 0
    d = stats.to_dict()
    assert {"rounds_drafted", "rounds_plain", "nodes_pruned", "predicted_tokens_per_second"} <= set(d)


def test_the_controller_off_is_the_method_as_published():
    """No controller: the drafter's proposals are verified whole (the stats of today's engine)."""
    model = tiny_model("llama")
    prompt = repetitive_prompt(24, 5, seed=2)
    _, off = generate_ids(model, prompt, build_drafter("anpd", None, VOCAB, tree=True), 30)
    assert off.rounds_drafted == off.rounds_plain == off.nodes_pruned == 0


def test_sampled_drafts_pruned_by_the_controller_stay_exact():
    """Sampling with pruning (a steep curve prunes sampled chains part way): the first two tokens
    follow the warped target (chi-square), as without the controller."""
    from speculum.sampling import warp

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
    controller = Controller(CostModel([(1, 0.010), (2, 0.012), (3, 0.030), (8, 0.08)]))
    drafter = build_drafter("draft_model", draft, 16, length_policy="fixed", num_speculative_tokens=4)
    gen = torch.Generator(model.device).manual_seed(3)
    counts = dict.fromkeys(exact, 0)
    trials, pruned = 1500, 0
    for _ in range(trials):
        stats = Stats()
        steps = engine.run(ModelRunner(model), prompt, drafter, sampling, 2, frozenset(), gen, stats, controller)
        counts[tuple(t for step in steps for t in step)] += 1
        pruned += stats.nodes_pruned
    assert pruned > 0  # the controller did prune sampled drafts
    assert fit_pvalue(counts, exact, trials) > 1e-3


def test_with_sampled_nodes_a_node_is_kept_on_what_was_known_before_it_was_sampled():
    """Under sampling, keeping a node may not depend on its own token or on samples drawn after it:
    that would bias the output as the oracle's stop would. A sampled node's score depends on the
    distribution it was drawn from, not on its token; so a descendant's score, which does depend on
    the node's token, must leave the node's decision unchanged."""
    q = torch.full((VOCAB,), 1.0 / VOCAB)
    cost = [(1, 0.010), (2, 0.011), (3, 0.020), (8, 0.07)]

    def keep_first(second_score):
        controller = Controller(CostModel(list(cost)))  # the same past for every draft compared
        return controller.plan(Draft([5, 6], [-1, 0], [q, q], [0.6, second_score]), 10).keep[0]

    assert keep_first(0.01) == keep_first(0.5) == keep_first(0.99)
    # the rule for deterministic drafts, by contrast, keeps a node for what its descendants promise
    steep = [(1, 0.010), (2, 0.018), (3, 0.019)]
    promising = Controller(CostModel(list(steep))).plan(Draft([5, 6], [-1, 0], scores=[0.55, 0.99]), 10).keep
    hopeless = Controller(CostModel(list(steep))).plan(Draft([5, 6], [-1, 0], scores=[0.55, 0.01]), 10).keep
    assert promising[0] and not hopeless[0]


def test_measured_cost_model_is_cached_per_setting_and_remeasured_when_unreadable(_cost_cache):
    from speculum.costs import machine_key, measured_cost_model

    model = tiny_model("llama")  # a vocabulary far smaller than the default probe context's ids
    runner = ModelRunner(model)
    measured = measured_cost_model(runner)
    assert [n for n, _ in measured.points][:3] == [1, 2, 4] and all(t > 0 for _, t in measured.points)
    path = _cost_cache / f"{machine_key(runner)}.json"
    assert path.exists()
    assert measured_cost_model(runner).points == measured.points  # read back, not measured again
    path.write_text("{not json")
    again = measured_cost_model(runner)  # an unreadable file is measured again, never an error
    assert len(again.points) == len(measured.points)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if threads != 1 else 2)
        assert machine_key(runner) != path.stem  # another thread count never reuses the curve
    finally:
        torch.set_num_threads(threads)
    assert machine_key(ModelRunner(tiny_model("llama").to(torch.float64))) != path.stem  # nor another dtype


def test_a_slow_phase_of_the_machine_does_not_land_on_one_size_when_measuring(monkeypatch):
    """CPUs have slow phases of seconds (bfloat16 on AVX-512-bf16, another process). Timed a size at a
    time, a phase covered one size's every forward and read t(1) 1.2x too dear (issue #18); timed
    interleaved, a phase as long as two passes over the sizes is one sample of each size's five.
    (A clock of the test's own: the real one, on a loaded machine, is the noise under test.)"""
    from types import SimpleNamespace

    from speculum import costs

    runner = ModelRunner(tiny_model("llama"))
    forward, calls, now = runner.forward, [0], [0.0]

    def slow_at_first(cache, tree):
        calls[0] += 1
        now[0] += 0.030 if calls[0] <= 2 * len(costs.SIZES) else 0.001
        return forward(cache, tree)

    runner.forward = slow_at_first
    monkeypatch.setattr(costs, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    measured = CostModel.measure(runner, list(range(3, 40)))
    assert [t for _, t in measured.points] == pytest.approx([0.001] * len(costs.SIZES)), measured.points


def test_cost_model_observes_forwards_per_size_bucket():
    cost = CostModel([(1, 0.010), (8, 0.020)])
    for _ in range(50):
        cost.observe(2, 0.022)  # this machine got slower for small trees
    assert cost(2) == pytest.approx(0.022, rel=0.05)
    # size 1 was never observed: it takes the nearest observed bucket's factor (load moves sizes together)
    assert cost(1) == pytest.approx(0.010 * cost(2) / cost.base(2))
    cost.observe(1, 0.010)
    assert cost(1) < 0.019 and cost(2) == pytest.approx(0.022, rel=0.05)  # each bucket keeps its own
    restored = CostModel.from_dict(cost.to_dict())
    assert restored.points == cost.points


def test_one_slow_first_forward_does_not_make_plain_steps_look_dear():
    # the first forward after a prefill took 1.75 times its measured cost (cold): taken whole, it
    # made t(1) (which borrows the nearest bucket's factor) 75% dearer, and the controller judged
    # drafting against a plain step that expensive for ~20 forwards
    cost = CostModel([(1, 0.150), (2, 0.150), (8, 0.190)])
    cost.observe(2, 0.264)
    assert cost.plain_step < 0.150 * 1.1
    for _ in range(10):
        cost.observe(2, 0.150)
    assert cost.plain_step == pytest.approx(0.150, rel=0.05)
    controller = Controller(cost)
    assert controller.plain_rate() == pytest.approx(1 / 0.150, rel=0.05)


def test_a_slow_sample_never_makes_a_smaller_forward_dearer_than_a_bigger_one():
    # measured on a busy machine: t(4) caught a moment when another process had the core
    cost = CostModel([(1, 0.042), (2, 0.053), (4, 0.086), (8, 0.052), (16, 0.106)])
    assert [t for _, t in cost.points] == [0.042, 0.052, 0.052, 0.052, 0.106]
    assert all(cost(n) <= cost(n + 1) for n in range(1, 20))
    draft = chain_draft(6, 0.9)
    assert sum(Controller(cost).plan(draft, 10).keep) >= 4  # 4-7 nodes cost what 2 do: keep them


def test_one_token_keeps_its_measured_cost_even_above_two():
    # bfloat16 on an AVX-512-bf16 CPU: the one-token forward (matrix-vector kernels) is really dearer
    cost = CostModel([(1, 0.157), (2, 0.132), (4, 0.134), (8, 0.154), (16, 0.184)])
    assert cost.plain_step == 0.157 and cost(2) == 0.132
    assert all(cost(n) <= cost(n + 1) for n in range(2, 20))


def test_on_by_default_but_off_for_the_published_settings():
    from speculum.methods import SpeculativeConfig

    assert SpeculativeConfig("anpd").controlled()
    assert not SpeculativeConfig("anpd", preset="paper").controlled()
    assert not SpeculativeConfig("anpd", controller=False).controlled()
    assert not SpeculativeConfig("autoregressive", controller=True).controlled()
    assert SpeculativeConfig("auto").controlled()
    assert SpeculativeConfig("draft_model").controlled() and SpeculativeConfig("ouroboros").controlled()
    assert not SpeculativeConfig("draft_model", preset="paper").controlled()


def test_a_seed_gives_the_same_sampled_text_again():
    import speculum

    from tiny_models import word_tokenizer

    target = tiny_model("llama")
    spec = speculum.Speculum(target, word_tokenizer(), perturbed_copy(target), word_tokenizer())
    prompt = " ".join(f"w{t}" for t in repetitive_prompt(20, 5, seed=4))
    runs = [spec.generate(prompt, "anpd", max_new_tokens=30, temperature=0.9, seed=7) for _ in range(2)]
    assert runs[0].token_ids == runs[1].token_ids
    assert runs[0].stats.rounds_drafted > 0  # the controller ran (and decided on measured times)
    # plain sampling with this seed gives that text too: it does not depend on what was drafted
    plain = spec.generate(prompt, "autoregressive", max_new_tokens=30, temperature=0.9, seed=7)
    assert plain.token_ids == runs[0].token_ids
    assert spec.generate(prompt, "anpd", max_new_tokens=30, temperature=0.9, seed=8).token_ids != plain.token_ids
    assert spec.generate(prompt, max_new_tokens=4).method == "auto"  # the default method


def test_a_catch_up_forward_is_charged_beyond_a_one_token_step():
    """A draft forward that feeds committed text (a prompt, the tokens of plain rounds) is charged
    to catching up beyond what a one-token forward at that batch size costs; before one was timed,
    by the share of the tokens fed; in a batch, by each row's backlog."""
    from types import SimpleNamespace

    from speculum.drafters.draft_model import CatchUpClock

    clock = CatchUpClock()
    row = SimpleNamespace(catch_up_seconds=0.0)
    clock.charge([row], [11], 1.1)  # no one-token forward timed yet: 10 of the 11 tokens fed
    assert row.catch_up_seconds == pytest.approx(1.0)
    clock.charge([row], [1], 0.1)  # a one-token forward: timed, nothing charged
    assert row.catch_up_seconds == pytest.approx(1.0) and clock.step[1] == pytest.approx(0.1)
    row.catch_up_seconds = 0.0
    clock.charge([row], [21], 0.5)
    assert row.catch_up_seconds == pytest.approx(0.4)
    row.catch_up_seconds = 0.0
    clock.charge([row], [3], 0.09)  # faster than a step (noise): nothing, never a negative charge
    assert row.catch_up_seconds == 0.0
    a, b, c = (SimpleNamespace(catch_up_seconds=0.0) for _ in range(3))
    clock.charge([a, b, c], [1, 1, 1], 0.2)  # batches of 3 rows have their own step
    clock.charge([a, b, c], [1, 3, 5], 0.8)  # 0.6 beyond it: 2 of the backlog's tokens are b's, 4 c's
    assert (a.catch_up_seconds, b.catch_up_seconds, c.catch_up_seconds) == pytest.approx((0.0, 0.2, 0.4))


def test_the_controller_judges_a_round_without_the_drafters_catching_up():
    """A draft model's prefill of the prompt is paid once for the text: the round it falls in is
    judged (the controller's goodput, the stats' drafted-round time) without it, and the stats
    keep it in the draft time (issue #18: charged to one round, it made a 0.5B draft look like a
    loss on short requests)."""
    model = tiny_model("llama")
    drafter = build_drafter("draft_model", perturbed_copy(model, scale=0.1), VOCAB, num_speculative_tokens=3)
    slow_catch_up(drafter, 0.3)  # slow enough to see
    controller = Controller(FLAT)
    stats = Stats()
    prompt = repetitive_prompt(24, 5, seed=3)
    steps = engine.run(ModelRunner(model), prompt, drafter, SamplingParams(), 20, frozenset(), None, stats, controller)
    assert [t for step in steps for t in step] == reference_greedy(model, prompt, 20)
    assert stats.time_draft_catch_up >= 0.3  # the prompt's prefill, at least
    assert stats.time_draft >= stats.time_draft_catch_up
    assert stats.drafted_round_time <= stats.wall_time - 0.3  # the rounds as judged: without it


def test_a_catch_up_asking_would_not_win_back_is_skipped():
    """A request's first draft pays a catch-up (a draft model's prefill): the controller asks only
    when what asking saves per token, over the tokens the request likely has left, pays for it."""
    controller = Controller(FLAT, carry_backoff=True)
    # asking gives 1.25 tokens per 0.011 s against a plain step's 0.010 s: it saves ~1.2 ms a token
    run_rounds(controller, 40, accepted_of=lambda i: 1 if i % 4 == 0 else 0, drafted=1, seconds=0.010,
               draft_seconds=0.001)  # fmt: skip
    assert controller.asked_long.rate > controller.plain_rate()  # the catch-up rule's memory
    saving = 1 / controller.plain_rate() - 1 / controller.asked_long.rate
    controller.start()
    # nothing known of request lengths yet: the tokens left decide
    assert controller.wants_draft(catch_up=0.9 * saving * 100, tokens_left=100)
    controller.start()
    assert not controller.wants_draft(catch_up=1.1 * saving * 100, tokens_left=100)
    assert controller.wants_draft(catch_up=0.0, tokens_left=100)  # nothing to catch up: as before
    for _ in range(3):
        controller.finish(10)  # short requests
    controller.start()
    assert controller.typical_length < 20
    assert not controller.wants_draft(catch_up=0.9 * saving * 100, tokens_left=100)
    assert controller.wants_draft(catch_up=0.9 * saving * 10, tokens_left=100)


def test_a_catch_up_is_judged_on_more_rounds_than_the_last_losing_window():
    """The controller stops asking right after a window of rounds that lost; the catch-up rule
    weighs a longer memory, so a drafter that paid over many rounds still starts the next request
    (reading that window, a 0.5B draft sat out whole requests at T=1, issue #18)."""
    controller = Controller(FLAT, carry_backoff=True)
    run_rounds(controller, 40, accepted_of=lambda i: 1, drafted=1, seconds=0.010, draft_seconds=0.001)
    for _ in range(100):  # a bad patch: nothing accepted, until the controller stops asking
        if not run_rounds(controller, 1, accepted_of=lambda i: 0, drafted=1, seconds=0.010, draft_seconds=0.004)[0]:
            break  # it stopped (a back-off of plain rounds)
    assert controller.asked.rate < controller.plain_rate() * (1 + controller.margin)  # the window it stopped on
    assert controller.asked_long.rate > controller.plain_rate()
    controller.start()
    # the long memory saves ~3.6 ms a token, 0.36 s over 100 tokens; the last window ~0.1 ms, 0.01 s
    assert controller.wants_draft(catch_up=0.05, tokens_left=100)


def test_requests_that_skip_the_catch_up_probe_again_by_the_tokens_decoded_without():
    """What asking saves rests on rounds that may be stale: once the tokens decoded without drafting
    since it last ran are worth CATCH_UP_PROBE_SHARE of a probe (the catch-up and a plain step),
    asking is tried again; long requests (a switch to code after chat) probe sooner than short
    ones, within the request when it runs long enough."""
    from speculum.controller import CATCH_UP_PROBE_SHARE, CatchUpRule

    rule = CatchUpRule()
    step, catch_up, saving = 0.1, 0.3, -0.01  # drafting lost; a probe costs 4 plain steps
    due = round(4 / CATCH_UP_PROBE_SHARE)  # tokens decoded without it that make a probe worth it

    def requests(count, length):
        asked = []
        for _ in range(count):
            rule.start()
            asked.append(rule.pays(catch_up, saving, generated=0, tokens_left=length, step_seconds=step))
            if asked[-1]:
                rule.used(generated=length)  # it drafted to the end
            rule.finish(length)
        return asked

    short = due // 4 + 1  # the fifth request finds 4 short ones decoded without
    assert requests(10, short) == [False, False, False, False, True] * 2
    assert requests(3, due) == [False, True, False]  # long requests: every other one
    # within a request: no probe at its start, one once it has run long enough without
    rule = CatchUpRule()
    rule.start()
    assert not rule.pays(catch_up, saving, generated=0, tokens_left=4 * due, step_seconds=step)
    assert rule.pays(catch_up, saving, generated=due, tokens_left=3 * due, step_seconds=step)
    # a request that drafted, then stopped (its backlog to catch up): the tokens since it last ran
    # count, and the probe round is the back-off's, so only the catch-up weighs
    rule.used(generated=due)
    within = round(catch_up / step / CATCH_UP_PROBE_SHARE)  # 3 plain steps of catch-up: 150 tokens
    assert within < due
    assert not rule.pays(catch_up, saving, generated=due + within - 1, tokens_left=2 * due, step_seconds=step)
    assert rule.pays(catch_up, saving, generated=due + within, tokens_left=2 * due, step_seconds=step)
    # a backlog that grows at under the share of a plain step per token is always let through
    for without in (1, 10, 100):
        assert rule.pays(0.01 * step * without, saving, due + without, 2 * due, step)
        assert not rule.pays(0.03 * step * without, saving, due + without, 2 * due, step)
    rule.finish(2 * due + 10)  # they carry to the next request
    rule.start()
    assert rule.decoded_without(0) == due + 10
    # unknown saving, or a saving that pays: asked at once
    assert rule.pays(catch_up, None, generated=0, tokens_left=10, step_seconds=step)
    assert rule.pays(catch_up, 0.1, generated=0, tokens_left=10, step_seconds=step)


def test_a_long_request_among_short_ones_expects_to_run_on():
    """The tokens a request likely has left: what is left of the typical length, and for one past
    half of it, about as many as it has already run (capped by the tokens it may still give)."""
    from speculum.controller import CatchUpRule

    rule = CatchUpRule()
    assert rule.likely_left(0, 100) == 100  # nothing known of request lengths
    rule.finish(20)
    assert rule.likely_left(0, 100) == 20
    assert rule.likely_left(5, 100) == 15
    assert rule.likely_left(10, 100) == 10
    assert rule.likely_left(40, 100) == 40
    assert rule.likely_left(40, 30) == 30
    assert not rule.pays(1.0, saving=0.02, generated=5, tokens_left=100, step_seconds=0.1)  # 15 left: 0.3 s
    assert rule.pays(1.0, saving=0.02, generated=60, tokens_left=100, step_seconds=0.1)  # 60 more likely: 1.2 s


def test_a_draft_model_learns_what_catching_up_costs_per_token():
    from types import SimpleNamespace

    from speculum.drafters.draft_model import CatchUpClock

    clock = CatchUpClock()
    assert clock.estimate(100) == 0.0  # nothing timed yet: not known
    row = SimpleNamespace(catch_up_seconds=0.0)
    clock.charge([row], [1], 0.05)
    clock.charge([row], [3], 0.06)  # a short catch-up says little of the rate: not learnt from
    assert clock.estimate(100) == 0.0
    clock.charge([row], [41], 0.25)  # a prompt's prefill: 0.2 s beyond a step for 40 tokens
    assert clock.estimate(100) == pytest.approx(0.5)


def test_a_short_request_skips_a_draft_model_whose_prefill_would_not_pay():
    """End to end: after long requests taught the controller what drafting saves and short ones how
    long requests run, a request whose draft prefill costs more than drafting would save takes
    plain steps only (its output unchanged), while a long one still drafts."""
    model = tiny_model("llama")
    # (chains of a fixed length: the chain stop, timed on a busy machine, can leave the goodput
    # between verdicts when the long request ends, and an unjudged goodput lets a probe through)
    drafter = build_drafter("draft_model", perturbed_copy(model, scale=0.1), VOCAB, num_speculative_tokens=3,
                            chain_stop=False)  # fmt: skip
    controller = Controller(FLAT)
    runner = ModelRunner(model)
    prompt = repetitive_prompt(24, 5, seed=3)

    def request(max_new_tokens):
        stats = Stats()
        steps = engine.run(runner, prompt, drafter, SamplingParams(), max_new_tokens, frozenset(), None, stats,
                           controller)  # fmt: skip
        assert [t for step in steps for t in step] == reference_greedy(model, prompt, max_new_tokens)
        return stats

    assert request(40).rounds_drafted > 0
    assert controller.asked.rate is not None
    drafter.catch_up_estimate = lambda ctx: 1e3  # a prefill nothing could win back
    stats = request(8)
    assert stats.rounds_drafted == 0 and stats.rounds_plain > 0
    drafter.catch_up_estimate = lambda ctx: 0.0
    assert request(8).rounds_drafted > 0


class _FixedClock:
    """A draft model's clock that says every draft forward costs ``step`` seconds (so a test decides
    what drafting costs, not the machine)."""

    def __init__(self, step: float):
        self.step = {1: step}

    def charge(self, drafters, fed, seconds) -> None:
        pass

    def estimate(self, backlog: int) -> float:
        return 0.0


class _RandomClock(_FixedClock):
    """A clock whose draft forward costs one of ``steps`` each time it is read, at random."""

    def __init__(self, steps, seed: int):
        self._steps, self._random = steps, random.Random(seed)

    @property
    def step(self) -> dict:
        return {1: self._random.choice(self._steps)}


def _chain_length_before_stop(controller, scores, step_seconds):
    stop = controller.chain_stop()
    for n, score in enumerate(scores, start=1):
        stop.add(score)
        if not stop.worth_another(step_seconds):
            return n
    return len(scores)


def test_a_chain_stops_where_one_more_draft_forward_does_not_pay():
    """ChainStop: a confident chain the target takes is drafted on; one whose confident tokens the
    target rejects (calibration learns it) stops early; dearer draft forwards stop it sooner."""
    cost = CostModel([(1, 0.010), (8, 0.011), (32, 0.016)])
    believed = Controller(CostModel(list(cost.points)))
    sure = [0.95] * 12
    assert _chain_length_before_stop(believed, sure, 0.001) == 12  # cheap steps, believed: all of it
    assert _chain_length_before_stop(believed, sure, 0.004) < 12  # a 40% step: reach falls below it
    wrong = Controller(CostModel(list(cost.points)))
    for _ in range(60):  # the draft is sure of itself and the target disagrees
        for depth in (1, 2, 3):
            wrong.calibration.update(0.95, depth, depth == 1, "draft_model")
    assert _chain_length_before_stop(wrong, sure, 0.001) <= 2
    # the first node is always drafted; a step not timed yet never stops a chain
    assert _chain_length_before_stop(wrong, sure, None) == 12


def test_chain_stop_is_a_flag_of_the_chain_drafters():
    model = tiny_model("llama")
    for method in ("draft_model", "ouroboros"):
        assert build_drafter(method, model, VOCAB).options.chain_stop  # on by default (under a controller)
        with pytest.raises(InvalidInputError, match="chain_stop"):
            build_drafter(method, model, VOCAB, chain_stop="yes")


def test_the_chain_stop_ends_bad_drafts_early_and_keeps_the_output():
    """A draft model the target disagrees with, drafting 8 tokens a round: under the controller its
    chains end where one more draft forward does not pay (greedy output unchanged); with
    ``chain_stop=False`` the length policy alone decides."""
    model = tiny_model("llama")
    draft = perturbed_copy(model, scale=2.0)
    prompt = repetitive_prompt(24, 5, seed=2)
    reference = reference_greedy(model, prompt, 30)
    results = {}
    for chain_stop in (True, False):
        drafter = build_drafter("draft_model", draft, VOCAB, length_policy="fixed", num_speculative_tokens=8,
                                chain_stop=chain_stop)  # fmt: skip
        drafter.clock = _FixedClock(0.004)
        controller = Controller(CostModel([(1, 0.010), (16, 0.011)]), max_backoff=1)
        stats = Stats()
        steps = engine.run(ModelRunner(model), prompt, drafter, SamplingParams(), 30, frozenset(), None, stats,
                           controller)  # fmt: skip
        assert [t for step in steps for t in step] == reference
        results[chain_stop] = stats
    assert results[True].chains_stopped > 0 and results[False].chains_stopped == 0
    drafted = {k: s.draft_forwards / max(s.rounds_drafted, 1) for k, s in results.items()}
    assert drafted[True] < drafted[False]


def test_sampled_chains_the_controller_stops_stay_exact():
    """A sampled chain ends where the controller's stop says, after a token and on what was drafted
    up to it (a stopping time): the first three tokens still follow the warped target (chi-square)."""
    from speculum.sampling import warp

    model = tiny_model("llama", vocab_size=16)
    draft = perturbed_copy(model, scale=0.3)
    prompt = [3, 4, 5, 3, 4, 5, 3, 4]
    sampling = SamplingParams(temperature=1.0, top_k=3)

    def dist(ids):
        with torch.no_grad():
            return warp(model(torch.tensor([ids], device=model.device)).logits[0, -1], sampling)[0]

    exact = {}
    p1 = dist(prompt)
    for a in torch.nonzero(p1 > 0).flatten().tolist():
        p2 = dist(prompt + [a])
        for b in torch.nonzero(p2 > 0).flatten().tolist():
            p3 = dist(prompt + [a, b])
            for c in torch.nonzero(p3 > 0).flatten().tolist():
                exact[(a, b, c)] = p1[a].item() * p2[b].item() * p3[c].item()
    # the cost model kept as given (the machine's timings do not move it, below), and draft forwards
    # that cost next to nothing or five plain steps at random (independent of the tokens): some chains
    # are stopped, others go on, whatever this machine's speed
    controller = Controller(CostModel([(1, 0.010), (8, 0.011)], 0.0), carry_backoff=True)
    # the curve would rescale itself to forwards that keep landing 3x off it (a tiny model's take
    # 0.3-2 ms by the host), and the plain step would be measured: on a fast host the cheap draft
    # forward then cost a plain step or more and no chain went on. Neither listens to the clock here
    controller.cost.observe = lambda n, seconds: None
    controller._measure_plain = lambda seconds, forward_seconds: None
    drafter = build_drafter("draft_model", draft, 16, length_policy="fixed", num_speculative_tokens=4)
    drafter.clock = _RandomClock([0.0005, 0.05], seed=0)
    gen = torch.Generator(model.device).manual_seed(5)
    counts = dict.fromkeys(exact, 0)
    trials, stopped, deep = 2000, 0, 0
    for _ in range(trials):
        stats = Stats()
        steps = engine.run(ModelRunner(model), prompt, drafter, sampling, 3, frozenset(), gen, stats, controller)
        counts[tuple(t for step in steps for t in step)] += 1
        stopped += stats.chains_stopped
        deep += stats.drafted_per_position[1] if len(stats.drafted_per_position) > 1 else 0
    assert stopped > 0 and deep > 0  # chains were stopped, and others went on
    assert fit_pvalue(counts, exact, trials) > 1e-3


def test_a_curve_measured_on_a_busy_machine_is_rescaled_within_a_few_forwards(tmp_path):
    """Issue #18: a cost file measured while another process held both cores read Gemma 3 270M's
    t(1) at 1.5 s where forwards took 0.08-0.1 s; the smoothed correction needed ~30 forwards to
    get there, and the controller drafted a whole request against a plain step 15x too dear
    (predicted 4.7 tokens/s, realised 14). Three forwards grossly off rescale the whole curve,
    and the stale file goes, so the next load measures again."""
    import json

    stale = tmp_path / "stale.json"
    true = CostModel([(1, 0.080), (4, 0.100), (16, 0.160)])
    cost = CostModel([(n, 15 * t) for n, t in true.points])
    stale.write_text(json.dumps(cost.to_dict()))
    cost.path = stale
    for n in (1, 4, 1):
        cost.observe(n, true(n))
    assert all(cost(n) == pytest.approx(true(n), rel=0.05) for n in (1, 2, 4, 8, 16, 32))  # shape kept
    assert not stale.exists()
    assert Controller(cost).plain_rate() == pytest.approx(1 / 0.080, rel=0.1)


def test_slow_phases_and_mixed_outliers_do_not_rescale_the_curve(tmp_path):
    kept = tmp_path / "kept.json"
    kept.write_text("{}")
    cost = CostModel([(1, 0.080), (4, 0.100), (16, 0.160)], path=kept)
    for seconds in (0.160, 0.150, 0.170, 0.160):  # a busy phase: twice as slow, the correction's job
        cost.observe(1, seconds)
    assert cost.points[0] == (1, 0.080)
    for seconds in (0.5, 0.02, 0.5, 0.02):  # gross both ways, never three the same way in a row
        cost.observe(4, seconds)
    assert cost.points[1] == (4, 0.100)
    for _ in range(3):  # five times as slow for good (another process now): rescaled, the file kept
        cost.observe(1, 0.400)
    assert cost(1) == pytest.approx(0.400, rel=0.05) and kept.exists()
    for _ in range(3):  # the other process ended: back to the file's own curve, which stays
        cost.observe(1, 0.080)
    assert cost(1) == pytest.approx(0.080, rel=0.05) and kept.exists()


def test_the_prediction_covers_the_rounds_it_is_compared_with():
    """The stats set predicted beside realised tokens per second over the rounds that asked the
    drafter. A round that asked and got no proposal counted in the realised figure only, and the
    prediction left out the round's bookkeeping: Gemma's README command read 4.7 predicted against
    14 realised. Here a drafter that never proposes: every asked round is a plain step's worth."""
    model = tiny_model("llama")
    prompt = list(range(3, 40))

    class Silent(RandomTreeDrafter):
        def propose(self, ctx):
            return None

    stats = Stats()
    cost = CostModel([(1, 0.01), (64, 0.011)])
    steps = engine.run(ModelRunner(model), prompt, Silent([], VOCAB), SamplingParams(),
                       12, frozenset(), None, stats, Controller(cost))  # fmt: skip
    assert [t for step in steps for t in step] == reference_greedy(model, prompt, 12)
    assert stats.rounds_drafted > 0 and stats.drafted_tokens == 0
    assert stats.predicted_tokens == pytest.approx(stats.drafted_round_tokens)
    assert stats.predicted_time > 0


def pruned_rounds(controller, rounds, plain_seconds):
    """Rounds whose proposals cost half a plain step (0.005 s) and are all pruned (a one-token
    forward of 0.010 s, the round ``plain_seconds`` besides the drafting); whether each was asked."""
    asked = []
    for _ in range(rounds):
        asked.append(controller.wants_draft())
        draft_seconds = 0.005 if asked[-1] else 0.0
        controller.observe_round(
            TokenTree([1], [-1]), [0], None, asked=asked[-1], committed=1,
            forward_seconds=0.010, round_seconds=plain_seconds + draft_seconds, draft_seconds=draft_seconds,
        )  # fmt: skip
    return asked


def test_an_over_high_plain_step_is_found_out_by_rounds_that_verify_nothing():
    """Issue #18: `ctc` was asked in every round of three requests while its trees were pruned to
    nothing, at ~10 ms of proposal a round. A round that verifies nothing and drafts for under 5%
    of a plain step counts neither way; judged against a plain step measured while the host was
    busy (here 20x the truth), every such round was "negligible", none counted towards the
    periodic plain round, and the over-high plain step was never measured again. A round that
    verifies nothing is a one-token forward: less its drafting, it measures a plain step."""

    def asked_rounds(first_plain_seconds):
        controller = Controller(FLAT)
        controller.observe_round(
            TokenTree([1], [-1]), [0], None, asked=False, committed=1,
            forward_seconds=first_plain_seconds, round_seconds=first_plain_seconds,
        )  # fmt: skip
        return controller, pruned_rounds(controller, 100, plain_seconds=0.0101)

    measured_busy, asked_busy = asked_rounds(0.2)  # a plain round while another tenant held the cores
    _, asked_right = asked_rounds(0.0101)
    assert measured_busy.plain_round == pytest.approx(0.0101, rel=0.01)
    assert sum(asked_right) <= 25  # a losing drafter: probes only
    assert sum(asked_busy) <= sum(asked_right) + 10  # a few rounds more to find the plain step out


def test_costly_parts_that_lose_do_not_back_the_cheap_ones_off():
    """Issue #18: `auto` on Gemma at T=1 took plain steps in 77% of GSM8K's rounds where `anpd`
    alone took 2%: its heads' rounds lost, and the controller backed the whole composition off,
    the n-gram drafters with them, before the heads' own gate could stop the heads. A round says
    what it would have given lean (without the gated parts); asking is judged by the better."""

    def asked_rounds(report_lean, cheap_every=1, cheap_tokens=1.4):
        controller, asked = Controller(FLAT), []
        controller.observe_round(
            TokenTree([1], [-1]), [0], None, asked=False, committed=1, forward_seconds=0.010, round_seconds=0.010
        )  # fmt: skip
        for _ in range(200):
            asked.append(controller.wants_draft())
            if not asked[-1]:
                controller.observe_round(
                    TokenTree([1], [-1]), [0], None, asked=False, committed=1,
                    forward_seconds=0.010, round_seconds=0.010,
                )  # fmt: skip
                continue
            draft = chain_draft(4, 0.5)
            tree = TokenTree.from_draft(1, draft)
            # with the heads: 1.5 tokens for 0.020 s (0.75x plain); lean: what the cheap drafters gave
            lean = (cheap_tokens, 0.0105, 2) if len(asked) % cheap_every == 0 else (1, 0.0101, 0)
            controller.observe_round(
                tree, [0, 1], draft, asked=True, committed=2 if len(asked) % 2 else 1,
                forward_seconds=0.012, round_seconds=0.020, draft_seconds=0.008,
                lean=lean if report_lean else None,
            )  # fmt: skip
        return asked

    assert sum(asked_rounds(report_lean=False)[-100:]) < 25  # backed off: probes only
    assert sum(asked_rounds(report_lean=True)[-100:]) > 90  # the lean rounds pay: asking goes on
    # the cheap drafters propose in one round of five (1.14x plain there): the other four, lean, are
    # plain rounds in all but name, no evidence either way (counted, they would bring the lean rounds
    # down to 1.02x plain, under the margin)
    assert sum(asked_rounds(report_lean=True, cheap_every=5, cheap_tokens=1.2)[-100:]) > 90


def test_a_drafter_without_gated_parts_is_judged_on_every_round_it_paid_for():
    """Only ``auto`` reports lean rounds. For any other drafter the lean rounds are its rounds, all
    of them: an expensive proposal pruned to nothing must count against asking (here after a run of
    paying rounds), not be skipped as a lean round that verifies nothing."""
    controller = Controller(FLAT)
    run_rounds(controller, 10, accepted_of=lambda i: 3)  # drafting paid
    asked = pruned_rounds(controller, 40, plain_seconds=0.010)  # then every proposal is all pruned
    assert sum(asked[-20:]) <= 8  # backed off: probes only (it asked in every round while skipped)


def test_rows_of_a_batch_keep_their_own_catch_up_state():
    """Each row of a batch (``for_row``) has its own request in flight: one row's start or finish
    must not reset when another last ran its drafter, while request lengths are learned together."""
    config = Controller(FLAT)
    first, second = config.for_row(), config.for_row()
    first.start()
    second.start()
    assert first.wants_draft(tokens_left=100, generated=30)  # the first row's drafter runs 30 tokens in
    second.start()  # another row (re)starts
    assert first.catch_up_rule.decoded_without(40) == 10  # still 10 tokens since it last ran
    second.finish(12)
    assert first.catch_up_rule.decoded_without(40) == 10
    assert first.typical_length == second.typical_length == config.typical_length == 12.0
