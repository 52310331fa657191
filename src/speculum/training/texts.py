"""Text to train heads on without generating with the target (slow on a CPU).

A source is named like a prompt set, optionally sliced: ``mbpp``, ``gsm8k[100:]``, ``wmt16[50:150]``,
``mt_bench[40:]``, ``humaneval``, ``stdlib[:60]`` (the Python standard library's own source files),
or a path (a ``.jsonl`` question file, a text/source file, or a directory of them). Each text is an
(instruction, response) pair where the set ships answers (MBPP code, GSM8K solutions, HumanEval
canonical solutions, WMT16 reference translations); heads learn only on the response part, laid
out with the target's chat template where it has one, as at inference. Slices keep training
text away from the prompts a report measures (the report runs use the first prompts of each set).
"""

from __future__ import annotations

import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from speculum.bench.datasets import DATASETS, GSM8K_INSTRUCTION, Prompt, _question_prompt, _read_jsonl, _vendored
from speculum.errors import InvalidInputError

_SLICE = re.compile(r"^(?P<name>[^\[]+)(?:\[(?P<start>-?\d*):(?P<stop>-?\d*)\])?$")
NAMED = ("mbpp", "humaneval", "gsm8k", "mt_bench", "wmt16", "stdlib")


@dataclass
class TrainingText:
    source: str
    instruction: str  # "" for plain text (source files): everything is response
    response: str
    # the prompt as ``speculum bench`` lays it out (prompt sets and question files): what the target
    # continues when heads train on its own output, so they learn the layout they will see
    prompt: Prompt | None = None


# each prompt set's vendored file and (instruction, response) of one row
_SETS = {
    "mbpp": ("mbpp.jsonl", lambda r: (r["text"], r["code"].replace("\r\n", "\n"))),
    "humaneval": ("humaneval.jsonl", lambda r: ("", r["prompt"] + r.get("canonical_solution", ""))),
    "gsm8k": ("gsm8k_test_part1.jsonl", lambda r: (f"{GSM8K_INSTRUCTION}\n\n{r['question']}", r["answer"])),
    "mt_bench": ("mt_bench_questions.jsonl", lambda r: ("", "\n\n".join(r["turns"]))),  # questions: text only
    "wmt16": ("wmt16_deen_sample.jsonl", lambda r: (f"Translate German to English: {r['de']}", r["en"])),
}


def _named(name: str) -> list[TrainingText]:
    if name in _SETS:
        file, layout = _SETS[name]
        rows, prompts = _vendored(file), DATASETS[name](None)
        return [TrainingText(name, *layout(r), prompt) for r, prompt in zip(rows, prompts, strict=True)]
    if name == "stdlib":
        root = Path(sysconfig.get_paths()["stdlib"])
        return [TrainingText(f"stdlib/{p.name}", "", p.read_text(errors="replace")) for p in sorted(root.glob("*.py"))]
    raise AssertionError(name)


def _path(path: Path) -> list[TrainingText]:
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in (".py", ".txt", ".md") and p.is_file())
        return [TrainingText(str(p), "", p.read_text(errors="replace")) for p in files]
    if path.suffix == ".jsonl":
        out = []
        for r in _read_jsonl(path):
            turns = r.get("turns")
            if not isinstance(turns, list) or not all(isinstance(t, str) for t in turns):
                raise InvalidInputError(f"{path}: every line needs a 'turns' list of strings")
            out.append(TrainingText(path.stem, "", "\n\n".join(turns), _question_prompt(path.stem, r)))
        return out
    return [TrainingText(str(path), "", path.read_text(errors="replace"))]


def training_texts(sources: list[str] | str) -> list[TrainingText]:
    """Every text of ``sources`` (names, sliced names or paths; a comma-separated string works too)."""
    if isinstance(sources, str):
        sources = [s for s in sources.split(",") if s.strip()]
    if not sources:
        raise InvalidInputError("no training text sources given")
    texts: list[TrainingText] = []
    for source in sources:
        source = source.strip()
        match = _SLICE.match(source)
        name = match.group("name") if match else source
        if name in NAMED:
            items = _named(name)
        elif Path(name).exists():
            items = _path(Path(name))
        else:
            raise InvalidInputError(
                f"unknown text source {source!r}: use one of {', '.join(NAMED)} (optionally sliced, "
                "e.g. gsm8k[100:]) or an existing path"
            )
        if match and (match.group("start") or match.group("stop")):
            start = int(match.group("start")) if match.group("start") else None
            stop = int(match.group("stop")) if match.group("stop") else None
            for bound in (start, stop):  # a slice past the end would quietly give fewer texts than asked
                if bound is not None and abs(bound) > len(items):
                    raise InvalidInputError(f"{source}: {name} has {len(items)} texts")
            items = items[start:stop]
        texts.extend(t for t in items if t.response.strip())
    if not texts:
        raise InvalidInputError(f"the sources {sources} hold no text")
    return texts


def prompt_for_generation(spec, text: TrainingText, plain_prefix: int = 64) -> list[int]:
    """The prompt the target continues when heads train on its own output: the text's prompt as
    ``speculum bench`` lays it out (chat template where that set uses one and the tokenizer has
    one), or for plain text (source files) its first ``plain_prefix`` tokens."""
    if text.prompt is not None:
        has_template = bool(getattr(spec.tokenizer, "chat_template", None))
        return spec.encode_prompt(text.prompt.render(text.prompt.chat_default and has_template))
    ids, _ = encode(spec.tokenizer, text, plain_prefix)
    return ids


def generation_layouts(spec, text: TrainingText, raw: bool = True) -> list[list[int]]:
    """Every prompt the target continues for ``text``: :func:`prompt_for_generation`'s, and with
    ``raw`` where that one is chat-templated, the same prompt as a raw completion too (users send
    both: a chat client's messages, a completion client's bare text)."""
    layouts = [prompt_for_generation(spec, text)]
    templated = text.prompt is not None and text.prompt.chat_default and getattr(spec.tokenizer, "chat_template", None)
    if raw and templated:
        layouts.append(spec.encode_prompt(text.prompt.render(False)))
    return layouts


def encode(tokenizer, text: TrainingText, max_tokens: int) -> tuple[list[int], int]:
    """Token ids of ``text`` laid out as at inference (chat template when there is an instruction and
    the tokenizer has one) and the index where the response starts; cut to ``max_tokens``."""
    if text.instruction and getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": text.instruction}]
        head = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt_ids = tokenizer(head, add_special_tokens=False)["input_ids"]
    elif text.instruction:
        prompt_ids = tokenizer(text.instruction + "\n", add_special_tokens=True)["input_ids"]
    else:
        prompt_ids = tokenizer("", add_special_tokens=True)["input_ids"]
    response_ids = tokenizer(text.response, add_special_tokens=False)["input_ids"]
    ids = list(prompt_ids) + list(response_ids)
    return ids[:max_tokens], min(len(prompt_ids), max_tokens)
