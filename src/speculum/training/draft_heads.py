"""Self-distillation for draft heads over the target's hidden states (``speculum train medusa`` and
``speculum train ctc-drafter``): one data pass, one training loop, two kinds of heads.

Data: the target's hidden states and its own next-token predictions over the training texts
(:mod:`speculum.training.distill_data`, one data pass cached for both kinds of heads).

Examples: every response position t is a root (the token the loop has just committed). Medusa
head k reads the hidden state at t-1 and learns the label at t+k-1 (cross-entropy, head weights
0.8^k as Medusa); the CTC module reads the hidden states at t-W..t-1 and the root's embedding and
learns the labels at t..t+L-1 with torch's CTC loss (its blank is its own symbol). Both predict
over a draft vocabulary: the tokens the target predicts most often on the training text (labels
outside it are not learnt; their share is reported as the vocabulary's coverage). With
``consistent``, a root's labels count only while the text agrees with the target: every label a
head learns is then what greedy decoding from that root says.

Training: AdamW with linear decay, a validation split by text, validation loss, top-k hit rates per
head position (Medusa; they also choose its default tree) and the mean length of the greedy draft's
matching prefix, a checkpoint after every epoch and ``--resume`` from it.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from speculum import machine
from speculum.drafters.ctc import ctc_collapse
from speculum.errors import CheckpointError, InvalidInputError
from speculum.heads import CTCDraftModule, MedusaHeads, load_draft_head, save_draft_head
from speculum.models.compat import device_of
from speculum.poolfile import write_atomic
from speculum.training.common import split_by_text, torch_bytes
from speculum.training.distill_data import DATA_FILE, DistillSettings, append_data, load_or_make_data
from speculum.training.texts import TrainingText

TOPK = 10  # hit rates measured per head position up to this rank
PRECISIONS = ("auto", "float32", "bfloat16")


def choose_draft_vocab(
    data: dict[str, torch.Tensor], size: int, rows: torch.Tensor | None = None
) -> tuple[torch.Tensor, float]:
    """The ``size`` tokens the target predicts most often on the response positions (ties: most
    frequent input tokens first), and the share of those labels they cover. ``rows``: the positions
    that may be counted (the training texts': the validation texts' labels must not choose it)."""
    rows = torch.ones_like(data["response"]) if rows is None else rows
    labels = data["label"][data["response"] & rows]
    vocab = int(max(int(data["label"].max()), int(data["token"].max())) + 1)
    counts = torch.bincount(labels, minlength=vocab).double()
    counts += torch.bincount(data["token"][rows], minlength=vocab).double() * 1e-6  # ties: by text frequency
    chosen = counts.argsort(descending=True)[: min(size, vocab)]
    coverage = float(counts[chosen].floor().sum() / max(len(labels), 1))
    return chosen.sort().values, coverage


@dataclass
class HeadSettings:
    kind: str = "medusa"  # medusa | ctc
    num_heads: int = 4  # medusa: heads (tokens guessed beyond the root)
    num_layers: int = 1  # medusa: residual blocks per head
    slots: int = 8  # ctc: frames predicted at once
    label_length: int = 4  # ctc: target tokens the frames spell
    context: int = 16  # ctc: hidden states it reads (t-W..t-1)
    draft_vocab: int = 16384  # tokens the heads can draft (the most frequent targets' predictions)
    epochs: int = 2
    lr: float = 1e-3
    batch_size: int = 64
    val_fraction: float = 0.05
    seed: int = 0
    max_examples: int = 0  # per epoch, 0 = every example (a random subset otherwise)
    tree_nodes: int = 16  # recommended draft tree size, saved with the heads
    consistent: bool = True  # learn a label only while the text stays on the target's own path
    # the training arithmetic: "bfloat16" autocasts the forward (weights and optimizer stay float32);
    # "auto" does where the device computes bf16 natively (several times faster there)
    precision: str = "auto"
    # ctc: standardise the memory per dimension with the target's hidden-state statistics (and map
    # the output back); an experiment, off by default
    standardize: bool = False
    # ctc: every slot its own residual block over the fused state; without them the slots stay near
    # copies of each other and the module hardly learns
    slot_blocks: bool = True
    # Gaussian noise added to the training inputs' hidden states, in units of each dimension's spread
    # over the training data: a regulariser against fitting the training texts far better than new
    # ones (EAGLE and CTC-drafter add uniform noise to theirs). 0: none
    noise: float = 0.0
    # ctc: a second layer re-reads the frames with each frame's top-1 choice embedded (an experiment:
    # the frames otherwise cannot see what their neighbours chose); both stages learn the labels
    refine: bool = False

    @property
    def span(self) -> int:
        return self.num_heads if self.kind == "medusa" else self.label_length

    def check(self) -> None:
        if self.kind not in ("medusa", "ctc"):
            raise InvalidInputError(f"unknown head kind {self.kind!r}: medusa or ctc")
        if self.kind == "ctc" and self.slots < self.label_length:
            raise InvalidInputError(f"slots ({self.slots}) must be >= label_length ({self.label_length})")
        if self.precision not in PRECISIONS:
            raise InvalidInputError(f"precision must be one of {', '.join(PRECISIONS)}, not {self.precision!r}")
        for name in ("num_heads", "num_layers", "slots", "label_length", "context", "draft_vocab", "epochs"):
            if getattr(self, name) < 1:
                raise InvalidInputError(f"{name} must be >= 1")
        if not self.noise >= 0:
            raise InvalidInputError(f"noise must be >= 0, not {self.noise!r}")


def mixed_precision(precision: str, device: str) -> torch.dtype | None:
    """The dtype training's forward autocasts to (None: plain float32)."""
    if precision == "float32":
        return None
    if precision == "bfloat16":
        return torch.bfloat16
    return torch.bfloat16 if machine.native_bf16(device) else None


def _run_lengths(flags: torch.Tensor) -> torch.Tensor:
    """For each position, how many consecutive ``True`` start there."""
    n = len(flags)
    index = torch.arange(n)
    breaks = torch.where(~flags, index, torch.full_like(index, n))  # next False at or after each position
    next_false = torch.flip(torch.cummin(torch.flip(breaks, [0]), 0).values, [0])
    return next_false - index


class Examples:
    """Root positions usable for training and their batches (inputs gathered from the data)."""

    def __init__(
        self, data: dict[str, torch.Tensor], span: int, context: int, consistent: bool = True, whole_span: bool = False
    ):
        self.data = data
        self.context = context
        text = data["text"].long()
        n = len(text)
        index = torch.arange(n)
        starts = torch.ones(n, dtype=torch.bool)
        starts[1:] = text[1:] != text[:-1]
        self.first = torch.cummax(torch.where(starts, index, torch.zeros_like(index)), 0).values  # text's start
        last_ok = index + span - 1
        same_text = (last_ok < n) & (text[last_ok.clamp(max=n - 1)] == text)
        # on_path[t]: the token at t is what the target predicted after t-1 (as at inference, where
        # every committed token is the target's). run[t]: how many tokens from t on stay on its path,
        # so the labels at t..t+run[t]-1 are exactly what greedy decoding from root t would say.
        agrees = data["token"][1:] == data["label"][:-1] if consistent else True  # not consistent: all count
        on_path = torch.zeros(n, dtype=torch.bool)
        on_path[1:] = agrees & ~starts[1:]
        self.run = _run_lengths(on_path).clamp(max=span)
        # the root itself is the target's own token; CTC learns a root's labels only all together
        usable = self.run >= (span if whole_span else 1)
        self.roots = index[data["response"] & (index - 1 >= self.first) & same_text & usable]
        self.span = span

    def batch(self, roots: torch.Tensor, device) -> dict[str, torch.Tensor]:
        hidden = self.data["hidden"]
        offsets = torch.arange(-self.context, 0)
        where = roots[:, None] + offsets
        padding = where < self.first[roots][:, None]
        memory = hidden[where.clamp(min=0)].float()
        memory[padding] = 0.0
        labels = self.data["label"][roots[:, None] + torch.arange(self.span)]
        return {
            "memory": memory.to(device),
            "padding": padding.to(device),
            "root": self.data["token"][roots].to(device),
            "labels": labels.to(device),
            "on_path": (torch.arange(self.span)[None] < self.run[roots][:, None]).to(device),
        }


def add_noise(batch: dict[str, torch.Tensor], spread: torch.Tensor, generator: torch.Generator) -> None:
    """Gaussian noise of ``spread`` (per hidden dimension) on a batch's hidden states; padding stays zero."""
    memory = batch["memory"]
    noise = torch.randn(memory.shape, generator=generator).to(memory.device) * spread
    batch["memory"] = memory + noise.masked_fill(batch["padding"][..., None], 0.0)


def targets_of(module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Draft-vocabulary indices of a batch's labels, -1 where not learnt (outside the draft
    vocabulary, or past where the text leaves the target's own path)."""
    targets = to_draft_index(module, batch["labels"])
    return targets.masked_fill(~batch["on_path"], -1)


def build_module(settings: HeadSettings, hidden_size: int, draft_vocab: torch.Tensor):
    if settings.kind == "medusa":
        return MedusaHeads(hidden_size, settings.num_heads, draft_vocab, settings.num_layers)
    return CTCDraftModule(hidden_size, draft_vocab, settings.slots, settings.label_length, settings.context,
                          slot_blocks=settings.slot_blocks, refine=settings.refine)  # fmt: skip


def to_draft_index(module, labels: torch.Tensor) -> torch.Tensor:
    """Target token ids -> draft-vocabulary indices (-1 where a token is not in it)."""
    vocab = module.projection.draft_vocab
    position = torch.searchsorted(vocab, labels).clamp(max=len(vocab) - 1)
    return torch.where(vocab[position] == labels, position, torch.full_like(position, -1))


def module_logits(module, batch: dict[str, torch.Tensor], embeddings, every_pass: bool = False):
    """The module's logits for a batch; ``every_pass``: the list of every stage's (one but a refining
    CTC module's), for the loss."""
    if isinstance(module, MedusaHeads):
        logits = module(batch["memory"][:, -1])  # [B, heads, vocab]
        return [logits] if every_pass else logits
    device = batch["memory"].device

    @torch.no_grad()
    def embed(tokens: torch.Tensor) -> torch.Tensor:  # the frozen target's input embeddings
        return embeddings(tokens.to(device_of(embeddings))).float().to(device)

    # [B, slots, vocab + 1]
    return module(batch["memory"], embed(batch["root"]), batch["padding"], embed=embed, every_pass=every_pass)


def loss_of(module, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Medusa: cross-entropy per head weighted 0.8^k; CTC: torch's CTC loss (rows whose labels are
    not all in the draft vocabulary are left out)."""
    if isinstance(module, MedusaHeads):
        logits = logits.float()
        weights = 0.8 ** torch.arange(targets.shape[1], device=logits.device, dtype=logits.dtype)
        known_targets = targets.masked_fill(targets < 0, -100)
        per_head = F.cross_entropy(logits.transpose(1, 2), known_targets, ignore_index=-100, reduction="none")
        known = (targets >= 0).float()
        return ((per_head * known).sum(0) / known.sum(0).clamp(min=1) * weights).sum() / weights.sum()
    usable = (targets >= 0).all(dim=1)
    if not bool(usable.any()):
        return logits.sum() * 0.0
    logprobs = logits[usable].float().log_softmax(-1).transpose(0, 1)  # [slots, B, vocab + 1]
    batch = logprobs.shape[1]
    lengths = torch.full((batch,), logprobs.shape[0], dtype=torch.long)
    target_lengths = torch.full((batch,), targets.shape[1], dtype=torch.long)
    return F.ctc_loss(logprobs, targets[usable], lengths, target_lengths, blank=module.blank_index,
                      zero_infinity=True)  # fmt: skip


def greedy_draft(module, logits: torch.Tensor) -> list[list[int]]:
    """Each row's single best draft (draft-vocabulary indices): top-1 per head, or the best
    alignment collapsed (CTC)."""
    best = logits.argmax(-1).tolist()
    if isinstance(module, MedusaHeads):
        return best
    return [ctc_collapse(row, module.blank_index) for row in best]


@torch.no_grad()
def evaluate(module, examples: Examples, roots: torch.Tensor, embeddings, device, batch_size: int = 256) -> dict:
    """Validation loss, the greedy draft's mean matching prefix (tokens a greedy target would
    accept), and for Medusa the hit rate of each rank per head (``topk_accuracy[k][c]``)."""
    module.eval()
    total, count, matched = 0.0, 0, 0
    hits = torch.zeros(examples.span, TOPK)
    for chunk in roots.split(batch_size):
        batch = examples.batch(chunk, device)
        logits = module_logits(module, batch, embeddings)
        targets = targets_of(module, batch)
        total += float(loss_of(module, logits, targets)) * len(chunk)
        count += len(chunk)
        for draft, target in zip(greedy_draft(module, logits), targets.tolist(), strict=True):
            for got, want in zip(draft, target, strict=False):
                if got != want:
                    break
                matched += 1
        if isinstance(module, MedusaHeads):
            top = logits.topk(TOPK, dim=-1).indices  # [B, heads, TOPK]
            hits += (top == targets[..., None]).float().sum(0).cpu()
    metrics = {"val_loss": total / max(count, 1), "val_accepted_prefix": matched / max(count, 1)}
    if isinstance(module, MedusaHeads):
        rates = (hits / max(count, 1)).tolist()
        metrics["topk_accuracy"] = [[round(r, 5) for r in row] for row in rates]
        metrics["top1"] = [round(row[0], 4) for row in rates]
        metrics["top5"] = [round(sum(row[:5]), 4) for row in rates]
    return metrics


def train(
    spec,
    data: dict[str, torch.Tensor],
    settings: HeadSettings,
    out: Path,
    *,
    device: str = "cpu",
    resume: bool = False,
    progress: bool = True,
    info: dict[str, Any] | None = None,
    log=print,
):
    """Train (or resume) heads of ``settings.kind`` on ``data``; a checkpoint in ``out`` after every
    epoch. Returns the module and the per-epoch metrics."""
    settings.check()
    embeddings = spec.model.get_input_embeddings()
    examples = Examples(data, settings.span, settings.context, settings.consistent, settings.kind == "ctc")
    sources = data.get("source", data["text"])  # a text and the target's continuation of it: one side of the split
    train_mask, val_mask = split_by_text({"text": sources[examples.roots]}, settings.val_fraction, settings.seed)
    train_roots, val_roots = examples.roots[train_mask], examples.roots[val_mask]
    # the draft vocabulary is chosen from the training texts only (validation stays unseen)
    training_rows = torch.isin(sources, torch.unique(sources[train_roots]))
    draft_vocab, coverage = choose_draft_vocab(data, settings.draft_vocab, training_rows)
    torch.manual_seed(settings.seed)
    module = build_module(settings, data["hidden"].shape[1], draft_vocab)
    if len(train_roots) == 0:
        raise InvalidInputError("no training examples: give more (or longer) texts")
    # the target's hidden states at (a sample of) the training positions: their statistics
    pick = torch.randperm(len(train_roots), generator=torch.Generator().manual_seed(settings.seed))[:8192]
    sample = data["hidden"][train_roots[pick]].float()
    if settings.kind == "ctc" and settings.standardize:
        module.standardize_on(sample)
    spread = settings.noise * sample.std(dim=0).clamp(min=1e-3).to(device) if settings.noise > 0 else None
    per_epoch = min(len(train_roots), settings.max_examples or len(train_roots))
    steps_per_epoch = math.ceil(per_epoch / settings.batch_size)
    history: list[dict[str, Any]] = []
    state_file = out / "train_state.pt"
    if resume and state_file.exists():
        saved = load_draft_head(out, settings.kind)
        if saved.shape() != module.shape() or not torch.equal(saved.projection.draft_vocab, draft_vocab):
            raise CheckpointError(f"cannot resume {str(out)!r}: it holds heads of another shape or vocabulary")
        module.load_state_dict(saved.state_dict())
    module.projection.attach_to(spec.model)
    module.to(device)
    optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=settings.lr)
    total_steps = steps_per_epoch * settings.epochs
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: max(0.0, 1 - step / total_steps))
    if resume and state_file.exists():
        state = torch.load(state_file, weights_only=True)
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        history = json.loads(state["history"])
        log(f"resuming after epoch {len(history)}")
    log(
        f"{settings.kind}: {len(train_roots)} training / {len(val_roots)} validation examples; draft vocabulary "
        f"{len(draft_vocab)} tokens covering {coverage:.1%} of the target's predictions"
    )
    gen = torch.Generator().manual_seed(settings.seed + len(history))
    noise_gen = torch.Generator().manual_seed(settings.seed + 7919 * (len(history) + 1))
    mixed = mixed_precision(settings.precision, device)
    autocast = torch.autocast(torch.device(device).type, dtype=mixed or torch.bfloat16, enabled=mixed is not None)
    started = time.perf_counter()
    for epoch in range(len(history), settings.epochs):
        module.train()
        order = train_roots[torch.randperm(len(train_roots), generator=gen)[:per_epoch]]
        total, count = 0.0, 0
        bar = tqdm(range(steps_per_epoch), desc=f"epoch {epoch + 1}/{settings.epochs}", disable=not progress)
        for step in bar:
            roots = order[step * settings.batch_size : (step + 1) * settings.batch_size]
            batch = examples.batch(roots, device)
            if spread is not None:
                add_noise(batch, spread, noise_gen)
            targets = targets_of(module, batch)
            with autocast:
                passes = module_logits(module, batch, embeddings, every_pass=True)
            # every stage of a refining CTC module learns the labels (its first stage's choices stay meaningful)
            loss = torch.stack([loss_of(module, logits, targets) for logits in passes]).mean()
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            total += loss.item() * len(roots)
            count += len(roots)
            bar.set_postfix(loss=f"{total / max(count, 1):.4f}")
        metrics = {"epoch": epoch + 1, "train_loss": total / max(count, 1)}
        metrics.update(evaluate(module, examples, val_roots, embeddings, device))
        history.append(metrics)
        shown = {k: v for k, v in metrics.items() if k != "topk_accuracy"}
        log(f"epoch {epoch + 1}: " + ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}"
                                                for k, v in shown.items() if k != "epoch"))  # fmt: skip
        inference = {"tree_nodes": settings.tree_nodes}
        if "topk_accuracy" in metrics:
            inference["topk_accuracy"] = metrics["topk_accuracy"]
        training = {
            **(info or {}),
            "settings": asdict(settings),
            "precision": str(mixed or torch.float32).removeprefix("torch."),
            "draft_vocab_coverage": round(coverage, 4),
            "examples": {"train": len(train_roots), "validation": len(val_roots)},
            "seconds": round(time.perf_counter() - started, 1),
            "history": history,
        }
        save_draft_head(module, out, spec.model, inference=inference, training=training)
        blob = torch_bytes(
            {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "history": json.dumps(history)}
        )
        write_atomic(state_file, blob, what="training state file", error=CheckpointError)
    return module.cpu().eval(), history


def run(
    spec,
    texts: list[TrainingText],
    out: Path,
    data_settings: DistillSettings,
    settings: HeadSettings,
    *,
    device: str = "cpu",
    regenerate: bool = False,
    resume: bool = False,
    progress: bool = True,
    data_file: Path | None = None,
    extra_data: list[Path] | None = None,
    log=print,
):
    """Data (cached in ``out``, or in ``data_file``: one data pass for both kinds of heads; then
    ``extra_data``, files earlier runs made) then training: what ``speculum train medusa|ctc-drafter`` does."""
    settings.check()
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    data, cached = load_or_make_data(
        spec, texts, data_settings, data_file or out / DATA_FILE, regenerate, progress, given=data_file is not None
    )
    data_time = time.perf_counter() - t0
    own_positions = len(data["label"])
    data = append_data(spec, data, list(extra_data or []))
    size = sum(t.numel() * t.element_size() for t in data.values())
    log(
        f"data: {own_positions} positions from {len(texts)} texts "
        f"({'cached' if cached else f'{data_time:.0f} s'})"
        + (f", {len(data['label']) - own_positions} from --extra-data" if extra_data else "")
        + f"; {size / 2**20:.0f} MB in all"
    )
    info = {
        "target": getattr(spec, "name", None),
        "data": {**asdict(data_settings), "positions": len(data["label"]), "texts": len(texts),
                 "seconds": round(data_time, 1), "megabytes": round(size / 2**20, 1),
                 "extra_data": [str(file) for file in extra_data or []]},
    }  # fmt: skip
    t1 = time.perf_counter()
    module, history = train(spec, data, settings, out, device=device, resume=resume, progress=progress,
                            info=info, log=log)  # fmt: skip
    log(f"training: {time.perf_counter() - t1:.0f} s; checkpoint in {out}")
    return module, history
