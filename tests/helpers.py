"""Shared test helpers: run the engine directly on token ids, and a drafter that proposes trees."""

from __future__ import annotations

import random
from collections import Counter

import torch

from speculum import engine
from speculum.drafters.base import Draft, DraftContext, Drafter, Resources
from speculum.methods import SpeculativeConfig
from speculum.runner import ModelRunner
from speculum.sampling import SamplingParams
from speculum.stats import Stats


def build_drafter(method: str, draft_model=None, vocab_size: int = 64, target=None, **params):
    config = SpeculativeConfig(method, **params)
    model = target if target is not None else draft_model  # heads and sampling where the model's outputs are
    device = model.device if model is not None else torch.device("cpu")
    resources = Resources(
        target=target, draft_model=draft_model, vocab_size=vocab_size, model_key="test", device=device
    )
    return config.drafter_class()(config.options(), resources)


def generate_ids(
    model, prompt, drafter, max_new_tokens=32, sampling=None, generator=None, eos=frozenset(), lazy_head=None,
    noise=None,
):  # fmt: skip
    stats = Stats()
    runner = ModelRunner(model, lazy_head=lazy_head)
    steps = engine.run(
        runner, prompt, drafter, sampling or SamplingParams(), max_new_tokens, eos, generator, stats, noise=noise
    )
    return [t for step in steps for t in step], stats


class RandomTreeDrafter(Drafter):
    """Proposes random trees that contain a partly-correct branch (from a known continuation).

    Exercises tree masks, per-node positions and keep-path on whatever branch the verifier picks.
    """

    name = "random_tree"

    def __init__(self, truth: list[int], vocab_size: int, seed: int = 0, max_nodes: int = 12):
        self.truth = truth  # the reference continuation (prompt excluded)
        self.vocab = vocab_size
        self.rng = random.Random(seed)
        self.max_nodes = max_nodes

    def start(self, ctx: DraftContext) -> None:
        self.prompt_length = ctx.prompt_length

    def propose(self, ctx: DraftContext) -> Draft | None:
        done = len(ctx.tokens) - self.prompt_length
        right = self.truth[done : done + self.rng.randint(0, 5)]
        if right and self.rng.random() < 0.5:  # spoil the correct branch part way
            right[self.rng.randrange(len(right))] = self.rng.randrange(self.vocab)
        tokens, parents = [], []
        for i, tok in enumerate(right):
            tokens.append(tok)
            parents.append(i - 1)
        while len(tokens) < self.max_nodes:  # random side branches hanging anywhere
            parent = self.rng.randrange(-1, len(tokens))
            siblings = {tokens[i] for i, p in enumerate(parents) if p == parent}
            tok = self.rng.randrange(self.vocab)
            if tok not in siblings:
                tokens.append(tok)
                parents.append(parent)
        return Draft(tokens, parents)


def markov_logits(table: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    """A bigram 'target': the logits after each token are log table[token]."""
    return torch.log(table[torch.tensor(tokens)])


def brute_counts(seqs, min_n=2, max_n=5):
    """Recount every n-gram lying inside one of ``seqs``, from scratch."""
    counts = Counter()
    for seq in seqs:
        for n in range(min_n, max_n + 1):
            for i in range(n - 1, len(seq)):
                counts[tuple(seq[i - n + 1 : i + 1])] += 1
    return dict(counts)


def repetitive(rng, length, vocab=12):
    """Random tokens with copies of earlier spans (what n-gram drafting feeds on)."""
    seq = [rng.randrange(vocab) for _ in range(8)]
    while len(seq) < length:
        if rng.random() < 0.5 and len(seq) > 10:
            a = rng.randrange(len(seq) - 6)
            seq.extend(seq[a : a + rng.randrange(2, 6)])
        else:
            seq.append(rng.randrange(vocab))
    return seq[:length]


def save_random_heads(kind: str, target, path, seed: int = 0, **shape):
    """Untrained Medusa heads / CTC module for ``target`` (random, not zero, weights) saved at ``path``:
    their drafts are arbitrary, which is all a losslessness test needs."""
    from speculum.heads import CTCDraftModule, MedusaHeads, save_draft_head

    torch.manual_seed(seed)
    hidden = target.config.hidden_size
    vocab = torch.arange(target.get_output_embeddings().weight.shape[0])
    if kind == "medusa":
        module = MedusaHeads(hidden, shape.get("num_heads", 3), vocab)
        for p in module.parameters():
            torch.nn.init.normal_(p, std=0.5)
    else:
        module = CTCDraftModule(hidden, vocab, shape.get("slots", 6), shape.get("label_length", 3), 4, 2,
                                slot_blocks=shape.get("slot_blocks", False),
                                refine=shape.get("refine", False))  # fmt: skip
        if module.slot_blocks:  # (they start at zero)
            torch.nn.init.normal_(module.slot_weight, std=0.2)
        if module.refine:  # (the second pass starts as the identity)
            refining = (*module.refine_layer.parameters(), *module.choice_in.parameters(), module.blank_embedding)
            for parameter in refining:
                torch.nn.init.normal_(parameter, std=0.2)
    save_draft_head(module, path, target)
    return str(path)


def slow_catch_up(drafter, seconds: float = 0.3) -> None:
    """Make ``drafter`` (a draft model's) catch up ``seconds`` slower, and say so in its
    ``catch_up_seconds``, in every round where it catches up at all (its prefill, first)."""
    import time

    propose = drafter.propose

    def slower(ctx):
        draft = propose(ctx)
        if drafter.catch_up_seconds > 0:
            start = time.perf_counter()
            time.sleep(seconds)
            # what the sleep took (a loaded machine oversleeps), so the engine's split stays exact
            drafter.catch_up_seconds += time.perf_counter() - start
        return draft

    drafter.propose = slower


def fit_pvalue(counts: dict, exact: dict, trials: int) -> float:
    """Chi-square goodness of fit of observed output ``counts`` to the ``exact`` probabilities: the
    outcomes expected at least 5 times each, the rest pooled into one bin."""
    from scipy.stats import chisquare

    keep = [k for k, p in exact.items() if p * trials >= 5]
    observed = [counts[k] for k in keep] + [trials - sum(counts[k] for k in keep)]
    expected = [exact[k] * trials for k in keep]
    expected.append(trials - sum(expected))
    return chisquare(observed, expected)[1]
