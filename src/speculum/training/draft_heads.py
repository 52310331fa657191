"""Self-distillation for draft heads over the target's hidden states (``speculum train medusa`` and
``speculum train ctc-drafter``): one data pass, one training loop, two kinds of heads.

Data: one forward of the target over each training sequence gives, at every position, its last
hidden state (the LM head's input, stored float16) and its own next-token prediction (argmax).
Heads learn what *this target* would say: the labels are its predictions, not the text. Two kinds
of sequence:
- teacher-forced text (the default, cheap: the target does not generate): the prompt sets' own
  answers and source files. Where the text leaves the target's own path (a 270M model agrees with
  the text about 60% of the time), the labels after it are predictions along a path the target
  would not write, so a root's labels count only while the text agrees with the target
  (``consistent``): every label a head learns is then what greedy decoding from that root says;
- the target's own greedy continuations of the prompts (``generate``): slower to make, but every
  position is on the target's own path. speculum's own batched engine makes them (rows leave at
  their end-of-sequence token), in the layouts users send (a chat-templated prompt also as a raw
  completion), written to ``continuations.jsonl`` after every batch: an interrupted run resumes
  where it stopped.
The data is cached in the output directory and remade only when its inputs change (or when asked).
The data pass itself is saved in parts as it goes (``distill_data.safetensors.parts``): an
interrupted pass resumes after the last part instead of starting over.

Examples: every response position t is a root (the token the loop has just committed). Medusa
head k reads the hidden state at t-1 and learns the label at t+k-1 (cross-entropy, head weights
0.8^k as Medusa); the CTC module reads the hidden states at t-W..t-1 and the root's embedding and
learns the labels at t..t+L-1 with torch's CTC loss (its blank is its own symbol). Both predict
over a draft vocabulary: the tokens the target predicts most often on the training text (labels
outside it are not learnt; their share is reported as the vocabulary's coverage).

Training: AdamW with linear decay, a validation split by text, validation loss, top-k hit rates per
head position (Medusa; they also choose its default tree) and the mean length of the greedy draft's
matching prefix, a checkpoint after every epoch and ``--resume`` from it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from speculum import machine
from speculum.errors import CheckpointError, InvalidInputError
from speculum.heads import CTCDraftModule, MedusaHeads, load_draft_head, save_draft_head
from speculum.heads.checkpoint import model_fingerprint
from speculum.heads.projection import lm_head_weight
from speculum.poolfile import write_atomic
from speculum.runner import ModelRunner
from speculum.training.common import cached_tensors, split_by_text, stored_key, torch_bytes
from speculum.training.texts import TrainingText, encode, generation_layouts

DATA_FILE = "distill_data.safetensors"
CONTINUATIONS_FILE = "continuations.jsonl"  # beside the data file: the target's continuations so far
TOPK = 10  # hit rates measured per head position up to this rank
PRECISIONS = ("auto", "float32", "bfloat16")


@dataclass
class DistillSettings:
    max_tokens: int = 512  # per text
    generate: int = 0  # > 0: train on the target's own greedy continuations of this many tokens
    generate_batch: int = 16  # prompts continued at once
    raw_layout: bool = True  # with generate: a chat-templated prompt continued as a raw completion too


def continuation_key(fingerprint: str, prompt: list[int], settings: DistillSettings) -> str:
    """What a continuation depends on: the target, the tokens asked for, the prompt."""
    return hashlib.sha256(f"{fingerprint}\0{settings.generate}\0{prompt}".encode()).hexdigest()


def read_continuations(path: Path) -> dict[str, list[int]]:
    """The continuations a run wrote so far (a line an interruption tore is left out: made again)."""
    done: dict[str, list[int]] = {}
    if not path.exists():
        return done
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
            done[record["key"]] = [int(t) for t in record["tokens"]]
        except (ValueError, KeyError, TypeError):
            continue
    return done


@torch.inference_mode()
def continuations(
    spec, prompts: list[list[int]], settings: DistillSettings, progress: bool = True, cache: Path | None = None
) -> list[list[int]]:
    """The target's greedy continuation of every prompt (up to ``settings.generate`` tokens, cut after
    its end-of-sequence token), ``settings.generate_batch`` prompts at a time through speculum's
    batched engine; with ``cache``, each batch is appended to it as it completes and the prompts
    it already holds are not generated again."""
    from tqdm.auto import tqdm

    fingerprint = model_fingerprint(spec.model)
    keys = [continuation_key(fingerprint, prompt, settings) for prompt in prompts]
    done = read_continuations(cache) if cache is not None else {}
    todo = sorted({k: i for i, k in enumerate(keys) if k not in done}.values(), key=lambda i: len(prompts[i]))
    bar = tqdm(total=len(set(keys)), initial=len(set(keys)) - len(todo), desc="target's continuations",
               unit="prompt", disable=not progress)  # fmt: skip
    started, made = time.perf_counter(), 0
    sink = cache.open("a", encoding="utf-8") if cache is not None else None
    if sink is not None and cache.stat().st_size and not cache.read_bytes().endswith(b"\n"):
        sink.write("\n")  # after a torn last line: the next record starts a line of its own
    try:
        for first in range(0, len(todo), settings.generate_batch):
            chosen = todo[first : first + settings.generate_batch]  # similar lengths share a batch
            results = spec.generate([prompts[i] for i in chosen], "autoregressive", max_new_tokens=settings.generate)
            for i, result in zip(chosen, results, strict=True):
                done[keys[i]] = result.token_ids
                if sink is not None:
                    sink.write(json.dumps({"key": keys[i], "tokens": result.token_ids}) + "\n")
                made += len(result.token_ids)
            if sink is not None:
                sink.flush()
                os.fsync(sink.fileno())
            bar.update(len(chosen))
            bar.set_postfix_str(f"{made / (time.perf_counter() - started):.1f} tokens/s")
    finally:
        if sink is not None:
            sink.close()
        bar.close()
    return [done[k] for k in keys]


def sequences(spec, texts: list[TrainingText], settings: DistillSettings, progress: bool = True,
              cache: Path | None = None) -> list[tuple[list[int], int, int]]:  # fmt: skip
    """(token ids, where the response starts, which text) per sequence: every text as it is, then
    with ``settings.generate`` the target's continuation of each of its prompts' layouts."""
    laid_out = [(*encode(spec.tokenizer, text, settings.max_tokens), i) for i, text in enumerate(texts)]
    if settings.generate:
        prompts, sources = [], []
        for i, text in enumerate(texts):
            for prompt in generation_layouts(spec, text, settings.raw_layout):
                prompts.append(prompt[: max(settings.max_tokens - 2, 1)])
                sources.append(i)
        answers = continuations(spec, prompts, settings, progress, cache)
        for prompt, answer, i in zip(prompts, answers, sources, strict=True):
            laid_out.append(((prompt + answer)[: settings.max_tokens], len(prompt), i))
    return laid_out


class PartialData:
    """An unfinished data pass, saved as it goes: every ``PART_TEXTS`` sequences a part file (written
    whole or not at all, keyed by the data's inputs) in ``folder``, beside the data file. An
    interrupted pass resumes after the last part; the folder goes once the whole data file is written."""

    def __init__(self, folder: Path, key: str):
        self.folder, self.key = folder, key

    def load(self) -> tuple[int, dict[str, list[torch.Tensor]]]:
        """The first sequence not saved yet and the saved columns (parts made for other inputs are removed)."""
        from safetensors import safe_open

        columns: dict[str, list[torch.Tensor]] = {name: [] for name in DATA_COLUMNS}
        stop = 0
        for path in sorted(self.folder.glob("part-*.safetensors")) if self.folder.is_dir() else []:
            try:
                with safe_open(str(path), "pt") as f:
                    meta = f.metadata() or {}
                    if meta.get("key") != self.key:
                        path.unlink()
                        continue
                    if int(meta["first"]) != stop:  # parts follow one another; a gap ends what can be reused
                        break
                    part = {name: f.get_tensor(name) for name in DATA_COLUMNS}
            except Exception:  # noqa: BLE001 - an unreadable part is made again
                break
            for name in DATA_COLUMNS:
                columns[name].append(part[name])
            stop = int(meta["stop"])
        return stop, columns

    def save(self, first: int, stop: int, columns: dict[str, list[torch.Tensor]]) -> None:
        """Sequences ``first`` to ``stop`` (their rows: ``columns``) as one part."""
        from safetensors.torch import save

        self.folder.mkdir(parents=True, exist_ok=True)
        data = {name: torch.cat(parts) for name, parts in columns.items()}
        blob = save(data, metadata={"key": self.key, "first": str(first), "stop": str(stop)})
        path = self.folder / f"part-{first:07d}.safetensors"
        write_atomic(path, blob, what="training data part", error=CheckpointError)

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


PART_TEXTS = 32  # sequences per saved part of a data pass (about a minute of the Qwen 1.5B target's time)


@torch.inference_mode()
def make_data(
    spec,
    texts: list[TrainingText],
    settings: DistillSettings,
    progress: bool = True,
    cache: Path | None = None,
    partial: PartialData | None = None,
) -> dict:
    """``hidden`` [N, H] float16, ``label`` [N] (the target's argmax after each position), ``token`` [N]
    (the input token), ``text`` [N] (which sequence), ``source`` [N] (which training text it comes
    from: a text and the target's continuation of its prompt share one, and the validation split),
    ``response`` [N] (inside the response part). With ``partial``, the pass is saved as it goes and
    resumes where an interrupted one stopped."""
    from tqdm.auto import tqdm

    runner = ModelRunner(spec.model, lazy_head=False)
    laid_out = sequences(spec, texts, settings, progress, cache)
    resume_at, columns = partial.load() if partial is not None else (0, {name: [] for name in DATA_COLUMNS})
    # where the part being made starts: a sequence, and an entry of the column lists
    unsaved_from, unsaved_entries = resume_at, len(columns["label"])
    bar = tqdm(total=len(laid_out), initial=resume_at, desc="distillation data", unit="text", disable=not progress)
    try:
        for index in range(resume_at, len(laid_out)):
            ids, start, source = laid_out[index]
            bar.update(1)
            if partial is not None and index - unsaved_from >= PART_TEXTS and len(columns["label"]) > unsaved_entries:
                partial.save(unsaved_from, index, {name: parts[unsaved_entries:] for name, parts in columns.items()})
                unsaved_from, unsaved_entries = index, len(columns["label"])
            if len(ids) - start < 2:
                continue
            inputs = torch.tensor([ids], device=runner.input_device)
            if runner.split_head:  # the LM head in slices: a 262k-wide head over 512 rows is 0.5 GB of logits
                states = spec.model.model(input_ids=inputs, use_cache=False).last_hidden_state[0]
                labels = torch.cat([runner._head(chunk).argmax(-1) for chunk in states.split(64)])
            else:
                out = spec.model(input_ids=inputs, use_cache=False, output_hidden_states=True)
                states, labels = out.hidden_states[-1][0], out.logits[0].argmax(-1)
            n = len(ids)
            columns["hidden"].append(states.to("cpu", torch.float16))
            columns["label"].append(labels.cpu().long())
            columns["token"].append(torch.tensor(ids))
            columns["text"].append(torch.full((n,), index, dtype=torch.int32))
            columns["source"].append(torch.full((n,), source, dtype=torch.int32))
            columns["response"].append(torch.arange(n) >= start)
    except KeyboardInterrupt:
        if partial is not None and unsaved_from > 0:
            bar.write(f"interrupted: sequences 1-{unsaved_from} of {len(laid_out)} are saved in {partial.folder}; "
                      "the same command resumes after them")  # fmt: skip
        raise
    finally:
        bar.close()
    if not columns["label"]:
        raise InvalidInputError("the training texts gave no response positions (too short?)")
    return {name: torch.cat(parts) for name, parts in columns.items()}


def data_key(spec, texts: list[TrainingText], settings: DistillSettings) -> str:
    h = hashlib.sha256(b"distill-v3" if settings.generate else b"distill-v1")
    h.update(model_fingerprint(spec.model).encode())
    keyed = asdict(settings) if settings.generate else {"max_tokens": settings.max_tokens}
    h.update(json.dumps(keyed, sort_keys=True).encode())
    for text in texts:
        h.update(hashlib.sha256(f"{text.source}\0{text.instruction}\0{text.response}".encode()).digest())
    return h.hexdigest()


def load_or_make_data(
    spec, texts, settings: DistillSettings, cache: Path, regenerate=False, progress=True, given: bool = False
):
    """The data, from ``cache`` when its inputs are the same; made otherwise (the target's
    continuations from the ``CONTINUATIONS_FILE`` beside it, as far as they go: ``regenerate`` makes
    those again too). ``given``: the user named ``cache`` (``--data``), so a file there made from
    other inputs is refused rather than replaced: it may hold an hour of data passes."""
    continued = cache.with_name(CONTINUATIONS_FILE)
    key = data_key(spec, texts, settings)
    if given and not regenerate and cache.exists() and stored_key(cache) != key:
        raise InvalidInputError(
            f"--data {cache} was made from other texts or data settings than this command's (--model, --texts, "
            "--max-tokens, --generate, --generate-batch, --raw-layout). Give the ones it was made with; to train on it "
            "beside new texts, pass it as --extra-data instead; --regenerate remakes it there"
        )
    partial = PartialData(cache.with_name(cache.name + ".parts"), key)
    if regenerate:
        continued.unlink(missing_ok=True)
        partial.remove()

    def make():
        cache.parent.mkdir(parents=True, exist_ok=True)
        return make_data(spec, texts, settings, progress, continued, partial)

    data, cached = cached_tensors(cache, key, make, regenerate)
    partial.remove()  # the whole file is written: its parts are not needed any more
    return data, cached


DATA_COLUMNS = ("hidden", "label", "token", "text", "source", "response")


def append_data(spec, data: dict[str, torch.Tensor], files: list[Path]) -> dict[str, torch.Tensor]:
    """``data`` followed by the data files earlier runs made for the same target (``--extra-data``):
    a data pass is the costly part, so data made for other texts is reused as it is. Sequence and
    source numbers are shifted so that every file's texts stay apart (and in the validation split)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    parts = [data]
    hidden_size = spec.model.config.get_text_config().hidden_size
    for file in files:
        try:
            extra = load_file(str(file))
        except (OSError, SafetensorError) as error:
            raise InvalidInputError(f"--extra-data {file}: not a readable data file ({error})") from None
        missing = [name for name in DATA_COLUMNS if name not in extra]
        if missing:
            raise InvalidInputError(f"--extra-data {file}: not a distillation data file (no {', '.join(missing)})")
        if extra["hidden"].shape[1] != hidden_size:
            raise InvalidInputError(
                f"--extra-data {file}: made for another target (hidden size {extra['hidden'].shape[1]}, "
                f"this target's {hidden_size})"
            )
        parts.append(extra)
    if len(parts) == 1:
        return data
    merged: dict[str, list[torch.Tensor]] = {name: [] for name in DATA_COLUMNS}
    text_base = source_base = 0
    for part in parts:
        for name in DATA_COLUMNS:
            column = part[name]
            if name == "text":
                column = column + text_base
            elif name == "source":
                column = column + source_base
            merged[name].append(column)
        text_base += int(part["text"].max()) + 1
        source_base += int(part["source"].max()) + 1
    return {name: torch.cat(columns) for name, columns in merged.items()}


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
    # "auto" does where the device computes bf16 natively (2.4x faster on an avx512_bf16 CPU)
    precision: str = "auto"
    # ctc: standardise the memory per dimension with the target's hidden-state statistics (and map
    # the output back); an experiment (issue #20 probes on the Qwen 1.5B), off by default
    standardize: bool = False
    # ctc: every slot its own residual block over the fused state; without them the slots stay near
    # copies of each other on the Qwen 1.5B and the module hardly learns (issue #20)
    slot_blocks: bool = True
    # Gaussian noise added to the training inputs' hidden states, in units of each dimension's spread
    # over the training data: a regulariser (EAGLE and CTC-drafter add uniform noise to theirs); the
    # Qwen 1.5B's CTC module fits its training texts far better than new ones (issue #20). 0: none
    noise: float = 0.0
    # ctc: a second layer re-reads the frames with each frame's top-1 choice embedded (an experiment:
    # the frames otherwise cannot see what their neighbours chose); both passes learn the labels
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
    """The module's logits for a batch; ``every_pass``: the list of every pass's (one but a refining
    CTC module's), for the loss."""
    if isinstance(module, MedusaHeads):
        logits = module(batch["memory"][:, -1])  # [B, heads, vocab]
        return [logits] if every_pass else logits
    device = batch["memory"].device

    @torch.no_grad()
    def embed(tokens: torch.Tensor) -> torch.Tensor:  # the frozen target's input embeddings
        return embeddings(tokens.to(embeddings.weight.device)).float().to(device)

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
    from speculum.drafters.ctc import ctc_collapse

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
    from tqdm.auto import tqdm

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
    module.projection.attach(lm_head_weight(spec.model))
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
            # every pass of a refining CTC module learns the labels (its first pass's choices stay meaningful)
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
