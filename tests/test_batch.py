"""Batched decoding (issue #19): rows of different lengths share one target forward per step, join
and leave mid-way, and each row's output is exactly its single-request output."""

import pytest
import torch

import speculum
from speculum import cache as cache_ops
from speculum import engine
from speculum.controller import Controller
from speculum.costs import CostModel
from speculum.drafters import draft_model as draft_model_module
from speculum.engine import Batch, Request
from speculum.errors import InvalidInputError
from speculum.methods import machine_defaults
from speculum.runner import ModelRunner
from speculum.sampling import SamplingParams

from helpers import RandomTreeDrafter, build_drafter, save_random_heads
from tiny_models import ARCHS, VOCAB, perturbed_copy, reference_greedy, repetitive_prompt, tiny_model, word_tokenizer

# prompts of different lengths (one of a single token: its row starts with an empty cache), and
# different lengths asked, so rows finish and leave at different steps
PROMPTS = [repetitive_prompt(24, 5, 0), [7], repetitive_prompt(9, 4, 2), repetitive_prompt(40, 7, 1)]
LENGTHS = [30, 12, 24, 6]
OUROBOROS_SMALL = {"num_speculative_tokens": 4, "window_size": 3, "ngram_size": 3, "guess_set_size": 3}


@pytest.fixture(scope="module", params=ARCHS)
def arch(request, tmp_path_factory):
    model = tiny_model(request.param)
    path = tmp_path_factory.mktemp(request.param)
    heads = {kind: save_random_heads(kind, model, path / kind) for kind in ("medusa", "ctc")}
    refs = [reference_greedy(model, p, n) for p, n in zip(PROMPTS, LENGTHS, strict=True)]
    return request.param, model, perturbed_copy(model, scale=0.4), heads, refs


def make(method, model, draft, heads, ref, row):
    """A fresh drafter of ``method`` for one row (rows keep their own per-request state)."""
    if method == "random_tree":
        return RandomTreeDrafter(ref, VOCAB, seed=row)
    if method == "auto_ouroboros":  # auto with Ouroboros as its draft-model part
        return build_drafter("auto", draft, VOCAB, target=model, drafters="anpd,prompt_lookup,ouroboros")
    params = {
        "anpd": {"tree": True, "adaptive": True},
        "lookahead": {"window_size": 3, "ngram_size": 3, "guess_set_size": 2, "pool_from_prompt": True},
        "draft_model": {"num_speculative_tokens": 4},
        "ouroboros": OUROBOROS_SMALL,
        "medusa": {"heads": heads["medusa"]},
        "ctc": {"heads": heads["ctc"]},
    }.get(method, {})
    uses_draft = method in ("draft_model", "ouroboros", "auto")
    return build_drafter(method, draft if uses_draft else None, VOCAB, target=model, **params)


def run_rows(model, drafters, lengths=LENGTHS, prompts=PROMPTS, controllers=None):
    requests = [
        Request(p, d, SamplingParams(), n, controller=None if controllers is None else controllers[i])
        for i, (p, d, n) in enumerate(zip(prompts, drafters, lengths, strict=True))
    ]
    outputs = [[] for _ in requests]
    for row, new in engine.run_batch(ModelRunner(model), requests):
        outputs[row].extend(new)
    return outputs, [r.stats for r in requests]


def record_batched_forwards(monkeypatch, draft) -> list[bool]:
    """Record, for every batched forward from now on, whether it ran the draft model."""
    calls = []
    forward_rows = ModelRunner.forward_rows

    def recording(self, cache, trees, lengths, **kw):
        calls.append(self.model is draft)
        return forward_rows(self, cache, trees, lengths, **kw)

    monkeypatch.setattr(ModelRunner, "forward_rows", recording)
    return calls


METHODS = ["autoregressive", "prompt_lookup", "anpd", "lookahead", "draft_model", "ouroboros", "medusa", "ctc",
           "auto", "auto_ouroboros", "random_tree"]  # fmt: skip


@pytest.mark.parametrize("method", METHODS)
def test_each_row_gives_its_single_request_output(arch, method):
    name, model, draft, heads, refs = arch
    if method in ("medusa", "ctc") and name == "gpt2":
        pytest.skip("the test heads read a plain-head architecture's hidden states")
    drafters = [make(method, model, draft, heads, ref, i) for i, ref in enumerate(refs)]
    outputs, stats = run_rows(model, drafters)
    assert outputs == refs
    assert [s.new_tokens for s in stats] == LENGTHS
    assert all(s.stop_reason == "length" for s in stats)
    if method != "autoregressive":
        assert sum(s.drafted_tokens for s in stats) > 0


def test_rows_of_different_methods_share_the_forward(arch):
    name, model, draft, heads, refs = arch
    methods = ["anpd", "draft_model", "random_tree", "autoregressive"]
    drafters = [make(m, model, draft, heads, ref, i) for i, (m, ref) in enumerate(zip(methods, refs, strict=True))]
    outputs, stats = run_rows(model, drafters)
    assert outputs == refs
    assert stats[3].mean_acceptance_length == 1.0 and stats[2].accepted_tokens > 0


def test_rows_join_and_leave_mid_way():
    model = tiny_model("gemma3")  # sliding-window layers: windows apply per row
    refs = [reference_greedy(model, p, n) for p, n in zip(PROMPTS, LENGTHS, strict=True)]
    runner = ModelRunner(model)
    batch = Batch(runner)
    requests = [Request(p, build_drafter("anpd"), SamplingParams(), n) for p, n in zip(PROMPTS, LENGTHS, strict=True)]
    outputs = {}
    rows = [batch.join(requests[0]), batch.join(requests[1])]
    steps = 0
    while batch.rows:
        steps += 1
        if steps == 3:
            rows.append(batch.join(requests[2]))  # joins a running batch
        if steps == 5:
            rows.append(batch.join(requests[3]))
        if steps == 4:
            batch.leave(rows[1], "cancelled")  # a client disconnected: its row goes at once
        for row, new in batch.step():
            outputs.setdefault(id(row), []).extend(new)
    got = [outputs.get(id(row), []) for row in rows]
    assert got[0] == refs[0] and got[2] == refs[2] and got[3] == refs[3]
    assert got[1] == refs[1][: len(got[1])] and requests[1].stats.stop_reason == "cancelled"
    assert cache_ops.cache_length(batch.cache) == 0  # every row left: nothing kept


def test_a_long_batch_with_eos_and_a_finished_row_each_step():
    model = tiny_model("qwen2")
    prompts = [repetitive_prompt(5 + 3 * i, 3 + i % 4, i) for i in range(8)]
    lengths = [1 + 3 * i for i in range(8)]
    refs = [reference_greedy(model, p, n) for p, n in zip(prompts, lengths, strict=True)]
    eos = refs[5][4]  # row 5 stops at its first occurrence of this token
    stops = [frozenset({eos} if i == 5 else ()) for i in range(8)]
    requests = [
        Request(p, build_drafter("prompt_lookup"), SamplingParams(), n, eos_token_ids=stop)
        for p, n, stop in zip(prompts, lengths, stops, strict=True)
    ]
    outputs = [[] for _ in requests]
    for row, new in engine.run_batch(ModelRunner(model), requests):
        outputs[row].extend(new)
    cut = refs[5].index(eos) + 1
    assert outputs[5] == refs[5][:cut] and requests[5].stats.stop_reason == "eos"
    assert [o for i, o in enumerate(outputs) if i != 5] == [r for i, r in enumerate(refs) if i != 5]


def test_controlled_rows_stay_exact_and_calibrate():
    model = tiny_model("llama")
    refs = [reference_greedy(model, p, n) for p, n in zip(PROMPTS, LENGTHS, strict=True)]
    controller = Controller(CostModel([(1, 0.010), (64, 0.011)]))
    drafters = [build_drafter("anpd") for _ in PROMPTS]
    outputs, stats = run_rows(model, drafters, controllers=[controller] * len(PROMPTS))
    assert outputs == refs
    assert controller.calibration.counts  # batched rounds teach the calibration what the target accepts
    assert sum(s.rounds_drafted for s in stats) > 0


def test_rows_of_a_batch_draft_their_chains_without_the_chain_stop():
    """In a batch a row whose chain ended rides along in the others' draft forwards, so the
    controller's chain stop is for rows decoding alone: the rows draft as their policy says."""
    model = tiny_model("llama")
    draft = perturbed_copy(model, scale=2.0)
    lengths = [16] * len(PROMPTS)  # (the rows end together: a last row left alone would stop its chains)
    refs = [reference_greedy(model, p, n) for p, n in zip(PROMPTS, lengths, strict=True)]
    drafters = [build_drafter("draft_model", draft, VOCAB, length_policy="fixed", num_speculative_tokens=6)
                for _ in PROMPTS]  # fmt: skip
    for drafter in drafters:
        drafter.clock.step[1] = 1.0  # a draft forward dearer than any node could pay for
    controller = Controller(CostModel([(1, 0.010), (64, 0.011)]))
    outputs, stats = run_rows(model, drafters, lengths, controllers=[controller] * len(PROMPTS))
    assert outputs == refs
    assert sum(s.rounds_drafted for s in stats) > 0 and sum(s.chains_stopped for s in stats) == 0
    # alone, the same drafter's chains are stopped
    alone = build_drafter("draft_model", draft, VOCAB, length_policy="fixed", num_speculative_tokens=6)
    alone.clock.step[1] = 1.0
    alone.clock.charge = lambda *args: None
    _, [stats] = run_rows(model, [alone], LENGTHS[:1], PROMPTS[:1], [Controller(CostModel([(1, 0.010), (64, 0.011)]))])
    assert stats.chains_stopped > 0


def test_sampled_rows_give_their_seeded_single_request_text():
    model = tiny_model("llama")
    sampling = SamplingParams(temperature=0.9, top_k=20)

    def generator(seed):
        return torch.Generator(model.device).manual_seed(seed)

    single = []
    for i, (p, n) in enumerate(zip(PROMPTS, LENGTHS, strict=True)):
        steps = engine.run(ModelRunner(model), p, build_drafter("anpd"), sampling, n, generator=generator(i))
        single.append([t for step in steps for t in step])
    requests = [
        Request(p, build_drafter("anpd"), sampling, n, generator=generator(i))
        for i, (p, n) in enumerate(zip(PROMPTS, LENGTHS, strict=True))
    ]
    outputs = [[] for _ in requests]
    for row, new in engine.run_batch(ModelRunner(model), requests):
        outputs[row].extend(new)
    assert outputs == single


# ---------------------------------------------------------------- the Python API


@pytest.fixture(scope="module")
def spec():
    target = tiny_model("llama")
    return speculum.Speculum(target, word_tokenizer(), perturbed_copy(target), word_tokenizer())


TEXTS = ["w5 w6 w7 w8 w5 w6 w7 w8 w5", "w9 w10", [{"role": "user", "content": "w3 w4 w3 w4"}], [4, 5, 6]]


@pytest.mark.parametrize("method", ["autoregressive", "anpd", "draft_model", "auto"])
def test_generate_takes_a_list_of_prompts_and_returns_one_result_each(spec, method):
    alone = [spec.generate(p, method, max_new_tokens=16) for p in TEXTS]
    together = spec.generate(TEXTS, method, max_new_tokens=16)
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    assert [r.text for r in together] == [r.text for r in alone]
    assert all(r.stats.new_tokens == 16 and r.method == method for r in together)


def test_a_seeded_batch_gives_each_prompt_its_seeded_text(spec):
    alone = [spec.generate(p, "anpd", max_new_tokens=12, temperature=1.0, seed=7).token_ids for p in TEXTS]
    together = spec.generate(TEXTS, "anpd", max_new_tokens=12, temperature=1.0, seed=7)
    assert [r.token_ids for r in together] == alone


def test_a_batch_streams_index_and_chunk(spec):
    stream = spec.generate(TEXTS[:3], "prompt_lookup", max_new_tokens=10, stream=True)
    texts = ["", "", ""]
    for row, chunk in stream:
        texts[row] += chunk.text
    expected = spec.generate(TEXTS[:3], "prompt_lookup", max_new_tokens=10)
    assert texts == [r.text for r in expected] == [r.text for r in stream.results]


def test_a_closed_batch_stream_ends_every_row(spec):
    stream = spec.generate(TEXTS, "anpd", max_new_tokens=30, stream=True)
    for _, _chunk in zip(range(3), stream, strict=False):
        pass
    stream._chunks.close()
    assert all(r is not None and r.stats.stop_reason == "cancelled" for r in stream.results)
    assert spec.generate("w5 w6", "anpd", max_new_tokens=4).stats.new_tokens == 4  # the drafters are free again


def test_a_bad_prompt_in_a_batch_is_refused_before_anything_runs(spec):
    with pytest.raises(InvalidInputError, match="empty"):
        spec.generate(["w5 w6", "  "], "anpd", max_new_tokens=4)


def test_a_prompt_prefilled_in_chunks_between_steps_drafts_as_if_prefilled_at_once(tmp_path):
    model = tiny_model("llama")
    heads = save_random_heads("medusa", model, tmp_path / "m")  # medusa reads the prefill's hidden states
    refs = [reference_greedy(model, p, n) for p, n in zip(PROMPTS, LENGTHS, strict=True)]

    def drafter():
        return build_drafter("medusa", target=model, heads=heads)

    outputs, at_once = run_rows(model, [drafter() for _ in PROMPTS])
    assert outputs == refs
    batch = Batch(ModelRunner(model))
    requests = [Request(p, drafter(), SamplingParams(), n) for p, n in zip(PROMPTS, LENGTHS, strict=True)]
    rows = [batch.join(requests[0])]
    joining = engine.Joining(batch.runner, requests[3])  # 40 tokens, 6 at a time, while row 0 decodes
    chunks = 0
    got: dict[int, list[int]] = {}
    while batch.rows or joining is not None:
        if joining is not None:
            chunks += 1
            if joining.prefill(6):
                rows.append(batch.admit(joining))
                joining = None
        for row, new in batch.step():
            got.setdefault(id(row), []).extend(new)
    assert chunks == 7 and got[id(rows[0])] == refs[0] and got[id(rows[1])] == refs[3]
    chunked = requests[3].stats
    assert chunked.drafted_tokens > 0  # the heads' drafts, from the chunks' hidden states, were those of one prefill:
    assert (chunked.drafted_tokens, chunked.accepted_tokens) == (at_once[3].drafted_tokens, at_once[3].accepted_tokens)


@pytest.mark.parametrize("policy", ["fixed", "confidence"])
def test_draft_model_rows_draft_together_as_they_would_alone(arch, policy, monkeypatch):
    """Rows with the same draft model run one draft forward per draft step for all of them
    (``propose_rows``), and each row drafts exactly what it drafts alone."""
    name, model, draft, heads, refs = arch
    params = {"num_speculative_tokens": 4, "length_policy": policy}
    alone = []
    for prompt, n in zip(PROMPTS, LENGTHS, strict=True):
        _, stats = run_rows(model, [build_drafter("draft_model", draft, VOCAB, **params)], [n], [prompt])
        alone.append(stats[0])
    calls = record_batched_forwards(monkeypatch, draft)
    outputs, together = run_rows(model, [build_drafter("draft_model", draft, VOCAB, **params) for _ in PROMPTS])
    assert outputs == refs
    assert [(s.drafted_tokens, s.accepted_tokens) for s in together] == [
        (s.drafted_tokens, s.accepted_tokens) for s in alone
    ]
    assert any(calls)  # the draft model ran batched forwards


def test_ouroboros_rows_draft_together_as_they_would_alone(arch, monkeypatch):
    """Ouroboros rows run one draft forward per draft step for all of them (their trees of window
    and pool guesses side by side), and each row drafts exactly what it drafts alone."""
    name, model, draft, heads, refs = arch
    alone = []
    for prompt, n in zip(PROMPTS, LENGTHS, strict=True):
        _, stats = run_rows(model, [build_drafter("ouroboros", draft, VOCAB, **OUROBOROS_SMALL)], [n], [prompt])
        alone.append(stats[0])
    calls = record_batched_forwards(monkeypatch, draft)
    drafters = [build_drafter("ouroboros", draft, VOCAB, **OUROBOROS_SMALL) for _ in PROMPTS]
    outputs, together = run_rows(model, drafters)
    assert outputs == refs
    assert [(s.drafted_tokens, s.accepted_tokens, s.draft_forwards) for s in together] == [
        (s.drafted_tokens, s.accepted_tokens, s.draft_forwards) for s in alone
    ]
    assert any(calls)  # the draft model ran batched forwards


def test_auto_rows_run_their_draft_model_batched(monkeypatch):
    model = tiny_model("llama")
    draft = perturbed_copy(model, scale=0.4)
    refs = [reference_greedy(model, p, n) for p, n in zip(PROMPTS, LENGTHS, strict=True)]
    calls = record_batched_forwards(monkeypatch, draft)
    drafters = [build_drafter("auto", draft, VOCAB, target=model) for _ in PROMPTS]
    assert len({d.batch_key for d in drafters}) == 1 and drafters[0].batch_key is not None
    outputs, stats = run_rows(model, drafters)
    assert outputs == refs
    assert any(calls) and sum(s.accepted_by.get("draft_model", 0) for s in stats) > 0
    assert build_drafter("auto", None, VOCAB, target=model).batch_key is None  # n-gram parts only: alone


def test_auto_rows_share_one_model_gate_per_batch_size(monkeypatch):
    """The draft model's gate is one per batch size for the whole configuration: the rows of a batch
    run it or skip it together, and what it learned holds for the next requests."""
    model = tiny_model("llama")
    draft = perturbed_copy(model, scale=0.4)
    config = speculum.SpeculativeConfig("auto")
    resources = speculum.drafters.base.Resources(target=model, draft_model=draft, vocab_size=VOCAB, model_key="t")
    drafters = [config.drafter_class()(config.options(), resources) for _ in PROMPTS]
    assert drafters[0].gate(4) is drafters[3].gate(3) and drafters[0].gate(4) is not drafters[0].gate(2)
    sizes = []
    forward_rows = ModelRunner.forward_rows

    def recording(self, cache, trees, lengths, **kw):
        if self.model is draft:
            sizes.append(len(trees))
        return forward_rows(self, cache, trees, lengths, **kw)

    monkeypatch.setattr(ModelRunner, "forward_rows", recording)
    drafters[0].gate(4)._skip = 10_000  # the model stopped paying with 3-4 rows: it must not run there
    refs = [reference_greedy(model, p, 8) for p in PROMPTS]
    outputs, stats = run_rows(model, drafters, [8] * 4)
    assert outputs == refs and all(size <= 2 for size in sizes)  # only once the batch was down to 2 rows
    assert drafters[0].gate(4).with_model.tokens is None
    sizes.clear()
    # two rows: their gate is another, which runs the model for both rows at once and learns from them
    prompts = [PROMPTS[1], [3, 9, 27, 17]]
    refs = [reference_greedy(model, p, 16) for p in prompts]
    outputs, _ = run_rows(model, drafters[:2], [16, 16], prompts)
    assert outputs == refs and sizes and set(sizes) == {2}
    gate = drafters[0].gate(2)
    assert gate.with_model.tokens is not None and gate.with_model.rounds > 1  # a round per step, not per row
    assert config.drafter_class()(config.options(), resources).gate(2) is gate  # kept for the next requests


class SimulatedClock:
    """The engine's clock, advanced by what each forward costs under a cost model instead of what it
    took: the controller's verdicts then rest on the costs a test gives, not on how fast the machine
    running it is (a CI machine where tiny models run fast made drafting look cheap). The draft
    model's catch-up clock reads it too: a real second there beside simulated ones elsewhere made
    the verdicts depend on how busy the host was."""

    def __init__(self, monkeypatch, target, cost: CostModel, draft_forward: float):
        self.now = 0.0
        monkeypatch.setattr(engine, "time", self)
        monkeypatch.setattr(draft_model_module, "time", self)
        forward, forward_rows, prefill = ModelRunner.forward, ModelRunner.forward_rows, ModelRunner.prefill
        clock = self

        def timed_forward(runner, cache, tree, **kw):
            clock.now += cost(len(tree)) if runner.model is target else draft_forward
            return forward(runner, cache, tree, **kw)

        def timed_forward_rows(runner, cache, trees, lengths, **kw):
            rows, n = len(trees), max(len(tree) for tree in trees)
            clock.now += cost.batch(rows, n) if runner.model is target else draft_forward
            return forward_rows(runner, cache, trees, lengths, **kw)

        def timed_prefill(runner, cache, token_ids, **kw):
            clock.now += cost(len(token_ids)) if runner.model is target else draft_forward
            return prefill(runner, cache, token_ids, **kw)

        monkeypatch.setattr(ModelRunner, "forward", timed_forward)
        monkeypatch.setattr(ModelRunner, "forward_rows", timed_forward_rows)
        monkeypatch.setattr(ModelRunner, "prefill", timed_prefill)

    def perf_counter(self) -> float:
        return self.now


@pytest.mark.parametrize("dear", [True, False])
def test_draft_model_rows_take_plain_steps_when_a_batch_makes_drafting_dear(monkeypatch, dear):
    """In a batch, the controller of draft_model's rows decides whether they draft: where verifying
    their chains costs the batch more than it gains, they take plain steps, where it is cheap they
    draft, and they stay exact."""
    target = tiny_model("llama")
    spec = speculum.Speculum(target, word_tokenizer(), perturbed_copy(target, scale=0.4), word_tokenizer())
    if dear:  # a plain step of 4 rows costs what one row's does, 4 rows of drafted chains 20 times it
        points, draft_forward = [(1, 0.010), (4, 0.010), (8, 0.200), (64, 1.6)], 0.002
    else:  # verification flat in the nodes, drafting cheap
        points, draft_forward = [(1, 0.010), (64, 0.011)], 0.0002
    spec.cost_model = CostModel(points)
    SimulatedClock(monkeypatch, target, CostModel(points), draft_forward)
    # the CPU's setting, named, so that a GPU runs it too: there the default is the published fixed
    # chain, whose drafted rounds commit fewer tokens, so more of them go by while the batch verdict
    # learns (75 plain against 31 drafted rounds)
    method = speculum.SpeculativeConfig("draft_model", **machine_defaults("draft_model", "cpu"))
    alone = [spec.generate(p, method, max_new_tokens=40, controller=False) for p in TEXTS]
    together = spec.generate(TEXTS, method, max_new_tokens=40)
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    plain, drafted = (sum(getattr(r.stats, f"rounds_{kind}") for r in together) for kind in ("plain", "drafted"))
    assert plain > 3 * drafted if dear else drafted > 10 * plain
    paper = spec.generate(TEXTS, "draft_model", max_new_tokens=40, preset="paper")
    assert all(r.stats.rounds_plain + r.stats.rounds_drafted == 0 for r in paper)  # no controller at all


@pytest.mark.parametrize("method", ["ouroboros", "auto"])
def test_a_drafter_reused_after_a_request_that_ended_on_a_draft_starts_clean(method):
    """A request can end on a drafted round, which its drafter never observes; the next request on
    that drafter may begin with a plain step (a batch verdict says so) and must not read that draft."""
    model = tiny_model("llama")
    draft = perturbed_copy(model, scale=0.4)
    drafter = build_drafter(method, draft, VOCAB, target=model, **(OUROBOROS_SMALL if method == "ouroboros" else {}))
    prompt = repetitive_prompt(24, 5, 0)
    ref = reference_greedy(model, prompt, 7)
    steps = engine.run(ModelRunner(model), prompt, drafter, SamplingParams(), 7)
    assert [t for step in steps for t in step] == ref  # a repetitive prompt: the last round drafted
    controller = Controller(CostModel([(1, 0.010), (64, 0.011)]), carry_backoff=True)
    controller._plain_left = 2  # the next request's first rounds: plain steps
    steps = engine.run(ModelRunner(model), prompt, drafter, SamplingParams(), 7, controller=controller)
    assert [t for step in steps for t in step] == ref


@pytest.mark.parametrize("method", ["draft_model", "anpd"])
def test_sampled_rows_of_a_batch_follow_the_target_distribution(method):
    """Chi-square on batched rows: 1,400 rows (100 batches of 14 rows of one prompt beside a shorter
    prompt, so the cache is ragged), each sampling its first three tokens through drafts three deep."""
    from scipy.stats import chisquare

    from test_sampling import _first_tokens_exact

    model = tiny_model("llama")
    draft = perturbed_copy(model, scale=0.1)
    prompt = [3, 4, 5] + reference_greedy(model, [3, 4, 5], 12)
    sampling = SamplingParams(temperature=1.0, top_k=3)
    exact = _first_tokens_exact(model, prompt, sampling, 3)
    counts = dict.fromkeys(exact, 0)
    gen = torch.Generator().manual_seed(5)
    runner = ModelRunner(model)
    deep = 0
    for _ in range(100):
        requests = [
            Request(prompt, build_drafter(method, draft, VOCAB, num_speculative_tokens=3), sampling, 4,
                    generator=torch.Generator(model.device).manual_seed(int(torch.randint(2**62, (1,), generator=gen))))
            for _ in range(14)
        ] + [Request([9, 8], build_drafter(method, draft, VOCAB, num_speculative_tokens=3), sampling, 6,
                     generator=torch.Generator(model.device).manual_seed(1))]  # fmt: skip
        outputs = [[] for _ in requests]
        for row, new in engine.run_batch(runner, requests):
            outputs[row].extend(new)
        for out, request in zip(outputs[:14], requests[:14], strict=True):
            counts[tuple(out[:3])] += 1
            per = request.stats.accepted_per_position
            deep += len(per) > 2 and per[2] > 0
    assert deep >= 5  # drafts accepted three deep decided some third tokens
    trials = 1400
    keep = sorted((k for k, p in exact.items() if p * trials >= 5), key=exact.get, reverse=True)
    observed, expected = [counts[k] for k in keep], [exact[k] * trials for k in keep]
    observed[-1] += trials - sum(observed)
    expected[-1] += trials - sum(expected)
    _, pvalue = chisquare(observed, expected)
    assert pvalue > 1e-3


@pytest.mark.parametrize("curve, runs", [("cpu", False), ("gpu", True)])
def test_auto_runs_its_draft_model_in_a_fresh_batch_only_where_the_cost_model_says_it_pays(monkeypatch, curve, runs):
    """Before auto's draft model has run at a batch size, the target's cost model decides whether it
    runs there, from the batch's first step: where every row and node of a forward costs compute (a
    CPU-like curve) the rows decode without it; where verifying a tree costs what one token does (a
    GPU-like curve) and a draft forward is cheap, they draft with it. The text is the same either way."""
    model = tiny_model("llama")
    draft = perturbed_copy(model, scale=0.4)
    refs = [reference_greedy(model, p, n) for p, n in zip(PROMPTS, LENGTHS, strict=True)]
    cost = {
        "cpu": CostModel([(1, 0.010), (2, 0.020), (64, 0.640)]),  # every node costs a whole step
        "gpu": CostModel([(1, 0.010), (64, 0.011)]),
    }[curve]
    calls = record_batched_forwards(monkeypatch, draft)
    config = speculum.SpeculativeConfig("auto")
    resources = speculum.drafters.base.Resources(target=model, draft_model=draft, vocab_size=VOCAB, model_key="t")
    drafters = [config.drafter_class()(config.options(), resources) for _ in PROMPTS]
    clock = drafters[0].parts[-1].drafter.clock  # the draft's timings, as earlier requests left them:
    clock.step[1] = 0.0005  # a draft forward alone, a twentieth of a step
    clock.per_padded_token = 0.0001  # a batch's catch-up, per token
    configuration = Controller(cost)
    outputs, stats = run_rows(model, drafters, controllers=[configuration.for_row() for _ in PROMPTS])
    assert outputs == refs
    assert any(calls) == runs
    assert (sum(s.accepted_by.get("draft_model", 0) for s in stats) > 0) == runs
