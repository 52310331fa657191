"""SpecDec++: the acceptance head, its checkpoints, the stop rule and the oracle policy."""

import json

import pytest
import torch

from speculum.errors import CheckpointError, InvalidInputError
from speculum.heads.acceptance import WEIGHTS, AcceptanceHead, draft_fingerprint, draft_hidden_size
from speculum.policies import DraftStep, OracleStop, SpecDecPPStop, make_policy

from helpers import build_drafter
from tiny_models import VOCAB, perturbed_copy, tiny_model


@pytest.fixture(scope="module")
def draft():
    return perturbed_copy(tiny_model("llama"), scale=0.4)


def test_head_shapes_and_independent_blocks():
    head = AcceptanceHead(16, depth=3)
    assert head(torch.randn(5, 16)).shape == (5,)
    assert head(torch.randn(16)).shape == ()
    assert 0.0 < float(head.accept_probability(torch.randn(16))) < 1.0
    weights = [b.linear.weight for b in head.blocks]
    assert len({w.data_ptr() for w in weights}) == 3  # not one block applied three times
    assert len(head.blocks) == 3 and sum(isinstance(m, torch.nn.Linear) for m in head.modules()) == 4  # D + 1
    assert AcceptanceHead(16, depth=0)(torch.randn(2, 16)).shape == (2,)


def test_checkpoint_round_trip(tmp_path, draft):
    head = AcceptanceHead(draft_hidden_size(draft), 2, draft_fingerprint(draft))
    head.save(tmp_path / "h", training={"steps": 3})
    again = AcceptanceHead.load(tmp_path / "h", draft_model=draft)
    x = torch.randn(4, head.hidden_size)
    assert torch.equal(head(x), again(x))
    assert again.training_info == {"steps": 3} and again.depth == 2


def test_checkpoint_refusals(tmp_path, draft):
    head = AcceptanceHead(draft_hidden_size(draft), 1, draft_fingerprint(draft))
    head.save(tmp_path / "h")
    other = perturbed_copy(tiny_model("llama"), scale=0.9, seed=7)
    with pytest.raises(CheckpointError, match="another draft"):
        AcceptanceHead.load(tmp_path / "h", draft_model=other)
    with pytest.raises(CheckpointError, match="hidden states of size"):
        AcceptanceHead(8, 1).check_draft(draft)
    with pytest.raises(CheckpointError, match="missing"):
        AcceptanceHead.load(tmp_path / "nothing")
    blob = bytearray((tmp_path / "h" / WEIGHTS).read_bytes())
    blob[-1] ^= 0xFF
    (tmp_path / "h" / WEIGHTS).write_bytes(bytes(blob))
    with pytest.raises(CheckpointError, match="corrupt"):
        AcceptanceHead.load(tmp_path / "h")
    (tmp_path / "h" / "config.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(CheckpointError, match="not a version"):
        AcceptanceHead.load(tmp_path / "h")


def test_self_draft_layers_change_the_fingerprint():
    from speculum.models import make_self_draft

    target = tiny_model("llama")
    assert draft_fingerprint(make_self_draft(target, 1)) != draft_fingerprint(target)


class ConstantHead:
    def __init__(self, p):
        self.p = p

    def accept_probability(self, hidden, confidence=None):
        return torch.tensor(self.p)


def _step(position, token=5):
    return DraftStep(position, token, torch.zeros(VOCAB), None, torch.zeros(4))


def test_specdecpp_stop_rule():
    policy = SpecDecPPStop(10, ConstantHead(0.5), threshold=0.7, min_tokens=1)
    policy.begin_round([1, 2])
    assert not policy.should_stop(_step(0))  # the first forward's input is not a candidate
    assert not policy.should_stop(_step(1))  # 1 - 0.5 = 0.5
    assert policy.should_stop(_step(2))  # 1 - 0.25 = 0.75 > 0.7
    policy.begin_round([1, 2, 3])  # a new round starts from certainty again
    assert not policy.should_stop(_step(0)) and not policy.should_stop(_step(1))
    late = SpecDecPPStop(10, ConstantHead(0.1), threshold=0.5, min_tokens=4)
    assert [late.should_stop(_step(i)) for i in range(5)] == [False, False, False, True, True]
    assert late.budget(3) == 3 and late.budget(50) == 10
    assert SpecDecPPStop(10, ConstantHead(1.0)).needs_hidden


def test_an_early_head_scores_the_token_just_drafted():
    head = ConstantHead(0.5)
    head.early = True
    policy = SpecDecPPStop(10, head, threshold=0.7, min_tokens=1)
    policy.begin_round([1])
    assert not policy.should_stop(_step(0))  # 1 - 0.5: the first candidate counts too
    assert policy.should_stop(_step(1))  # 1 - 0.25 > 0.7: one token sooner than the paper's rule


@pytest.mark.parametrize(
    "kwargs, match",
    [({"stop_threshold": 1.0}, "stop_threshold"), ({"min_draft_tokens": 0}, "min_draft_tokens")],
)
def test_specdecpp_bad_values(kwargs, match):
    with pytest.raises(InvalidInputError, match=match):
        make_policy("specdecpp", 5, **kwargs)


def test_specdecpp_needs_a_head(draft, tmp_path):
    with pytest.raises(InvalidInputError, match="acceptance_head"):
        build_drafter("draft_model", draft, VOCAB, length_policy="specdecpp")
    with pytest.raises(CheckpointError):
        build_drafter("draft_model", draft, VOCAB, length_policy="specdecpp", acceptance_head=str(tmp_path / "none"))


def test_oracle_stops_before_the_first_token_off_the_reference():
    policy = OracleStop(8)
    policy.set_reference([1, 2, 3, 4, 5, 6])
    policy.begin_round([1, 2, 3])
    assert not policy.stop_before(_step(0, token=4)) and not policy.stop_before(_step(1, token=5))
    assert policy.stop_before(_step(2, token=9))  # the reference says 6
    assert policy.stop_before(_step(3, token=7))  # past the end of the reference
    policy.begin_round([1, 9])  # off the reference: no information, no stop
    assert not policy.stop_before(_step(0, token=3))


def test_a_shipped_head_is_found_by_draft_fingerprint(draft, tmp_path, monkeypatch):
    import speculum.heads.acceptance as acceptance_head

    head = AcceptanceHead(draft_hidden_size(draft), 1, draft_fingerprint(draft))
    head.save(tmp_path / "heads" / "tiny", dtype=torch.bfloat16)  # shipped heads are stored in bfloat16
    monkeypatch.setattr(acceptance_head, "BUNDLED", tmp_path / "heads")
    drafter = build_drafter("draft_model", draft, VOCAB, length_policy="specdecpp")
    assert drafter.policy.initial == 20  # the paper's bound is the default for an adaptive stop
    x = torch.randn(3, head.hidden_size)
    assert torch.allclose(drafter.policy.head(x), head(x), atol=0.05)  # the bfloat16 copy, read as float32
    assert build_drafter("draft_model", draft, VOCAB).policy.initial == 5
    other = perturbed_copy(tiny_model("llama"), scale=0.9, seed=7)
    with pytest.raises(InvalidInputError, match="train acceptance-head"):
        build_drafter("draft_model", other, VOCAB, length_policy="specdecpp")


def test_the_shipped_head_is_intact():
    """The head in the package loads (checksum, shape) and is the early kind the docs describe."""
    from speculum.heads.acceptance import BUNDLED

    directories = sorted(p.parent for p in BUNDLED.glob("*/config.json"))
    assert directories, "no acceptance head ships with the package"
    for directory in directories:
        head = AcceptanceHead.load(directory)
        assert head.early and head.confidence_input and head.draft_fingerprint
        q = torch.tensor([0.05, 0.95])
        probs = torch.sigmoid(head(torch.zeros(2, head.hidden_size), q))
        assert probs[0] < probs[1]  # a confident candidate is likelier to pass


def test_each_request_uses_the_shipped_head_trained_nearest_its_temperature(draft, tmp_path, monkeypatch):
    """Acceptance depends on the warping (greedy matches vs min(1, p/q) at T=1): where heads for
    several temperatures ship, a request uses the one trained nearest its own."""
    import speculum.heads.acceptance as acceptance_head
    from speculum.sampling import SamplingParams

    for name, temperature in (("tiny", 0.0), ("tiny-t1", 1.0)):
        head = AcceptanceHead(draft_hidden_size(draft), 1, draft_fingerprint(draft), early=True)
        head.save(tmp_path / "heads" / name, training={"data": {"temperature": temperature}})
    monkeypatch.setattr(acceptance_head, "BUNDLED", tmp_path / "heads")
    policy = build_drafter("draft_model", draft, VOCAB, length_policy="specdecpp").policy
    assert len(policy.heads) == 2
    cases = [(SamplingParams(), 0.0), (SamplingParams(temperature=1.0), 1.0)]
    cases += [(SamplingParams(temperature=0.7), 1.0), (SamplingParams(temperature=0.3), 0.0)]
    for sampling, expected in cases:
        policy.reset(sampling)
        assert policy.head.training_info["data"]["temperature"] == expected


@pytest.mark.parametrize("method", ["draft_model", "ouroboros"])
def test_oracle_refuses_sampling_at_the_call(draft, method):
    """The oracle drops a drafted token because of its value: under sampling that biases the draft's
    distribution, so a sampled request is refused when it is made, before anything runs."""
    from speculum import engine
    from speculum.runner import ModelRunner
    from speculum.sampling import SamplingParams

    target = tiny_model("llama")
    runner = ModelRunner(target)
    drafter = build_drafter(method, draft_model=draft, length_policy="oracle", num_speculative_tokens=4)
    with pytest.raises(InvalidInputError, match="greedy analysis only"):
        engine.run(runner, [1, 5, 6, 7], drafter, SamplingParams(temperature=0.8), 8)
    steps = engine.run(runner, [1, 5, 6, 7], drafter, SamplingParams(), 8)  # greedy stays allowed
    assert sum(len(step) for step in steps) == 8
