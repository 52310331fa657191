"""Medusa heads and the CTC drafter: the CTC transform, trees, checkpoints, training, losslessness."""

import itertools
import json
import math

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from speculum import machine
from speculum.drafters.ctc import best_alignments, ctc_collapse, cut_at_eos, prefix_search
from speculum.errors import CheckpointError, InvalidInputError
from speculum.heads import load_draft_head
from speculum.heads.checkpoint import model_fingerprint
from speculum.heads.medusa import sparse_tree
from speculum.tree import Draft, TokenTree

from helpers import build_drafter, generate_ids, save_random_heads
from tiny_models import ARCHS, VOCAB, reference_greedy, repetitive_prompt, tiny_config, tiny_model

BLANK = 99


# ---------------------------------------------------------------- the CTC transform and trees


def test_ctc_collapse_drops_blanks_and_merges_repeats():
    assert ctc_collapse([5, 5, BLANK, 5, 7, 7, BLANK], BLANK) == [5, 5, 7]
    assert ctc_collapse([BLANK, BLANK], BLANK) == []
    assert ctc_collapse([3, BLANK, BLANK, 4], BLANK) == [3, 4]
    assert ctc_collapse([3, 3, 3]) == [3]  # no blank symbol: repeats only (Medusa + transform ablation)


def test_collapsed_paths_get_positions_of_their_collapsed_depth():
    """[a, a, b] and [a, _, b] both collapse to [a, b]: one shared path, b at depth 2 (position
    past + 2), not at its frame index 3 (the released code's off-by-one)."""
    a, b, c = 10, 11, 12
    paths = [ctc_collapse(f, BLANK) for f in ([a, a, b], [a, BLANK, b], [a, c, BLANK])]
    draft = Draft.from_paths(paths)
    assert draft.tokens == [a, b, c] and draft.parents == [-1, 0, 0]
    tree = TokenTree.from_draft(7, draft)
    assert tree.position_ids(50).tolist() == [50, 51, 52, 52]
    mask = tree.ancestor_mask
    assert mask[2].tolist() == [True, True, True, False]  # b sees root, a, itself; not its sibling c


def test_from_paths_keeps_the_best_paths_within_the_budget():
    draft = Draft.from_paths([[1, 2, 3], [1, 4], [5, 6, 7]], max_nodes=4)
    assert draft.tokens == [1, 2, 3, 4]  # [5, 6, 7] did not fit
    assert Draft.from_paths([[], [1]]).tokens == [1]


def _kept_mass(draft, total):
    """The summed probability mass of a draft's nodes (``total``: mass by prefix)."""
    prefixes = []
    for i, token in enumerate(draft.tokens):
        parent = draft.parents[i]
        prefixes.append((prefixes[parent] if parent >= 0 else ()) + (token,))
    return sum(total[prefix] for prefix in prefixes)


def test_from_paths_by_mass_keeps_the_sub_tree_with_the_most_probability():
    paths, weights = [[1, 2, 3], [1, 4], [5, 6], [5, 7]], [0.3, 0.25, 0.25, 0.2]
    first = Draft.from_paths(paths, 4, weights)
    assert first.tokens == [1, 2, 3, 4]  # path order: both of 5's children lost, and 5 with them
    by_mass = Draft.from_paths(paths, 4, weights, keep="mass")
    assert by_mass.tokens == [1, 2, 3, 5] and by_mass.parents == [-1, 0, 1, -1]  # masses .55 .3 .3 .45
    assert by_mass.scores == pytest.approx([0.55, 0.3 / 0.55, 1.0, 0.45])
    gen = torch.Generator().manual_seed(1)
    for _ in range(50):  # random tries: a valid sub-tree (parents first) whose total mass is never below path order's
        paths = [torch.randint(0, 3, (int(torch.randint(1, 5, (1,), generator=gen)),), generator=gen).tolist()
                 for _ in range(12)]  # fmt: skip
        weights = sorted(torch.rand(12, generator=gen).tolist(), reverse=True)
        full = Draft.from_paths(paths, weights=weights)
        total = {tuple(prefix): 0.0 for path in paths for prefix in (path[: d + 1] for d in range(len(path)))}
        for path, w in zip(paths, weights, strict=True):
            for d in range(len(path)):
                total[tuple(path[: d + 1])] += w

        for size in (3, 6):
            assert (
                _kept_mass(Draft.from_paths(paths, size, weights, keep="mass"), total)
                >= _kept_mass(Draft.from_paths(paths, size, weights), total) - 1e-9
            )
        assert len(full) >= len(Draft.from_paths(paths, 6, weights, keep="mass"))
    with pytest.raises(ValueError, match="weights"):
        Draft.from_paths(paths, 4, keep="mass")


def test_cut_at_eos():
    assert cut_at_eos([4, 2, 5], {2}) == [4, 2]
    assert cut_at_eos([4, 5], {2}) == [4, 5]


def test_best_alignments_are_the_top_products_in_order():
    gen = torch.Generator().manual_seed(0)
    scores = torch.rand(4, 3, generator=gen).log().sort(dim=-1, descending=True).values.tolist()
    best = best_alignments(scores, 10)
    brute = sorted(
        ((sum(scores[t][c] for t, c in enumerate(choice)), choice) for choice in itertools.product(range(3), repeat=4)),
        reverse=True,
    )[:10]
    assert [choice for _, choice in best] == [choice for _, choice in brute]
    assert all(math.isclose(x, y) for (x, _), (y, _) in zip(best, brute, strict=True))


def _prefix_masses(probs: np.ndarray, blank: int) -> dict[tuple[int, ...], float]:
    """Brute force: every alignment's probability added to each prefix of its collapsed output."""
    mass: dict[tuple[int, ...], float] = {}
    for alignment in itertools.product(range(probs.shape[1]), repeat=len(probs)):
        p = math.prod(probs[t, a] for t, a in enumerate(alignment))
        out = tuple(ctc_collapse(list(alignment), blank))
        for n in range(1, len(out) + 1):
            mass[out[:n]] = mass.get(out[:n], 0.0) + p
    return mass


def _paths(chosen):
    paths: list[tuple[int, ...]] = []
    for parent, token, _ in chosen:
        paths.append((paths[parent] if parent >= 0 else ()) + (token,))
    return paths


@pytest.mark.parametrize("seed", range(6))
def test_prefix_search_finds_the_likeliest_prefixes_over_every_alignment(seed):
    """Each prefix's probability is the chance the collapsed output starts with it, summed over
    every alignment (repeats merged, a blank between equal tokens keeping both), and the nodes
    chosen are the likeliest ones, parents first."""
    rng = np.random.default_rng(seed)
    frames, blank = 5, 3
    probs = rng.dirichlet(np.full(4, 0.5), size=frames)  # tokens 0..2 and the blank
    mass = _prefix_masses(probs, blank)
    chosen = prefix_search(probs, blank, np.arange(3), nodes=25, max_depth=frames)
    paths = _paths(chosen)
    assert len(set(paths)) == 25
    for path, (parent, _, p) in zip(paths, chosen, strict=True):
        assert math.isclose(p, mass[path], rel_tol=1e-9), path
        assert parent < 0 or paths[parent] == path[:-1]
    assert np.allclose(sorted((p for *_, p in chosen), reverse=True), sorted(mass.values(), reverse=True)[:25])
    # depth and candidates bound it; width 1 is the greedy chain of likeliest children
    assert max(len(p) for p in _paths(prefix_search(probs, blank, np.arange(3), nodes=25, max_depth=2))) == 2
    assert {p[0] for p in _paths(prefix_search(probs, blank, np.array([0, 2]), nodes=25, max_depth=3))} <= {0, 2}
    chain = _paths(prefix_search(probs, blank, np.arange(3), nodes=4, max_depth=4, width=1))
    for n, path in enumerate(chain):
        assert len(path) == n + 1
        children = {k: v for k, v in mass.items() if len(k) == n + 1 and k[:n] == path[:n]}
        assert mass[path] == max(children.values())


def test_prefix_search_does_not_extend_a_stop_token():
    probs = np.array([[0.9, 0.05, 0.05], [0.05, 0.9, 0.05], [0.05, 0.9, 0.05]])  # token 0, token 1, blank 2
    paths = _paths(prefix_search(probs, 2, np.array([0, 1]), nodes=6, max_depth=3))
    assert (0, 1) in paths
    paths = _paths(prefix_search(probs, 2, np.array([0, 1]), nodes=6, max_depth=3, stop=frozenset({0})))
    assert (0,) in paths and not any(len(p) > 1 and p[0] == 0 for p in paths)


def test_sparse_tree_is_prefix_closed_and_follows_expected_acceptance():
    accuracy = [[0.6, 0.2, 0.1], [0.4, 0.2, 0.1], [0.3, 0.1, 0.05]]
    tree = sparse_tree(accuracy, 6)
    assert tree[0] == (0,) and len(tree) == 6
    assert all(path[:-1] in tree for path in tree if len(path) > 1)
    score = {p: math.prod(accuracy[d][c] for d, c in enumerate(p)) for p in tree}
    assert list(score.values()) == sorted(score.values(), reverse=True)
    # every path left out scores no more than the worst one chosen
    left_out = [p for n in (1, 2, 3) for p in itertools.product(range(3), repeat=n) if p not in tree]
    assert max(math.prod(accuracy[d][c] for d, c in enumerate(p)) for p in left_out) <= min(score.values())


# ---------------------------------------------------------------- checkpoints


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


@pytest.mark.parametrize("kind,slot_blocks,refine", [("medusa", False, False), ("ctc", False, False),
                                                     ("ctc", True, False), ("ctc", True, True)])  # fmt: skip
def test_checkpoint_round_trip(kind, slot_blocks, refine, llama, tmp_path):
    path = save_random_heads(kind, llama, tmp_path / kind, slot_blocks=slot_blocks, refine=refine)
    loaded = load_draft_head(path, kind, llama)
    again = load_draft_head(path, kind, llama)
    for (name, a), b in zip(loaded.state_dict().items(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    hidden = torch.randn(1, 4, llama.config.hidden_size)
    if kind == "medusa":
        assert loaded(hidden[:, -1]).shape == (1, 3, VOCAB)
    else:
        embed = llama.get_input_embeddings()
        assert loaded(hidden, torch.randn(1, llama.config.hidden_size), embed=embed).shape == (1, 6, VOCAB + 1)
        assert loaded.blank_index == VOCAB and loaded.slot_blocks == slot_blocks and loaded.refine == refine
    # the projection is the target's own LM head
    assert torch.equal(loaded.projection.weight, llama.get_output_embeddings().weight.float().cpu())


def test_checkpoints_are_refused_on_another_model_or_when_corrupt(llama, tmp_path):
    path = save_random_heads("medusa", llama, tmp_path / "m")
    wider = tiny_config("llama")
    wider.hidden_size = 48
    with pytest.raises(CheckpointError, match="another model"):
        load_draft_head(path, "medusa", tiny_model("llama", seed=5))
    with pytest.raises(CheckpointError, match="hidden states of size"):
        load_draft_head(path, "medusa", AutoModelForCausalLM.from_config(wider))
    with pytest.raises(CheckpointError, match="vocabulary"):
        load_draft_head(path, "medusa", tiny_model("llama", vocab_size=80))
    with pytest.raises(CheckpointError, match="'medusa' heads, not 'ctc'"):
        load_draft_head(path, "ctc", llama)
    weights = tmp_path / "m" / "draft_head.safetensors"
    weights.write_bytes(weights.read_bytes()[:-7] + b"garbage")
    with pytest.raises(CheckpointError, match="corrupt"):
        load_draft_head(path, "medusa", llama)
    with pytest.raises(CheckpointError, match="not a draft-head checkpoint"):
        load_draft_head(tmp_path, "medusa", llama)


def test_no_heads_for_the_model_is_a_clear_error(llama):
    with pytest.raises(InvalidInputError, match="speculum train medusa"):
        build_drafter("medusa", target=llama)
    with pytest.raises(InvalidInputError, match="speculum train ctc-drafter"):
        build_drafter("ctc", target=llama)


def test_bad_options_are_refused(llama, tmp_path):
    path = save_random_heads("medusa", llama, tmp_path / "m")
    with pytest.raises(InvalidInputError, match="tree_choices"):
        build_drafter("medusa", target=llama, heads=path, tree_choices=[[0], []])
    with pytest.raises(InvalidInputError, match="need 5 heads"):
        build_drafter("medusa", target=llama, heads=path, tree_choices=[[0, 0, 0, 0, 0]])
    with pytest.raises(InvalidInputError, match="tree_nodes"):
        build_drafter("ctc", target=llama, heads=path, tree_nodes=0)
    with pytest.raises(InvalidInputError, match="tree must be"):
        build_drafter("ctc", target=llama, heads=path, tree="widest")


def test_fingerprint_does_not_depend_on_the_dtype(llama):
    """dtype="auto" loads float32 on some CPUs, bfloat16 on others: shipped heads must match both."""
    assert model_fingerprint(llama) == model_fingerprint(tiny_model("llama").to(torch.bfloat16))
    assert model_fingerprint(llama) != model_fingerprint(tiny_model("llama", seed=1))


# ---------------------------------------------------------------- losslessness

NEW = 32


@pytest.fixture(scope="module", params=ARCHS)
def arch(request, tmp_path_factory):
    model = tiny_model(request.param)
    path = tmp_path_factory.mktemp(request.param)
    heads = {kind: save_random_heads(kind, model, path / kind) for kind in ("medusa", "ctc")}
    heads["ctc-slots"] = save_random_heads("ctc", model, path / "ctc-slots", slot_blocks=True)
    heads["ctc-refine"] = save_random_heads("ctc", model, path / "ctc-refine", slot_blocks=True, refine=True)
    prompts = [repetitive_prompt(24, 5, 0), repetitive_prompt(9, 4, 2), [5]]
    return model, heads, prompts, [reference_greedy(model, p, NEW) for p in prompts]


@pytest.mark.parametrize(
    "kind,params",
    [
        ("medusa", {}),
        ("medusa", {"ctc_transform": True, "tree_nodes": 24}),
        ("medusa", {"tree_choices": [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]}),
        ("ctc", {}),
        ("ctc", {"ctc_transform": False, "tree_nodes": 8}),
        ("ctc", {"tree": "mass", "tree_nodes": 12}),
        ("ctc", {"tree": "prefix", "tree_nodes": 12}),
        ("ctc", {"tree": "prefix", "top_k": 2, "tree_nodes": 20, "slot_blocks": True}),
        ("ctc", {"tree": "prefix", "tree_nodes": 12, "refine": True}),
    ],
)
def test_greedy_output_equals_plain_decoding(arch, kind, params):
    model, heads, prompts, refs = arch
    if params.pop("slot_blocks", False):
        heads = {kind: heads["ctc-slots"]}
    if params.pop("refine", False):
        heads = {kind: heads["ctc-refine"]}
    drafter = build_drafter(kind, target=model, heads=heads[kind], **params)
    drafted = 0
    for prompt, ref in zip(prompts, refs, strict=True):
        out, stats = generate_ids(model, prompt, drafter, NEW)
        assert out == ref
        drafted += stats.drafted_tokens
    assert drafted > 0


def test_the_heads_read_the_targets_hidden_state_before_the_root(llama, tmp_path):
    """What the drafter holds when it proposes is the target's last hidden state at every
    position before the root, as one full forward over the committed tokens computes it."""
    from speculum.drafters.medusa import MedusaDrafter

    seen = []

    class Recording(MedusaDrafter):
        def propose(self, ctx):
            seen.append((list(ctx.tokens), self.history.states.clone()))
            return super().propose(ctx)

    drafter = build_drafter("medusa", target=llama, heads=save_random_heads("medusa", llama, tmp_path / "m"))
    drafter.__class__ = Recording
    drafter.history.width = 6
    generate_ids(llama, repetitive_prompt(12, 4, 1), drafter, 20)
    assert len(seen) > 3
    for tokens, states in seen:
        with torch.no_grad():
            full = llama.model(torch.tensor([tokens[:-1]], device=llama.device)).last_hidden_state[0]
        torch.testing.assert_close(states, full[-len(states) :], rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------- training


@pytest.fixture(scope="module")
def speculum_llama(model_dir):
    import speculum

    return speculum.load(model_dir, dtype="float32", prepack=False)


def _toy_texts(tmp_path):
    """A learnable toy task: texts cycling through one of six short motifs (validation texts hold
    the same motifs, so what the heads learn carries over)."""
    gen = torch.Generator().manual_seed(0)
    motifs = [[f"w{i}" for i in torch.randint(3, VOCAB, (4,), generator=gen).tolist()] for _ in range(6)]
    path = tmp_path / "toy"
    path.mkdir()
    for i in range(40):
        (path / f"t{i}.txt").write_text(" ".join(motifs[i % 6] * 12))
    return str(path), motifs


@pytest.mark.parametrize(
    "kind,precision,standardize,noise,refine",
    [("medusa", "float32", False, 0.0, False), ("ctc", "float32", False, 0.2, False),
     ("ctc", "bfloat16", True, 0.0, False), ("ctc", "bfloat16", False, 0.0, True)],
)  # fmt: skip
def test_training_lowers_validation_loss_and_resumes(
    kind, precision, standardize, noise, refine, speculum_llama, tmp_path
):
    """Trains in float32 or in bfloat16 mixed precision (the forward autocast, as ``precision="auto"``
    does on a CPU with native bf16); the CTC module with its memory standardised too, or with noise
    on its training inputs, or with its refining second pass."""
    from speculum.training import draft_heads
    from speculum.training.texts import training_texts

    source, motifs = _toy_texts(tmp_path)
    texts = training_texts(source)
    out = tmp_path / "out"
    # a random model does not write the motifs, so every label counts here (not only those on its own path)
    settings = draft_heads.HeadSettings(kind, num_heads=3, slots=6, label_length=3, context=4, draft_vocab=48,
                                        epochs=6, lr=1e-2, batch_size=32, val_fraction=0.2,
                                        consistent=False, precision=precision,
                                        standardize=standardize, noise=noise, refine=refine)  # fmt: skip
    data, _ = draft_heads.load_or_make_data(speculum_llama, texts, draft_heads.DistillSettings(), out / "d.st")
    examples = draft_heads.Examples(data, settings.span, settings.context, consistent=False)
    vocab, coverage = draft_heads.choose_draft_vocab(data, 48)
    assert len(vocab) == 48 and 0.5 < coverage <= 1.0
    untrained = draft_heads.build_module(settings, data["hidden"].shape[1], vocab)
    untrained.projection.attach(speculum_llama.model.get_output_embeddings().weight)
    embeddings = speculum_llama.model.get_input_embeddings()
    _, val = draft_heads.split_by_text({"text": data["text"][examples.roots]}, 0.2, 0)
    before = draft_heads.evaluate(untrained, examples, examples.roots[val], embeddings, "cpu")
    module, history = draft_heads.run(speculum_llama, texts, out, draft_heads.DistillSettings(), settings,
                                      progress=False, log=lambda _: None)  # fmt: skip
    assert history[-1]["val_loss"] < 0.8 * before["val_loss"]
    assert history[-1]["val_accepted_prefix"] > before["val_accepted_prefix"]
    config = json.loads((out / "config.json").read_text())
    assert config["kind"] == kind and config["training"]["history"] == history
    assert config["training"]["precision"] == precision and config["training"]["settings"]["noise"] == noise
    if refine:  # the second pass learnt something of its own (it starts as the identity)
        assert config["shape"]["refine"] and module.choice_in.weight.abs().max() > 0
    if standardize:  # the statistics were measured and saved
        assert not torch.equal(module.hidden_std, torch.ones_like(module.hidden_std))
    if kind == "medusa":
        assert len(config["inference"]["topk_accuracy"]) == 3
    # resume: one more epoch from the checkpoint, the earlier epochs' metrics kept
    settings.epochs = 7
    _, resumed = draft_heads.run(speculum_llama, texts, out, draft_heads.DistillSettings(), settings,
                                 resume=True, progress=False, log=lambda _: None)  # fmt: skip
    assert len(resumed) == 7 and resumed[:6] == history
    # the trained heads draft, and stay exact
    prompt = speculum_llama.tokenizer(" ".join(motifs[1] * 3))["input_ids"]
    drafter = build_drafter(kind, target=speculum_llama.model, heads=str(out))
    ref = reference_greedy(speculum_llama.model, prompt, 24)
    got, stats = generate_ids(speculum_llama.model, prompt, drafter, 24)
    assert got == ref and stats.accepted_tokens > 0


def _path_data():
    """One text of 10 tokens whose labels follow it except after position 4 (the target would have
    written 99 where the text has 5)."""
    token = torch.arange(10)
    label = torch.cat([token[1:], torch.tensor([0])])
    label[4] = 99
    return {
        "hidden": torch.zeros(10, 2, dtype=torch.float16),
        "token": token,
        "label": label,
        "text": torch.zeros(10, dtype=torch.int32),
        "response": torch.ones(10, dtype=torch.bool),
    }


def test_noise_follows_each_dimensions_spread_and_leaves_padding_alone():
    from speculum.training import draft_heads

    spread = torch.tensor([0.0, 1.0, 10.0])
    batch = {"memory": torch.ones(4000, 2, 3), "padding": torch.zeros(4000, 2, dtype=torch.bool)}
    batch["padding"][:, 0] = True
    batch["memory"][:, 0] = 0.0
    draft_heads.add_noise(batch, spread, torch.Generator().manual_seed(0))
    memory = batch["memory"]
    assert torch.equal(memory[:, 0], torch.zeros(4000, 3))  # no hidden state there: stays zero
    assert torch.equal(memory[:, 1, 0], torch.ones(4000))  # no spread: no noise
    assert memory[:, 1, 1].std() == pytest.approx(1.0, rel=0.05) and memory[:, 1, 1].mean() == pytest.approx(1, abs=0.1)
    assert memory[:, 1, 2].std() == pytest.approx(10.0, rel=0.05)
    with pytest.raises(InvalidInputError, match="noise"):
        draft_heads.HeadSettings("medusa", noise=-0.1).check()


def test_mixed_precision_follows_the_device(monkeypatch):
    from speculum.training import draft_heads

    monkeypatch.setattr(machine, "cpu_has_fast_bf16", lambda: True)
    assert draft_heads.mixed_precision("auto", "cpu") is torch.bfloat16
    assert draft_heads.mixed_precision("float32", "cpu") is None
    monkeypatch.setattr(machine, "cpu_has_fast_bf16", lambda: False)
    assert draft_heads.mixed_precision("auto", "cpu") is None  # an AVX2 CPU emulates bf16: slower
    assert draft_heads.mixed_precision("bfloat16", "cpu") is torch.bfloat16
    with pytest.raises(InvalidInputError, match="precision"):
        draft_heads.HeadSettings("ctc", precision="fp8").check()


def test_labels_count_only_while_the_text_stays_on_the_targets_path():
    from speculum.heads import MedusaHeads
    from speculum.training.draft_heads import Examples, targets_of

    data = _path_data()
    examples = Examples(data, span=3, context=2)
    # how many tokens from t on are the target's own: 1..4 yes, 5 no (it said 99), 6..9 yes
    assert examples.run.tolist() == [0, 3, 3, 2, 1, 0, 3, 3, 2, 1]
    assert examples.roots.tolist() == [1, 2, 3, 4, 6, 7]  # roots are the target's own tokens
    whole = Examples(data, span=3, context=2, whole_span=True)  # CTC: all of a root's labels or none
    assert whole.roots.tolist() == [1, 2, 6, 7]
    heads = MedusaHeads(2, 3, torch.arange(100))
    targets = targets_of(heads, examples.batch(torch.tensor([3, 4, 6]), "cpu"))
    assert targets.tolist() == [[4, 99, -1], [99, -1, -1], [7, 8, 9]]  # past the text's detour: not learnt
    everything = Examples(data, span=3, context=2, consistent=False)  # the ablation: every label counts
    assert everything.roots.tolist() == [1, 2, 3, 4, 5, 6, 7]
    assert (targets_of(heads, everything.batch(everything.roots, "cpu")) >= 0).all()


def test_generated_data_is_the_targets_own_greedy_continuation(speculum_llama):
    from speculum.training.distill_data import DistillSettings, make_data
    from speculum.training.texts import TrainingText, encode, prompt_for_generation

    texts = [TrainingText("t", "", " ".join(f"w{i}" for i in range(3, 3 + n))) for n in (3, 9, 5)]
    settings = DistillSettings(max_tokens=64, generate=10, generate_batch=2)  # padded batches of unequal prompts
    data = make_data(speculum_llama, texts, settings, progress=False)
    eos = speculum_llama.eos_token_ids
    assert data["source"].tolist() == [int(t) % len(texts) for t in data["text"]]
    for index, text in enumerate(texts):
        as_written = data["token"][data["text"] == index].tolist()  # the text itself comes first, teacher-forced
        assert as_written == encode(speculum_llama.tokenizer, text, 64)[0]
        prompt = prompt_for_generation(speculum_llama, text)
        mine = data["text"] == len(texts) + index  # then the target's continuation of its prompt
        assert data["token"][mine][: len(prompt)].tolist() == prompt
        response = data["token"][mine & data["response"]].tolist()
        want = reference_greedy(speculum_llama.model, prompt, 10)
        cut = next((k + 1 for k, t in enumerate(want) if t in eos), len(want))
        assert response == want[:cut]
        # on the target's own text every label is the next token (teacher-forced = generated)
        labels = data["label"][mine].tolist()
        tokens = data["token"][mine].tolist()
        assert labels[len(prompt) - 1 : -1] == tokens[len(prompt) :]


def test_generation_continues_the_prompts_as_speculum_bench_lays_them_out(speculum_llama):
    from speculum.bench.datasets import load_dataset
    from speculum.training.texts import TrainingText, prompt_for_generation, training_texts

    chat = bool(getattr(speculum_llama.tokenizer, "chat_template", None))
    for name in ("gsm8k", "mbpp", "mt_bench", "wmt16", "humaneval"):
        text, prompt = training_texts(f"{name}[3:4]")[0], load_dataset(name, 4)[3]
        assert text.prompt == prompt  # the very prompt `speculum bench` sends
        wanted = speculum_llama.encode_prompt(prompt.render(prompt.chat_default and chat))
        assert prompt_for_generation(speculum_llama, text) == wanted
    plain = TrainingText("f", "", " ".join(["w5"] * 100))
    assert len(prompt_for_generation(speculum_llama, plain, plain_prefix=16)) == 16


def test_continuations_are_made_by_the_engine_and_resume_after_an_interruption(speculum_llama, tmp_path, monkeypatch):
    from speculum.training.distill_data import DistillSettings, continuations

    prompts = [[3, 4, 5], [7, 8, 9, 10, 11, 12], [5, 5, 6], [3, 4, 5]]  # the last: a repeat, made once
    settings = DistillSettings(generate=10, generate_batch=2)
    eos = speculum_llama.eos_token_ids

    def greedy(prompt):
        want = reference_greedy(speculum_llama.model, prompt, 10)
        return want[: next((k + 1 for k, t in enumerate(want) if t in eos), len(want))]

    batches = []
    generate = type(speculum_llama).generate

    def counting(self, prompt, *args, **kwargs):
        batches.append(len(prompt))
        return generate(self, prompt, *args, **kwargs)

    monkeypatch.setattr(type(speculum_llama), "generate", counting)
    cache = tmp_path / "continuations.jsonl"
    made = continuations(speculum_llama, prompts, settings, progress=False, cache=cache)
    assert made == [greedy(p) for p in prompts] and batches == [2, 1]  # batched engine rows
    lines = cache.read_text().splitlines()
    assert len(lines) == 3
    # an interrupted run: the last record torn mid-write, nothing after it
    cache.write_text("\n".join(lines[:2]) + "\n" + lines[2][: len(lines[2]) // 2])
    batches.clear()
    assert continuations(speculum_llama, prompts, settings, progress=False, cache=cache) == made
    assert batches == [1]  # only the torn one again
    batches.clear()
    assert continuations(speculum_llama, prompts, settings, progress=False, cache=cache) == made and batches == []
    # another length asked: other continuations
    longer = continuations(speculum_llama, prompts[:1], DistillSettings(generate=12), progress=False, cache=cache)
    assert batches == [1] and len(longer[0]) >= len(made[0])


def test_a_chat_templated_prompt_is_continued_as_a_raw_completion_too(model_dir):
    import speculum
    from speculum.bench.datasets import load_dataset
    from speculum.training.texts import generation_layouts, training_texts

    spec = speculum.load(model_dir, dtype="float32", prepack=False)
    text = training_texts("mt_bench[0:1]")[0]
    assert text.prompt.chat_default
    spec.tokenizer.chat_template = None  # a chat set, but a tokenizer without a template: one layout, raw
    assert generation_layouts(spec, text) == [spec.encode_prompt(text.prompt.render(False))]
    spec.tokenizer.chat_template = "{% for m in messages %}w3 {{ m['content'] }}{% endfor %} w4"
    chat, raw = generation_layouts(spec, text)
    prompt = load_dataset("mt_bench", 1)[0]
    assert chat == spec.encode_prompt(prompt.render(True)) and raw == spec.encode_prompt(prompt.render(False))
    assert chat != raw and generation_layouts(spec, text, raw=False) == [chat]
    code = training_texts("humaneval[0:1]")[0]  # a completion set: one layout
    assert len(generation_layouts(spec, code)) == 1


def test_the_draft_vocabulary_keeps_the_most_predicted_tokens():
    from speculum.training.draft_heads import choose_draft_vocab

    data = {
        "label": torch.tensor([5, 5, 5, 7, 7, 9, 1]),
        "token": torch.tensor([1, 2, 3, 4, 5, 6, 7]),
        "response": torch.tensor([True] * 6 + [False]),
    }
    vocab, coverage = choose_draft_vocab(data, 2)
    assert vocab.tolist() == [5, 7] and coverage == pytest.approx(5 / 6)


def test_the_draft_vocabulary_is_chosen_without_the_validation_texts(speculum_llama, tmp_path):
    """A token the target predicts only in the held-out texts must not enter the draft vocabulary."""
    from speculum.training import draft_heads
    from speculum.training.common import split_by_text
    from speculum.training.texts import training_texts

    source, _ = _toy_texts(tmp_path)
    data, _ = draft_heads.load_or_make_data(
        speculum_llama, training_texts(source), draft_heads.DistillSettings(), tmp_path / "d.st"
    )
    settings = draft_heads.HeadSettings("medusa", num_heads=2, draft_vocab=16, epochs=1, val_fraction=0.2,
                                        consistent=False)  # fmt: skip
    examples = draft_heads.Examples(data, settings.span, settings.context, consistent=False)
    _, val = split_by_text({"text": data["text"][examples.roots]}, settings.val_fraction, settings.seed)
    held_out = torch.isin(data["text"], torch.unique(data["text"][examples.roots[val]]))
    unseen = max(set(range(3, VOCAB)) - set(data["label"].tolist()) - set(data["token"].tolist()))
    data["label"] = data["label"].clone()
    data["label"][held_out & data["response"]] = unseen  # the target "says" it there, and only there
    module, _ = draft_heads.train(speculum_llama, data, settings, tmp_path / "out", progress=False, log=lambda _: None)
    assert unseen not in module.projection.draft_vocab.tolist()
    assert unseen in draft_heads.choose_draft_vocab(data, 16)[0].tolist()  # counted over everything, it would be


def test_loss_weighting_and_masks():
    from speculum.heads import MedusaHeads
    from speculum.training.draft_heads import loss_of, to_draft_index

    heads = MedusaHeads(8, 2, torch.tensor([3, 5, 9]))
    assert to_draft_index(heads, torch.tensor([[5, 4], [9, 3]])).tolist() == [[1, -1], [2, 0]]
    logits = torch.zeros(2, 2, 3)
    logits[:, 1, :] = torch.tensor([5.0, 0.0, 0.0])  # head 2 sure of index 0
    targets = torch.tensor([[1, 0], [2, 0]])
    ce0, ce1 = math.log(3), float(torch.nn.functional.cross_entropy(torch.tensor([[5.0, 0, 0]]), torch.tensor([0])))
    expected = (ce0 * 1 + ce1 * 0.8) / 1.8
    assert float(loss_of(heads, logits, targets)) == pytest.approx(expected, rel=1e-5)
    # a label outside the draft vocabulary carries no loss
    masked = torch.tensor([[1, -1], [2, -1]])
    assert float(loss_of(heads, logits, masked)) == pytest.approx(ce0 / 1.8, rel=1e-5)


def test_shipped_heads_are_found_by_the_targets_fingerprint(llama, tmp_path, monkeypatch):
    import speculum.heads as heads

    monkeypatch.setattr(heads, "BUNDLED", tmp_path / "shipped")
    save_random_heads("ctc", llama, tmp_path / "trained")
    from speculum.heads.checkpoint import load_checkpoint, save_checkpoint

    config, tensors = load_checkpoint(tmp_path / "trained", heads.WEIGHTS, heads.FORMAT, heads.VERSION, "draft-head")
    config.pop("weights_sha256")
    save_checkpoint(tmp_path / "shipped" / "tiny-ctc", heads.WEIGHTS, tensors, config, dtype=torch.bfloat16)
    drafter = build_drafter("ctc", target=llama)  # no heads=: the shipped module for this target
    assert drafter.module.slots == 6
    with pytest.raises(InvalidInputError, match="no medusa heads ship"):
        build_drafter("medusa", target=llama)  # only a ctc module ships here
    with pytest.raises(InvalidInputError, match="no ctc heads ship"):
        build_drafter("ctc", target=tiny_model("llama", seed=3))


def test_the_shipped_heads_are_intact():
    """Every checkpoint in the package loads (checksum, shape) and draws from its own draft vocabulary."""
    from speculum.heads import BUNDLED, WEIGHTS, load_draft_head

    for directory in sorted(p.parent for p in BUNDLED.glob("*/" + WEIGHTS)):
        config = json.loads((directory / "config.json").read_text())
        module = load_draft_head(directory, config["kind"])
        assert config["model_fingerprint"] and len(module.projection.draft_vocab) > 1000
        assert config["training"]["history"], "shipped heads record how they were trained"


def test_the_ctc_module_standardises_the_targets_hidden_states(llama, tmp_path):
    """The memory is standardised per dimension with the target's own statistics and the output
    mapped back before the frozen LM head; they travel in the checkpoint. A checkpoint from before
    them (no such buffers) loads as the identity: it drafts what it drafted."""
    from speculum.heads import FORMAT, VERSION, WEIGHTS, CTCDraftModule, load_draft_head, save_draft_head
    from speculum.heads.checkpoint import load_checkpoint, save_checkpoint

    torch.manual_seed(0)
    hidden = llama.config.hidden_size
    module = CTCDraftModule(hidden, torch.arange(VOCAB), 6, 3, 4, 2).eval()
    states = torch.randn(500, hidden) * torch.linspace(0.5, 40.0, hidden) + 3.0  # outlier dimensions
    module.standardize_on(states)
    assert torch.allclose(module.hidden_mean, states.mean(0)) and torch.allclose(module.hidden_std, states.std(0))
    save_draft_head(module, tmp_path / "new", llama)
    assert torch.equal(load_draft_head(tmp_path / "new", "ctc", llama).hidden_std, module.hidden_std)
    config, tensors = load_checkpoint(tmp_path / "new", WEIGHTS, FORMAT, VERSION, "draft-head")
    config.pop("weights_sha256")
    older = {name: tensor for name, tensor in tensors.items() if not name.startswith("hidden_")}
    save_checkpoint(tmp_path / "old", WEIGHTS, older, config)
    before = load_draft_head(tmp_path / "old", "ctc", llama)
    assert torch.equal(before.hidden_mean, torch.zeros(hidden)) and torch.equal(before.hidden_std, torch.ones(hidden))
    memory, root = states[:8].reshape(2, 4, hidden), torch.randn(2, hidden)
    with torch.no_grad():
        module.hidden_mean.zero_()
        module.hidden_std.fill_(1.0)
        module.projection.attach(llama.get_output_embeddings().weight)
        assert torch.allclose(before(memory, root), module(memory, root), atol=1e-5)


@pytest.mark.parametrize("kind", ["medusa", "ctc"])
def test_replay_with_recorded_hidden_states_matches_a_real_run(kind, llama, tmp_path):
    """speculum tune scores head drafters by exact replay: given the target's hidden states over
    prompt + greedy output, the replay reproduces a real run's trees and acceptance step by step."""
    from speculum.bench.replay import replay
    from speculum.runner import ModelRunner

    heads = save_random_heads(kind, llama, tmp_path / kind)
    prompt = repetitive_prompt(20, 4, 3)
    real, stats = generate_ids(llama, prompt, build_drafter(kind, target=llama, heads=heads), 24)
    runner = ModelRunner(llama)
    hidden = runner.prefill(runner.new_cache(), prompt + real, hidden=True)
    replayed = replay(prompt, real, build_drafter(kind, target=llama, heads=heads), hidden=hidden)
    assert replayed.draft_sizes == stats.draft_sizes and replayed.accept_lengths == stats.accept_lengths
    with pytest.raises(ValueError, match="hidden"):
        replay(prompt, real, build_drafter(kind, target=llama, heads=heads))


def test_cli_trains_both_kinds_on_one_generated_data_pass(model_dir, tmp_path):
    """Both trainers from the CLI on one data pass (--generate, --data), then the heads in use on a
    prepacked float32 target (what dtype="auto" picks on AVX2 CPUs): exact."""
    from typer.testing import CliRunner

    import speculum
    from speculum.cli import app

    def cli(*args):
        res = CliRunner().invoke(app, [str(a) for a in args])
        assert res.exit_code == 0, res.output
        return res.output

    texts = tmp_path / "q.jsonl"  # questions: the target continues them (--generate) beside the text itself
    texts.write_text("\n".join(json.dumps({"turns": [" ".join(f"w{i}" for i in range(3, n))]}) for n in range(8, 20)))
    common = ["--model", model_dir, "--texts", texts, "--generate", 8, "--max-tokens", 48, "--epochs", 1,
              "--draft-vocab", 32, "--batch-size", 16, "--dtype", "float32"]  # fmt: skip
    ctc, medusa = tmp_path / "ctc", tmp_path / "medusa"
    cli("train", "ctc-drafter", "--out", ctc, "--slots", 4, "--label-length", 2, *common)
    output = cli("train", "medusa", "--out", medusa, "--data", ctc / "distill_data.safetensors", *common)
    assert "cached" in output and not (medusa / "distill_data.safetensors").exists()
    spec = speculum.load(model_dir, dtype="float32")  # prepacked
    plain = spec.generate("w3 w4 w5", "autoregressive", max_new_tokens=12).token_ids
    for kind, out in (("ctc", ctc), ("medusa", medusa)):
        assert spec.generate("w3 w4 w5", kind, heads=str(out), max_new_tokens=12).token_ids == plain
        output = cli("generate", "w3 w4 w5", "--model", model_dir, "--dtype", "float32", "--method", kind,
                     "--param", f"heads={out}", "--max-new-tokens", 12, "--no-stream", "--json")  # fmt: skip
        assert json.loads(output.strip().splitlines()[-1])["token_ids"] == plain
    res = CliRunner().invoke(app, ["train", "medusa", "--model", model_dir, "--out", str(tmp_path), "--texts", "no"])
    assert res.exit_code == 2 and "unknown text source" in res.output

    # more texts later: a data pass over the new texts only, the earlier run's data appended
    more, extra = tmp_path / "more.jsonl", ctc / "distill_data.safetensors"
    more.write_text("\n".join(json.dumps({"turns": [" ".join(f"w{i}" for i in range(n, 30))]}) for n in range(5, 9)))
    common[common.index(texts)] = more
    output = cli("train", "medusa", "--out", tmp_path / "both", "--extra-data", extra, *common)
    assert "from --extra-data" in output
    info = json.loads((tmp_path / "both" / "config.json").read_text())["training"]["data"]
    from safetensors import safe_open

    with safe_open(str(extra), "pt") as f, safe_open(str(tmp_path / "both" / "distill_data.safetensors"), "pt") as g:
        assert info["positions"] == f.get_slice("label").get_shape()[0] + g.get_slice("label").get_shape()[0]
    args = ["train", "medusa", "--out", str(tmp_path / "x"), "--extra-data", "nowhere", *map(str, common)]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2 and "--extra-data nowhere: no such file" in res.output


@pytest.mark.parametrize("fast", [False, True])
def test_the_projection_drafts_in_bfloat16_where_the_cpu_computes_it_natively(fast, llama, monkeypatch):
    """Heads only propose: where bf16 is native the draft vocabulary's rows are kept in bf16 (the
    output stays in the caller's dtype); elsewhere in float32. Exactness is the tests above'."""
    from speculum.heads.projection import DraftVocabProjection

    monkeypatch.setattr(machine, "cpu_has_fast_bf16", lambda: fast)
    projection = DraftVocabProjection(torch.arange(VOCAB), llama.config.hidden_size)
    projection.attach(llama.get_output_embeddings().weight)
    hidden = torch.randn(3, llama.config.hidden_size)
    exact = projection(hidden)
    projection.for_inference()
    assert projection.weight.dtype == (torch.bfloat16 if fast else torch.float32)
    logits = projection(hidden)
    assert logits.dtype == torch.float32
    assert torch.allclose(logits, exact, atol=0.05 * exact.abs().max().item())
    if not fast and torch.backends.mkldnn.is_available():  # float32 rows prepacked: the same numbers
        assert projection.packed is not None
        assert torch.allclose(logits, exact, rtol=1e-5, atol=1e-5 * exact.abs().max().item())


def test_the_refining_pass_reads_the_first_passs_choices(llama):
    """With ``refine`` the module's second layer re-reads the frames with the embedding of each
    frame's top-1 choice (the target's, or the blank's own): it starts as the identity, it is fed
    exactly the first pass's choices, and the first pass does not depend on them."""
    from speculum.heads.ctc import CTCDraftModule

    torch.manual_seed(0)
    hidden, vocab = llama.config.hidden_size, torch.arange(3, VOCAB, 2)  # draft index != token id
    module = CTCDraftModule(hidden, vocab, slots=5, label_length=2, context=4, num_attention_heads=4,
                            slot_blocks=True, refine=True)  # fmt: skip
    module.projection.attach(llama.get_output_embeddings().weight)
    module.eval()
    memory, root = torch.randn(3, 4, hidden), torch.randn(3, hidden)
    seen = []

    def embed(tokens):
        seen.append(tokens.clone())
        return llama.get_input_embeddings()(tokens)

    with torch.no_grad():
        first, second = module(memory, root, embed=embed, every_pass=True)
        assert torch.equal(first, second)  # the identity start
        refining = (*module.refine_layer.parameters(), *module.choice_in.parameters(), module.blank_embedding)
        for parameter in refining:
            parameter.normal_(std=0.2)
        first = module(memory, root, embed=embed, every_pass=True)[0]
        module.blank.bias += (first[..., :-1].max(-1).values - first[..., -1]).median()  # some frames choose it
        seen.clear()
        first, second = module(memory, root, embed=embed, every_pass=True)
        choice = first.argmax(-1)
        blank = choice == module.blank_index
        assert blank.any() and not blank.all()
        assert torch.equal(seen[-1][~blank], vocab[choice[~blank]])  # target token ids, not draft indices
        assert not torch.allclose(first, second)
        assert torch.equal(module(memory, root, embed=embed), second)  # the drafts come from the last pass
        shifted = module(memory, root, embed=lambda t: llama.get_input_embeddings()(t) + 1.0, every_pass=True)
        assert torch.equal(shifted[0], first) and not torch.allclose(shifted[1], second)
        module.blank_embedding.zero_()  # the blank's frames read the blank's own embedding
        assert not torch.allclose(module(memory, root, embed=embed), second)
    with pytest.raises(ValueError, match="embed"):
        module(memory, root)


@pytest.mark.parametrize("padded,refine", [(False, False), (True, False), (True, True)])
def test_the_ctc_modules_packed_layer_computes_what_the_stock_layer_does(padded, refine, llama, monkeypatch):
    """In float32 on a CPU without native bf16 the CTC module drafts through a copy of its layer
    with prepacked matrices (speculum.heads.ctc.PackedDecoderLayer): same outputs, rounding aside,
    with and without padded memory, for the whole module too."""
    from speculum.heads.ctc import CTCDraftModule

    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN in this torch build")
    monkeypatch.setattr(machine, "cpu_has_fast_bf16", lambda: False)
    torch.manual_seed(0)
    hidden = llama.config.hidden_size
    module = CTCDraftModule(hidden, torch.arange(VOCAB), slots=4, label_length=2, context=6, num_attention_heads=4,
                            refine=refine)  # fmt: skip
    embed = llama.get_input_embeddings() if refine else None
    with torch.no_grad():
        for parameter in module.parameters():  # away from the identity start, so every branch counts
            parameter.add_(0.05 * torch.randn_like(parameter))
    module.projection.attach(llama.get_output_embeddings().weight)
    module.eval()
    memory, root = torch.randn(2, 6, hidden), torch.randn(2, hidden)
    padding = torch.zeros(2, 6, dtype=torch.bool)
    if padded:
        padding[1, :3] = True  # the second text began three positions ago
    with torch.inference_mode():
        stock = module(memory, root, padding if padded else None, embed=embed)
        assert not module.for_inference() and module.packed_layer is not None
        assert (module.packed_refine_layer is not None) == refine
        packed = module(memory, root, padding if padded else None, embed=embed)
    assert "packed_layer" not in "".join(module.state_dict())  # an inference copy, never saved
    assert torch.allclose(packed, stock, rtol=1e-4, atol=1e-4 * stock.abs().max().item())


def test_extra_data_files_are_appended_with_their_texts_kept_apart(speculum_llama, tmp_path):
    """--extra-data: data made by earlier runs is trained on too, its sequences and sources
    renumbered after this run's (so the validation split still holds whole sources out), and a file
    that is not distillation data for this target is refused with a clear error."""
    from safetensors.torch import save_file

    from speculum.errors import InvalidInputError
    from speculum.training.distill_data import DATA_COLUMNS, append_data

    hidden = speculum_llama.model.config.hidden_size

    def data(n_texts, per_text, size=hidden):
        n = n_texts * per_text
        text = torch.arange(n_texts, dtype=torch.int32).repeat_interleave(per_text)
        return {"hidden": torch.randn(n, size).half(), "label": torch.randint(0, VOCAB, (n,)),
                "token": torch.randint(0, VOCAB, (n,)), "text": text, "source": text // 2,
                "response": torch.ones(n, dtype=torch.bool)}  # fmt: skip

    own, earlier = data(4, 3), data(6, 2)
    save_file(earlier, str(tmp_path / "earlier.safetensors"))
    merged = append_data(speculum_llama, own, [tmp_path / "earlier.safetensors"])
    assert len(merged["label"]) == 12 + 12
    for name in DATA_COLUMNS:
        assert torch.equal(merged[name][:12], own[name])
    assert torch.equal(merged["hidden"][12:], earlier["hidden"]) and torch.equal(merged["label"][12:], earlier["label"])
    assert set(merged["text"][12:].tolist()) == {4, 5, 6, 7, 8, 9}  # after own texts 0..3
    assert set(merged["source"][12:].tolist()) == {2, 3, 4}  # after own sources 0..1
    assert append_data(speculum_llama, own, []) is own

    save_file(data(2, 2, size=hidden + 1), str(tmp_path / "other.safetensors"))
    with pytest.raises(InvalidInputError, match="another target"):
        append_data(speculum_llama, own, [tmp_path / "other.safetensors"])
    save_file({"hidden": torch.zeros(2, hidden)}, str(tmp_path / "partial.safetensors"))
    with pytest.raises(InvalidInputError, match="not a distillation data file"):
        append_data(speculum_llama, own, [tmp_path / "partial.safetensors"])
    (tmp_path / "junk.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(InvalidInputError, match="not a readable data file"):
        append_data(speculum_llama, own, [tmp_path / "junk.safetensors"])


def test_an_interrupted_data_pass_resumes_after_its_last_saved_part(speculum_llama, tmp_path, monkeypatch):
    """The data pass is saved in parts as it goes: after an interruption no whole file exists, the
    next run makes only the sequences after the last saved part, its data equals an uninterrupted
    run's, and the parts go once the whole file is written. Parts made for other inputs are not used."""
    import shutil

    from speculum.training import distill_data
    from speculum.training.distill_data import DATA_COLUMNS, DistillSettings, PartialData, load_or_make_data
    from speculum.training.texts import TrainingText

    texts = [TrainingText("t", "", " ".join(f"w{i}" for i in range(3, 3 + n))) for n in (3, 9, 5, 7, 4, 8, 6)]
    settings = DistillSettings(max_tokens=64)
    monkeypatch.setattr(distill_data, "PART_TEXTS", 2)
    whole, _ = load_or_make_data(speculum_llama, texts, settings, tmp_path / "clean" / "d.st", progress=False)

    body = speculum_llama.model.model  # the decoder both of the data pass's paths run (with or without the head)
    forward, calls = body.forward, []

    def counted(*args, interrupt_at=None, **kwargs):
        calls.append(1)
        if len(calls) == interrupt_at:
            raise KeyboardInterrupt
        return forward(*args, **kwargs)

    cache = tmp_path / "run" / "d.st"
    monkeypatch.setattr(body, "forward", lambda *a, **k: counted(*a, interrupt_at=6, **k))
    with pytest.raises(KeyboardInterrupt):  # in the sixth sequence: sequences 0-1 and 2-3 saved, 4 lost
        load_or_make_data(speculum_llama, texts, settings, cache, progress=False)
    folder = tmp_path / "run" / "d.st.parts"
    assert not cache.exists() and len(list(folder.glob("part-*.safetensors"))) == 2

    shutil.copytree(folder, tmp_path / "stale")  # the same parts offered to other inputs: removed, not used
    stop, columns = PartialData(tmp_path / "stale", "another key").load()
    assert stop == 0 and columns["label"] == [] and not list((tmp_path / "stale").iterdir())

    calls.clear()
    monkeypatch.setattr(body, "forward", lambda *a, **k: counted(*a, **k))
    data, cached = load_or_make_data(speculum_llama, texts, settings, cache, progress=False)
    assert not cached and len(calls) == 3  # sequences 4, 5 and 6 only
    for name in DATA_COLUMNS:
        assert torch.equal(data[name], whole[name]), name
    assert cache.exists() and not folder.exists()


def test_a_data_file_named_with_data_is_never_replaced_by_other_inputs(speculum_llama, tmp_path):
    """--data names a data file to use: made from other texts than the command's, it is refused with
    a clear error (not remade over: it may hold an hour of data passes); --regenerate remakes it."""
    from speculum.errors import InvalidInputError
    from speculum.training.draft_heads import DistillSettings, load_or_make_data
    from speculum.training.texts import TrainingText

    texts = [TrainingText("t", "", " ".join(f"w{i}" for i in range(3, 3 + n))) for n in (3, 9, 5)]
    settings = DistillSettings(max_tokens=64)
    file = tmp_path / "d.safetensors"
    made, cached = load_or_make_data(speculum_llama, texts, settings, file, progress=False, given=True)
    assert not cached and file.exists()
    again, cached = load_or_make_data(speculum_llama, texts, settings, file, progress=False, given=True)
    assert cached and torch.equal(again["label"], made["label"])
    before = file.read_bytes()
    with pytest.raises(InvalidInputError, match="--extra-data"):
        load_or_make_data(speculum_llama, texts[:2], settings, file, progress=False, given=True)
    assert file.read_bytes() == before
    # not named by the user (the cache in --out): remade for the new inputs, as before
    fewer, cached = load_or_make_data(speculum_llama, texts[:2], settings, file, progress=False)
    assert not cached and len(fewer["label"]) < len(made["label"])
    remade, cached = load_or_make_data(
        speculum_llama, texts, settings, file, regenerate=True, progress=False, given=True
    )
    assert not cached and torch.equal(remade["label"], made["label"])
