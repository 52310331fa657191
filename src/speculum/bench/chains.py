"""Draft chains from every round start, for acceptance-only studies of length policies.

A length policy (fixed K, confidence, SpecDec++, the oracle...) only decides where a draft model's
chain stops. Greedy, the chain the draft writes from a round start depends on nothing but the
committed tokens there, and along a recorded output those are the output's prefixes. So one
batched pass computes, for *every* position of a recorded output, the chain the draft would write
from there (tokens, the draft's confidence, its hidden states) and how far the target accepts it;
then :func:`simulate` plays any policy over those chains in pure Python, with the real policy
objects and the engine's bookkeeping (budget, bonus token, forward counts). Dozens of policy
settings then cost one draft pass instead of one full replay each.

- Greedy (``sampling=None``): candidate s is accepted iff it equals the recorded output there (the
  target's greedy output), as in exact replay (:mod:`speculum.bench.replay`); :func:`simulate` then
  reproduces a real greedy run's acceptance exactly, up to the batched forwards' rounding (the
  chains come from forwards over many rows at once, single-token forwards at inference).
- Sampling: the draft samples its chain under the inference warping and the target scores it
  (one batched tree forward); candidate s is accepted with probability min(1, p/q) given the earlier
  ones were, as in speculative sampling. :func:`simulate` draws those events and continues along
  the recorded (sampled) output: an approximation (the realised output would follow the accepted
  draft tokens instead), the same one SpecDec++'s own training data makes.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from speculum.policies import DraftStep, LengthPolicy, OracleStop
from speculum.runner import ModelRunner, with_cache
from speculum.sampling import SamplingParams, warp


@dataclass
class Chains:
    """Draft chains from every round start of one recorded output.

    Row r is the round that starts with ``prompt_length + r`` tokens committed; column s (0-based)
    is the chain's (s+1)-th token.
    """

    sequence: list[int]  # the prompt followed by the recorded output
    prompt_length: int
    tokens: torch.Tensor  # [R, M] the draft's chain from each start
    confidence: torch.Tensor  # [R, M] the draft's probability of its own token (warped when sampling)
    accept: torch.Tensor  # [R, M] P(candidate s accepted | candidates < s were): 0/1 when greedy
    hidden: torch.Tensor | None  # [R, M, H] the draft's last hidden state where candidate s is the input
    first_hidden: torch.Tensor | None = None  # [R, H] the state that produced each chain's first candidate

    @property
    def rows(self) -> int:
        return self.tokens.shape[0]

    @property
    def max_draft(self) -> int:
        return self.tokens.shape[1]


class _Confidence:
    """Stands in for a probability vector in a DraftStep: only the chain token's entry is known."""

    def __init__(self, token: int, value: float):
        self.token, self.value = token, value

    def __getitem__(self, token: int) -> float:
        assert token == self.token
        return self.value


def _forward(runner: ModelRunner, cache, ids: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor):
    """Hidden states and logits of ``ids`` appended to ``cache``, each row seeing what ``allowed`` says."""
    mask = runner.attention_mask(allowed, positions)
    inputs = dict(
        input_ids=ids[None].to(runner.input_device), use_cache=True, **with_cache(runner.model, cache),
        attention_mask=mask, position_ids=positions[None].to(runner.input_device),
    )  # fmt: skip
    if runner.split_head:
        states = runner.model.model(**inputs).last_hidden_state[0]
        return states, runner._head(states).float()
    out = runner.model(**inputs, output_hidden_states=True)
    return out.hidden_states[-1][0], out.logits[0].float()


def _next(logits: torch.Tensor, sampling: SamplingParams | None, generator, vocab: int | None):
    """Each row's next chain token and the draft's probability of it (warped when sampling)."""
    if vocab is not None and logits.shape[-1] > vocab:
        logits = logits[:, :vocab]
    if sampling is None:
        probs = torch.softmax(logits, dim=-1)
        token = logits.argmax(-1)
    else:
        probs = warp(logits, sampling)
        token = torch.multinomial(probs, 1, generator=generator)[:, 0]
    return token, probs.gather(1, token[:, None])[:, 0]


@torch.inference_mode()
def draft_chains(
    draft_model: torch.nn.Module,
    prompt_ids: list[int],
    output_ids: list[int],
    max_draft: int = 20,
    *,
    target_model: torch.nn.Module | None = None,
    sampling: SamplingParams | None = None,
    generator: torch.Generator | None = None,
    hidden: bool = True,
    batch: int = 64,
) -> Chains:
    """The draft's chain of ``max_draft`` tokens from every round start along ``output_ids``.

    Greedy when ``sampling`` is None; otherwise the chains are sampled and ``target_model`` gives
    the acceptance probabilities. ``batch`` round starts share each forward.
    """
    if sampling is not None and target_model is None:
        raise ValueError("sampled chains need the target model for their acceptance probabilities")
    runner = ModelRunner(draft_model, lazy_head=False)
    sequence = list(prompt_ids) + list(output_ids)
    n_prompt, length, rows = len(prompt_ids), len(sequence), len(output_ids)
    vocab = target_model.get_output_embeddings().out_features if target_model is not None else None
    device = runner.input_device
    cache = runner.new_cache()
    # The prefill gives every start's first candidate (the logits at the position before it).
    states = runner.prefill(cache, sequence, hidden=True)
    first_logits = runner._head(states[n_prompt - 1 : length - 1]).float()
    tokens = torch.zeros(rows, max_draft, dtype=torch.long)
    confidence = torch.zeros(rows, max_draft)
    hiddens = torch.zeros(rows, max_draft, states.shape[-1], dtype=torch.float16) if hidden else None
    first_hidden = states[n_prompt - 1 : length - 1].to(torch.float16).cpu() if hidden else None
    for lo in range(0, rows, batch):
        hi = min(rows, lo + batch)
        starts = torch.arange(n_prompt + lo, n_prompt + hi)  # committed tokens at each round start
        b = hi - lo
        token, conf = _next(first_logits[lo:hi], sampling, generator, vocab)
        allowed = torch.arange(length)[None, :] < starts[:, None]  # [b, length] each start's own prefix
        for s in range(max_draft):
            tokens[lo:hi, s], confidence[lo:hi, s] = token.cpu(), conf.cpu()
            if s == max_draft - 1 and not hidden:
                break
            # feed candidate s+1 of every chain; each sees its start's prefix and its own chain
            mask = torch.cat([allowed, _chain_cols(b, s + 1)], 1)
            states, logits = _forward(runner, cache, token.to(device), (starts + s).to(device), mask.to(device))
            if hidden:
                hiddens[lo:hi, s] = states.to(torch.float16).cpu()
            if s < max_draft - 1:
                token, conf = _next(logits, sampling, generator, vocab)
        runner.crop(cache, length)
    if sampling is None:
        accept = _greedy_accept(tokens, sequence, n_prompt)
    else:
        # q is the chain token's confidence: the draft's (warped) probability of it
        accept = _sampled_accept(target_model, sequence, n_prompt, tokens, confidence, sampling, batch)
    return Chains(sequence, n_prompt, tokens, confidence, accept, hiddens, first_hidden)


def _chain_cols(b: int, steps: int) -> torch.Tensor:
    """[b, b * steps]: row j may see column t*b + j (its own chain's t-th token) for every step t."""
    cols = torch.arange(b * steps) % b
    return cols[None, :] == torch.arange(b)[:, None]


def _greedy_accept(tokens: torch.Tensor, sequence: list[int], n_prompt: int) -> torch.Tensor:
    rows, depth = tokens.shape
    padded = torch.tensor(sequence + [-1] * depth)
    index = n_prompt + torch.arange(rows)[:, None] + torch.arange(depth)[None, :]
    return (tokens == padded[index]).float()


@torch.inference_mode()
def _sampled_accept(target_model, sequence, n_prompt, tokens, draft_probs, sampling, batch) -> torch.Tensor:
    """min(1, p/q) of every candidate, p from one target forward over a batch of chains (a forest)."""
    runner = ModelRunner(target_model, lazy_head=False)
    device = runner.input_device
    rows, depth = tokens.shape
    length = len(sequence)
    cache = runner.new_cache()
    states = runner.prefill(cache, sequence, hidden=True)
    first = warp(runner._head(states[n_prompt - 1 : length - 1]), sampling)
    target_probs = torch.zeros(rows, depth)
    target_probs[:, 0] = first.gather(1, tokens[:, :1].to(first.device))[:, 0].cpu()
    per = max(1, batch // max(1, depth - 1))
    for lo in range(0, rows, per):
        hi = min(rows, lo + per)
        b, n = hi - lo, depth - 1
        if n == 0:
            break
        starts = torch.arange(n_prompt + lo, n_prompt + hi)
        ids = tokens[lo:hi, :n].reshape(-1)  # chain j's candidates 1..M-1, row-major
        positions = (starts[:, None] + torch.arange(n)[None, :]).reshape(-1)
        owner = torch.arange(b).repeat_interleave(n)
        step = torch.arange(n).repeat(b)
        prefix = torch.arange(length)[None, :] < starts[owner][:, None]
        chain = (owner[:, None] == owner[None, :]) & (step[None, :] <= step[:, None])
        _, logits = _forward(
            runner, cache, ids.to(device), positions.to(device), torch.cat([prefix, chain], 1).to(device)
        )
        probs = warp(logits, sampling)
        p = probs.gather(1, tokens[lo:hi, 1:].reshape(-1, 1).to(probs.device))[:, 0].cpu()
        target_probs[lo:hi, 1:] = p.view(b, n)
        runner.crop(cache, length)
    return torch.clamp(target_probs / draft_probs.clamp_min(1e-30), max=1.0)


@dataclass
class Totals:
    new_tokens: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    target_forwards: int = 0
    draft_forwards: int = 0
    head_calls: int = 0  # SpecDec++'s head evaluations (as the policy counts them)
    draft_sizes: list[int] = field(default_factory=list)  # candidates verified per target forward

    def add(self, other: Totals) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))


def simulate(
    chains: Chains,
    policy: LengthPolicy,
    *,
    eos_token_ids=frozenset(),
    rng: random.Random | None = None,
) -> Totals:
    """Play ``policy`` over ``chains`` as the draft_model drafter and the engine would, round by round.

    Greedy chains give the exact acceptance of a greedy run; sampled ones draw each round's
    acceptance events from ``rng``. ``policy`` is a fresh (or reset) policy object.
    """
    rng = rng or random.Random(0)
    totals = Totals()
    max_new = chains.rows
    oracle = isinstance(policy, OracleStop)
    policy.reset()
    row = 0
    while totals.new_tokens < max_new:
        max_depth = max_new - totals.new_tokens - 1
        start = chains.prompt_length + row
        policy.begin_round(chains.sequence[:start])
        budget = min(policy.budget(max_depth), chains.max_draft)
        passes = chains.accept[row]
        accepted_events = [rng.random() < float(a) if 0.0 < a < 1.0 else bool(a >= 1.0) for a in passes.tolist()]
        first_reject = next((i for i, ok in enumerate(accepted_events) if not ok), len(accepted_events))
        drafted = 0
        forwards = 1 if budget >= 1 else 0
        if budget >= 1:
            for position in range(chains.max_draft):
                token = int(chains.tokens[row, position])
                hidden = None  # as in the drafter: the state of the forward that produced this token
                if chains.hidden is not None:
                    hidden = chains.hidden[row, position - 1] if position > 0 else chains.first_hidden[row]
                step = DraftStep(
                    position, token, None, _Confidence(token, float(chains.confidence[row, position])), hidden
                )
                if oracle and position >= first_reject:
                    break
                if not oracle and policy.stop_before(step):
                    break
                drafted += 1
                if drafted >= budget or token in eos_token_ids:
                    break
                if policy.should_stop(step):
                    break
                forwards += 1
        accepted = min(drafted, first_reject)
        policy.update(accepted, drafted)
        totals.drafted_tokens += drafted
        totals.accepted_tokens += accepted
        totals.target_forwards += 1
        totals.draft_sizes.append(drafted)
        totals.draft_forwards += forwards
        produced = min(accepted + 1, max_new - totals.new_tokens)
        totals.new_tokens += produced
        row += produced
        if chains.sequence[chains.prompt_length + row - 1] in eos_token_ids:
            break
    totals.head_calls = getattr(policy, "head_calls", 0)
    return totals
