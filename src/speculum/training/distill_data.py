"""The distillation data of draft heads: what the target says at every position of the training texts.

One forward of the target over each training sequence gives, at every position, its last hidden
state (the LM head's input, stored float16) and its own next-token prediction (argmax). Heads learn
what *this target* would say: the labels are its predictions, not the text
(:mod:`speculum.training.draft_heads` trains them). Two kinds of sequence:

- teacher-forced text (the default, cheap: the target does not generate): the prompt sets' own
  answers and source files. Where the text leaves the target's own path (a small model agrees
  with the text only part of the time), the labels after it are predictions along a path the
  target would not write, so the trainer counts a root's labels only while the text agrees with
  the target (``HeadSettings.consistent``);
- the target's own greedy continuations of the prompts (``generate``): slower to make, but every
  position is on the target's own path. speculum's own batched engine makes them (rows leave at
  their end-of-sequence token), in the layouts users send (a chat-templated prompt also as a raw
  completion), written to ``continuations.jsonl`` after every batch: an interrupted run resumes
  where it stopped.

The data is cached in the output directory and remade only when its inputs change (or when asked).
The data pass itself is saved in parts as it goes (``distill_data.safetensors.parts``): an
interrupted pass resumes after the last part instead of starting over.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import safetensors.torch
import torch
from safetensors import SafetensorError, safe_open
from tqdm.auto import tqdm

from speculum.errors import CheckpointError, InvalidInputError
from speculum.heads.checkpoint import model_fingerprint
from speculum.poolfile import write_atomic
from speculum.runner import ModelRunner
from speculum.training.common import cached_tensors, stored_key
from speculum.training.texts import TrainingText, encode, generation_layouts

DATA_FILE = "distill_data.safetensors"
CONTINUATIONS_FILE = "continuations.jsonl"  # beside the data file: the target's continuations so far
DATA_COLUMNS = ("hidden", "label", "token", "text", "source", "response")  # see make_data


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
        self.folder.mkdir(parents=True, exist_ok=True)
        data = {name: torch.cat(parts) for name, parts in columns.items()}
        blob = safetensors.torch.save(data, metadata={"key": self.key, "first": str(first), "stop": str(stop)})
        path = self.folder / f"part-{first:07d}.safetensors"
        write_atomic(path, blob, what="training data part", error=CheckpointError)

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


PART_TEXTS = 32  # sequences per saved part of a data pass (about a minute of a 1.5B target's time on a CPU)


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


def append_data(spec, data: dict[str, torch.Tensor], files: list[Path]) -> dict[str, torch.Tensor]:
    """``data`` followed by the data files earlier runs made for the same target (``--extra-data``):
    a data pass is the costly part, so data made for other texts is reused as it is. Sequence and
    source numbers are shifted so that every file's texts stay apart (and in the validation split)."""
    parts = [data]
    hidden_size = spec.model.config.get_text_config().hidden_size
    for file in files:
        try:
            extra = safetensors.torch.load_file(str(file))
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
