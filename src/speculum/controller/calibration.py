"""P(a draft node is accepted | its parent was), learnt online from what the target accepted, per
bin of what the drafter says of the node and corrected per drafter."""

from __future__ import annotations

from dataclasses import dataclass, field

from speculum.tree import Draft, TokenTree

BINS = 10  # calibration bins over a drafter's score in [0, 1]
DEPTH_BINS = 8  # for unscored nodes: one bin per depth, the last for everything deeper
SCORED_DEPTH_BINS = 3  # for scored nodes: depth 1, 2, and 3 or deeper


@dataclass
class Calibration:
    """P(node accepted | parent accepted) per bin of what the drafter says (its score, or the node's
    depth within its source's run when it gives none: see :func:`source_depths`): a Beta posterior
    per bin, its prior centred on the score itself (the drafter's own belief) or on 0.5, with old
    evidence slowly forgotten so the estimate follows the request in flight; times a correction per
    source, learnt from all of that source's nodes at once (see ``by_source``)."""

    prior_strength: float = 2.0
    forget: float = 0.995  # evidence weight kept per update (~200 verified nodes of memory)
    counts: dict[tuple, list[float]] = field(default_factory=dict)  # bin -> [accepted, rejected]
    # per source, its verified nodes' [accepted, estimated] (decayed by ``source_forget``): how far the
    # bins' estimates of that source run from what the target accepts. There are ~30 bins a source,
    # each starting from the drafter's belief (or 0.5), and a bin learns only from its own nodes, so
    # for a request's first hundred nodes most estimates are priors, and bins learnt on one kind of
    # text (code) speak for another (chat) for ~200 of their nodes. Every node the source gets
    # verified corrects all its bins at once, by the ratio: a drafter whose priors are optimistic
    # (n-gram and head nodes whose estimates start well above what the target accepts) is corrected
    # within a few dozen nodes, before it has the controller verify trees that do not pay
    source_forget: float = 0.98
    by_source: dict[str, list[float]] = field(default_factory=dict)

    @staticmethod
    def _bin(score: float | None, depth: int, source: str) -> tuple:
        if score is None:
            return (source, "depth", min(depth, DEPTH_BINS))
        # scored nodes are binned by depth too (1, 2, 3 and deeper): given its parent was accepted, a
        # deep node of a copied phrase is accepted far more often than a first one with the same score
        score_bin = min(BINS - 1, int(max(0.0, min(1.0, score)) * BINS))
        return (source, "score", score_bin, min(depth, SCORED_DEPTH_BINS))

    def estimate(self, score: float | None, depth: int, source: str = "", optimistic: bool = False) -> float:
        """The bin's posterior mean times its source's correction (``source_factor``); ``optimistic``:
        never below the prior (the drafter's own belief)."""
        posterior, prior = self._posterior(score, depth, source)
        estimate = min(posterior * self.source_factor(source), 0.99)
        return max(estimate, prior) if optimistic else estimate

    def _posterior(self, score: float | None, depth: int, source: str) -> tuple[float, float]:
        key = self._bin(score, depth, source)
        prior = 0.5 if score is None else (key[2] + 0.5) / BINS
        accepted, rejected = self.counts.get(key, (0.0, 0.0))
        strength = self.prior_strength
        return (accepted + prior * strength) / (accepted + rejected + strength), prior

    def source_factor(self, source: str) -> float:
        """What ``source``'s verified nodes were accepted, over what their bins estimated (one
        pseudo-node each side: 1.0 before any evidence), in [0.05, 2]."""
        accepted, estimated = self.by_source.get(source, (0.0, 0.0))
        return min(max((accepted + 1.0) / (estimated + 1.0), 0.05), 2.0)

    def evidence(self, score: float | None, depth: int, source: str = "") -> float:
        """How many (decayed) samples the node's bin holds."""
        return sum(self.counts.get(self._bin(score, depth, source), (0.0, 0.0)))

    def update(self, score: float | None, depth: int, accepted: bool, source: str = "") -> None:
        seen = self.by_source.setdefault(source, [0.0, 0.0])
        seen[0] = seen[0] * self.source_forget + (1.0 if accepted else 0.0)
        seen[1] = seen[1] * self.source_forget + self._posterior(score, depth, source)[0]
        key = self._bin(score, depth, source)
        counts = self.counts.setdefault(key, [0.0, 0.0])
        counts[0] = counts[0] * self.forget + (1.0 if accepted else 0.0)
        counts[1] = counts[1] * self.forget + (0.0 if accepted else 1.0)

    def learn_round(self, tree: TokenTree, path: list[int], draft: Draft) -> None:
        """Every verified node whose parent was accepted (on ``path``) is a sample of
        P(accepted | parent accepted)."""
        on_path = set(path)
        scores, labels = draft.scores, calibration_labels(draft)
        runs = source_depths(draft)
        for node in range(1, len(tree)):
            if tree.parents[node] not in on_path:
                continue
            j = tree.source[node]
            score = scores[j] if scores is not None else None
            self.update(score, runs[j], node in on_path, labels[j])


def source_depths(draft: Draft) -> list[int]:
    """Each draft node's depth within the run of its own source: 1 for a node below the root or
    below another drafter's node. Calibration bins by it, not by the depth in the tree: a phrase
    that Ouroboros hangs below a chain of varying length starts with a guess and goes on with a
    copy, wherever it starts (binned by tree depth, its first and later nodes would share bins and
    the guesses' rejections would make the whole phrase look bad)."""
    sources = draft.sources
    runs = [1] * len(draft)
    for i, parent in enumerate(draft.parents):
        if parent >= 0 and (sources is None or sources[parent] == sources[i]):
            runs[i] = runs[parent] + 1
    return runs


def calibration_labels(draft: Draft) -> list[str]:
    """What each node is calibrated as: its source, marked ``" after a sample"`` for a deterministic
    node with an earlier sampled sibling. The verifier tries that node only once the sample is
    rejected, against the residual max(p - q, 0), where it is accepted far less often than where it
    is tried first (at T=1, n-gram and head nodes beside a draft model's sampled chain rarely are),
    and the same drafter's nodes elsewhere must not pay for that."""
    sources = draft.sources if draft.sources is not None else [""] * len(draft)
    if draft.probs is None:
        return list(sources)
    sampled_below: set[int] = set()  # parents with a sampled child so far
    labels = []
    for i, parent in enumerate(draft.parents):
        sampled = draft.q(i) is not None
        labels.append(sources[i] + " after a sample" if not sampled and parent in sampled_below else sources[i])
        if sampled:
            sampled_below.add(parent)
    return labels
