"""Training data and training for SpecDec++'s acceptance head (``speculum train acceptance-head``).

Data, the cheap way (no generation with the target, which runs ~3 tokens/s on a CPU): for each
training text, one teacher-forced target forward gives the target's own prediction at every
response position (the "response" the head learns about is what the target would say there), and
one teacher-forced draft forward gives the draft's candidate for the same position (its argmax for
greedy inference, a sample from its warped distribution otherwise). The label is the chance the
target accepts that candidate, under the same warping as inference (the reference code labels at
T=1 whatever the inference temperature: a mismatch we avoid):

    label = min(1, p_target(c) / p_draft(c))      (greedy: 1 if c is the target's argmax, else 0)

Token mixing (the paper's): the sequence the head reads keeps the target's token at a share r of
response positions and the draft's candidate elsewhere; one more draft forward over that mixed
sequence gives the hidden state at each candidate's position (its input is the candidate, as at
inference), and only candidate positions carry a loss.

What this costs in head quality: contexts are the training text's, not the target's own earlier
output, so the head sees slightly more "surprising" contexts than at inference.

Training: weighted binary cross-entropy on the soft labels (rejections weighted by w_rej, the
paper's 6), AdamW, a validation split by text, a checkpoint (safetensors + JSON) after each epoch
and resume from it.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from speculum.drafters.draft_model import fit_width
from speculum.errors import CheckpointError, InvalidInputError
from speculum.heads.acceptance import AcceptanceHead, draft_fingerprint
from speculum.poolfile import write_atomic
from speculum.sampling import SamplingParams, warp
from speculum.training.common import cached_tensors, split_by_text, torch_bytes
from speculum.training.texts import TrainingText, encode

DATA_FILE = "acceptance_data.safetensors"


@dataclass
class DataSettings:
    max_tokens: int = 512  # per text
    temperature: float = 0.0  # the inference warping the labels are for (0 = greedy)
    top_p: float = 1.0
    top_k: int = 0
    mixing_ratio: float = 0.15  # r: response positions that keep the target's token
    seed: int = 0


@torch.inference_mode()
def make_data(spec, texts: list[TrainingText], settings: DataSettings, progress: bool = True) -> dict:
    """``hidden`` [N, H] float16 (the draft's state where the candidate is the input), ``hidden_before``
    [N, H] (the state that produced the candidate, for early heads), ``label`` [N] float32,
    ``confidence`` [N] (the draft's probability of its candidate, under the warping), ``candidate`` [N]
    (the drafted token) and ``text`` [N]
    (which text each row came from)."""
    if spec.draft_model is None:
        raise InvalidInputError("the acceptance head is trained for a draft model: load one (--draft)")
    if not 0.0 <= settings.mixing_ratio < 1.0:
        raise InvalidInputError(f"mixing_ratio must be in [0, 1), got {settings.mixing_ratio}")
    sampling = SamplingParams(settings.temperature, settings.top_p, settings.top_k)
    gen = torch.Generator().manual_seed(settings.seed)
    target, draft = spec.model, spec.draft_model
    width = spec.vocab_size
    hidden_rows, before_rows, labels, confidences, candidates, owners = [], [], [], [], [], []
    for index, text in enumerate(tqdm(texts, desc="acceptance data", unit="text", disable=not progress)):
        ids, start = encode(spec.tokenizer, text, settings.max_tokens)
        if len(ids) - max(start, 1) < 1:
            continue
        inputs = torch.tensor([ids], device=target.device)
        target_logits = target(input_ids=inputs).logits[0, :, :width].float().cpu()
        # the draft over the text itself: its logits give each candidate, and the hidden state that
        # produced them is what an early head reads (the mixed sequence below is a different context)
        draft_out = draft(input_ids=inputs.to(draft.device), output_hidden_states=True)
        draft_logits = fit_width(draft_out.logits[0].float().cpu(), width)
        producing_states = draft_out.hidden_states[-1][0].float().cpu()
        # position i's outputs predict token i + 1; response tokens are ids[start:]
        rows = torch.arange(max(start, 1) - 1, len(ids) - 1)
        t_next = target_logits[rows]
        d_next = draft_logits[rows]
        if sampling.greedy:
            target_token = t_next.argmax(-1)
            candidate = d_next.argmax(-1)
            label = (candidate == target_token).float()
            confidence = torch.softmax(d_next, -1).gather(1, candidate[:, None])[:, 0]
        else:
            p, q = warp(t_next, sampling), warp(d_next, sampling)
            target_token = torch.multinomial(p, 1, generator=gen)[:, 0]
            candidate = torch.multinomial(q, 1, generator=gen)[:, 0]
            pick = torch.arange(len(rows))
            label = torch.clamp(p[pick, candidate] / q[pick, candidate], max=1.0)
            confidence = q[pick, candidate]
        keep_target = torch.rand(len(rows), generator=gen) < settings.mixing_ratio
        mixed = torch.tensor(ids)
        mixed[rows + 1] = torch.where(keep_target, target_token, candidate)
        states = draft.model(input_ids=mixed[None].to(draft.device)).last_hidden_state[0].float().cpu()
        scored = ~keep_target
        hidden_rows.append(states[rows + 1][scored].to(torch.float16))
        before_rows.append(producing_states[rows][scored].to(torch.float16))
        labels.append(label[scored])
        confidences.append(confidence[scored])
        candidates.append(candidate[scored].to(torch.int32))
        owners.append(torch.full((int(scored.sum()),), index, dtype=torch.int32))
    if not labels:
        raise InvalidInputError("the training texts gave no response positions (too short?)")
    return {
        "hidden": torch.cat(hidden_rows),
        "hidden_before": torch.cat(before_rows),
        "label": torch.cat(labels),
        "confidence": torch.cat(confidences),
        "candidate": torch.cat(candidates),
        "text": torch.cat(owners),
    }


def data_key(spec, texts: list[TrainingText], settings: DataSettings) -> str:
    """What the cached data depends on: the draft, the texts and the settings."""
    # v2: rows carry the draft's confidence; v3: and the state before the candidate; v4: that state
    # taken from the forward that produced the candidate (v3 took it from the mixed sequence's)
    h = hashlib.sha256(b"v4")
    h.update(draft_fingerprint(spec.draft_model).encode())
    h.update(str(getattr(spec, "name", "")).encode())
    h.update(json.dumps(asdict(settings), sort_keys=True).encode())
    for t in texts:
        h.update(hashlib.sha256((t.instruction + "\x00" + t.response).encode()).digest())
    return h.hexdigest()[:32]


def load_or_make_data(spec, texts, settings, cache: Path, regenerate: bool = False, progress: bool = True):
    """The data from ``cache`` when it was made from the same inputs, else made and cached (atomically)."""
    key = data_key(spec, texts, settings)
    return cached_tensors(cache, key, lambda: make_data(spec, texts, settings, progress), regenerate)


@dataclass
class TrainSettings:
    depth: int = 3  # D residual blocks (+ the output layer)
    w_rej: float = 6.0  # weight of rejections in the loss (the paper's 6)
    epochs: int = 1  # more overfits at the documented data size (docs/history/studies.md)
    lr: float = 1e-3
    batch_size: int = 256
    val_fraction: float = 0.1  # texts held out for validation
    seed: int = 0
    confidence_input: bool = True  # also read the draft's confidence (beyond the paper; see acceptance_head)
    early: bool = True  # score a candidate from the state that produced it (beyond the paper; see acceptance_head)


def weighted_bce(logits: torch.Tensor, labels: torch.Tensor, w_rej: float) -> torch.Tensor:
    """Soft-label BCE with rejections weighted ``w_rej``, normalised by the total weight (the paper's loss)."""
    accept_term = labels * torch.nn.functional.softplus(-logits)  # -log sigmoid(z)
    reject_term = w_rej * (1 - labels) * torch.nn.functional.softplus(logits)  # -log(1 - sigmoid(z))
    return (accept_term + reject_term).sum() / (labels + w_rej * (1 - labels)).sum().clamp_min(1e-8)


def train_head(
    data: dict[str, torch.Tensor],
    settings: TrainSettings,
    out: Path,
    *,
    fingerprint: str = "",
    device: str = "cpu",
    resume: bool = False,
    progress: bool = True,
    info: dict[str, Any] | None = None,
    log=print,
) -> tuple[AcceptanceHead, list[dict[str, float]]]:
    """Train (or resume) a head on ``data``; a checkpoint in ``out`` after every epoch. Returns the
    head and per-epoch metrics (train loss, validation loss, validation accuracy at 0.5)."""
    hidden, labels = data["hidden"], data["label"]
    train_mask, val_mask = split_by_text(data, settings.val_fraction, settings.seed)
    torch.manual_seed(settings.seed)
    head = AcceptanceHead(hidden.shape[1], settings.depth, fingerprint, settings.confidence_input, settings.early)
    head = head.to(device)
    if settings.early:
        hidden = data.get("hidden_before")
    confidence = data.get("confidence")
    if hidden is None or (head.confidence_input and confidence is None):
        raise CheckpointError("this training data lacks columns this head reads: regenerate it (--regenerate)")
    optimizer = torch.optim.AdamW(head.parameters(), lr=settings.lr)
    history: list[dict[str, float]] = []
    state_file = out / "train_state.pt"
    if resume and state_file.exists():
        saved = AcceptanceHead.load(out)
        if (saved.hidden_size, saved.depth, saved.confidence_input, saved.early) != (
            head.hidden_size,
            head.depth,
            head.confidence_input,
            head.early,
        ):
            raise CheckpointError(f"cannot resume {str(out)!r}: it holds a head of another shape")
        head.load_state_dict(saved.state_dict())
        state = torch.load(state_file, weights_only=True)
        optimizer.load_state_dict(state["optimizer"])
        history = json.loads(state["history"])
        log(f"resuming after epoch {len(history)}")
    train_idx = torch.nonzero(train_mask)[:, 0]
    gen = torch.Generator().manual_seed(settings.seed + len(history))
    for epoch in range(len(history), settings.epochs):
        head.train()
        order = train_idx[torch.randperm(len(train_idx), generator=gen)]
        total, count = 0.0, 0
        steps = math.ceil(len(order) / settings.batch_size)
        bar = tqdm(range(steps), desc=f"epoch {epoch + 1}/{settings.epochs}", disable=not progress, unit="batch")
        for step in bar:
            batch = order[step * settings.batch_size : (step + 1) * settings.batch_size]
            x = hidden[batch].to(device, torch.float32)
            y = labels[batch].to(device)
            q = confidence[batch].to(device) if head.confidence_input else None
            loss = weighted_bce(head(x, q), y, settings.w_rej)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += loss.item() * len(batch)
            count += len(batch)
            bar.set_postfix(loss=f"{total / max(count, 1):.4f}")
        metrics = {"epoch": epoch + 1, "train_loss": total / max(count, 1), **evaluate(head, data, val_mask, settings)}
        history.append(metrics)
        log(
            f"epoch {epoch + 1}: train loss {metrics['train_loss']:.4f}, validation loss {metrics['val_loss']:.4f}, "
            f"validation accuracy {metrics['val_accuracy']:.3f}"
        )
        training = {**(info or {}), "settings": asdict(settings), "history": history}
        head.cpu().save(out, training=training)
        head.to(device)
        blob = torch_bytes({"optimizer": optimizer.state_dict(), "history": json.dumps(history)})
        write_atomic(state_file, blob, what="training state file", error=CheckpointError)
    return head.cpu().eval(), history


@torch.no_grad()
def evaluate(head: AcceptanceHead, data, mask: torch.Tensor, settings: TrainSettings) -> dict[str, float]:
    if not bool(mask.any()):
        return {"val_loss": float("nan"), "val_accuracy": float("nan")}
    head.eval()
    device = head.out.weight.device
    x = data["hidden_before" if head.early else "hidden"][mask].to(device, torch.float32)
    y = data["label"][mask].to(device)
    q = data["confidence"][mask].to(device) if head.confidence_input else None
    logits = head(x, q)
    accuracy = ((torch.sigmoid(logits) > 0.5) == (y > 0.5)).float().mean()
    return {"val_loss": float(weighted_bce(logits, y, settings.w_rej)), "val_accuracy": float(accuracy)}


def run(
    spec,
    texts: list[TrainingText],
    out: Path,
    data_settings: DataSettings,
    train_settings: TrainSettings,
    *,
    device: str = "cpu",
    regenerate: bool = False,
    resume: bool = False,
    progress: bool = True,
    log=print,
) -> tuple[AcceptanceHead, list[dict[str, float]]]:
    """Data (cached in ``out``) then training: what ``speculum train acceptance-head`` does."""
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    data, cached = load_or_make_data(spec, texts, data_settings, out / DATA_FILE, regenerate, progress)
    data_time = time.perf_counter() - t0
    n = len(data["label"])
    log(
        f"data: {n} candidate positions from {len(texts)} texts ({'cached' if cached else f'{data_time:.0f} s'}), "
        f"mean label {float(data['label'].mean()):.3f}"
    )
    info = {
        "draft": getattr(spec, "draft_name", None),
        "target": getattr(spec, "name", None),
        "data": {**asdict(data_settings), "positions": n, "texts": len(texts), "seconds": round(data_time, 1)},
    }
    t1 = time.perf_counter()
    head, history = train_head(
        data,
        train_settings,
        out,
        fingerprint=draft_fingerprint(spec.draft_model),
        device=device,
        resume=resume,
        progress=progress,
        info=info,
        log=log,
    )
    log(f"training: {time.perf_counter() - t1:.0f} s; checkpoint in {out}")
    return head, history
