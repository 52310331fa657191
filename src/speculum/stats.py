"""Stats: the speculation statistics of one generation call (vLLM's names where they exist)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class Stats:
    """Speculation statistics of one generation call (vLLM's names where they exist)."""

    new_tokens: int = 0
    prompt_tokens: int = 0
    target_forwards: int = 0  # verification forwards (the prefill is not counted)
    draft_forwards: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    accept_lengths: list[int] = field(default_factory=list)  # tokens committed per target forward
    draft_sizes: list[int] = field(default_factory=list)  # draft tokens verified per target forward
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    time_prefill: float = 0.0
    time_draft: float = 0.0
    # of time_draft: a draft model catching up on committed text (its prefill of the prompt, the
    # tokens of plain rounds); the controller judges rounds without it (Drafter.catch_up_seconds)
    time_draft_catch_up: float = 0.0
    time_verify: float = 0.0
    time_other: float = 0.0
    wall_time: float = 0.0
    stop_reason: str = ""
    # the controller (speculum.controller), when on: rounds that asked the drafter, plain rounds it
    # chose instead, draft nodes it did not verify (and rounds it verified whole to learn), its own
    # time, and what it expected of the rounds that asked (committed tokens, seconds) beside what
    # they gave (tokens, seconds)
    rounds_drafted: int = 0
    rounds_plain: int = 0
    nodes_pruned: int = 0
    rounds_explored: int = 0  # rounds verified whole to learn of nodes pruning would drop
    chains_stopped: int = 0  # rounds whose draft chain it ended before the length policy did (ChainStop)
    time_control: float = 0.0
    predicted_tokens: float = 0.0
    predicted_time: float = 0.0
    drafted_round_tokens: int = 0
    drafted_round_time: float = 0.0
    # accepted draft tokens by the drafter that proposed them (drafts composed by ``auto``)
    accepted_by: dict[str, int] = field(default_factory=dict)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens added per target forward, counting the bonus token (1.0 for plain decoding)."""
        return sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else 0.0

    @property
    def draft_acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def acceptance_per_position(self) -> list[float]:
        """Share of steps that drafted at depth d whose depth-d token was accepted."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position, strict=True)]

    @property
    def discard_rate(self) -> float:
        """SpecDec++: discarded draft tokens per generated token."""
        return (self.drafted_tokens - self.accepted_tokens) / self.new_tokens if self.new_tokens else 0.0

    @property
    def verification_rate(self) -> float:
        """SpecDec++: target forwards per generated token."""
        return self.target_forwards / self.new_tokens if self.new_tokens else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.wall_time if self.wall_time else 0.0

    @property
    def predicted_tokens_per_second(self) -> float:
        """What the controller expected of the rounds that drafted (their verification forwards)."""
        return self.predicted_tokens / self.predicted_time if self.predicted_time else 0.0

    @property
    def drafted_tokens_per_second(self) -> float:
        """What the rounds that drafted gave, drafting time included."""
        return self.drafted_round_tokens / self.drafted_round_time if self.drafted_round_time else 0.0

    def to_dict(self) -> dict:
        out = asdict(self)
        for name in (
            "mean_acceptance_length",
            "draft_acceptance_rate",
            "acceptance_per_position",
            "discard_rate",
            "verification_rate",
            "tokens_per_second",
            "predicted_tokens_per_second",
            "drafted_tokens_per_second",
        ):
            out[name] = getattr(self, name)
        return out

    def count_step(self, drafted: int, deepest: int, accepted: int, committed: int) -> None:
        """One verification forward: ``drafted`` tree nodes below the root, the deepest at depth
        ``deepest``, ``accepted`` of them on the accepted path, ``committed`` tokens added."""
        self.target_forwards += 1
        self.drafted_tokens += drafted
        self.draft_sizes.append(drafted)
        self.accepted_tokens += accepted
        self.accept_lengths.append(committed)
        while len(self.drafted_per_position) < deepest:
            self.drafted_per_position.append(0)
            self.accepted_per_position.append(0)
        for d in range(deepest):
            self.drafted_per_position[d] += 1
            self.accepted_per_position[d] += d < accepted
