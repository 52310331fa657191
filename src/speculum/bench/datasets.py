"""Prompt sets for the bench: the five vendored sets and Spec-Bench style ``question.jsonl`` files.

Every loader returns a list of :class:`Prompt`. A prompt carries the user text (sent as one chat
message when the chat template is applied) and ``raw`` (what a plain completion model is given
when it is not). Multi-turn sets (MT-bench, Spec-Bench) contribute their **first turn only**:
the bench measures decoding speed, and a second turn would make every method's prompt depend on
its own first answer.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from speculum.errors import InvalidInputError

GSM8K_INSTRUCTION = (
    "Solve the following math problem. Reason step by step, then give the final answer "
    'on the last line as "#### <number>".'
)


@dataclass(frozen=True)
class Prompt:
    dataset: str
    question_id: Any
    category: str
    text: str  # the user message (chat mode)
    raw: str  # the plain-text prompt (completion mode)
    chat_default: bool  # whether the chat template is applied by default (when the tokenizer has one)

    def render(self, chat: bool) -> str | list[dict[str, str]]:
        """The prompt as ``spec.encode_prompt`` takes it: chat messages or raw text."""
        if chat:
            return [{"role": "user", "content": self.text}]
        return self.raw


def _read_jsonl(path: Path | Any) -> list[dict]:
    out = []
    with path.open("r", encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise InvalidInputError(f"{path}: line {n} is not valid JSON ({e.msg})") from None
    return out


def _vendored(name: str) -> list[dict]:
    return _read_jsonl(resources.files("speculum.data").joinpath(name))


def _limit(rows: Iterable[dict], limit: int | None) -> list[dict]:
    rows = list(rows)
    return rows if limit is None else rows[: max(0, limit)]


def load_humaneval(limit: int | None = None) -> list[Prompt]:
    """HumanEval as code completion: the raw ``prompt`` field, never a chat template by default."""
    return [
        Prompt("humaneval", r["task_id"], "coding", r["prompt"], r["prompt"], False)
        for r in _limit(_vendored("humaneval.jsonl"), limit)
    ]


def load_gsm8k(limit: int | None = None) -> list[Prompt]:
    out = []
    for i, r in enumerate(_limit(_vendored("gsm8k_test_part1.jsonl"), limit)):
        text = f"{GSM8K_INSTRUCTION}\n\n{r['question']}"
        raw = f"Question: {r['question']}\nAnswer: Let's think step by step."
        out.append(Prompt("gsm8k", i, "math_reasoning", text, raw, True))
    return out


def load_mt_bench(limit: int | None = None) -> list[Prompt]:
    """MT-bench: first turn only (as a chat message)."""
    return [_question_prompt("mt_bench", r) for r in _limit(_vendored("mt_bench_questions.jsonl"), limit)]


def load_wmt16(limit: int | None = None) -> list[Prompt]:
    out = []
    for r in _limit(_vendored("wmt16_deen_sample.jsonl"), limit):
        text = f"Translate German to English: {r['de']}"
        raw = f"Translate German to English.\nGerman: {r['de']}\nEnglish:"
        out.append(Prompt("wmt16", r["line_no"], "translation", text, raw, True))
    return out


def load_mbpp(limit: int | None = None) -> list[Prompt]:
    """MBPP: the task text plus its first test, as a chat message."""
    out = []
    for r in _limit(_vendored("mbpp.jsonl"), limit):
        test = r["test_list"][0] if r.get("test_list") else ""
        text = f"{r['text']}\nYour code should pass this test:\n{test}".rstrip()
        raw = f'"""\n{text}\n"""\n'
        out.append(Prompt("mbpp", r["task_id"], "coding", text, raw, True))
    return out


def _question_prompt(dataset: str, r: dict) -> Prompt:
    turns = r.get("turns")
    if not isinstance(turns, list) or not turns or not isinstance(turns[0], str):
        raise InvalidInputError(f"{dataset}: question {r.get('question_id')!r} has no 'turns' list of strings")
    return Prompt(dataset, r.get("question_id"), str(r.get("category", "")), turns[0], turns[0], True)


def load_question_file(path: str | Path, limit: int | None = None) -> list[Prompt]:
    """A Spec-Bench / MT-bench ``question.jsonl`` (question_id, category, turns): first turn only.

    The dataset name is the file name without its extension.
    """
    p = Path(path)
    if not p.is_file():
        raise InvalidInputError(f"dataset file not found: {path}")
    rows = _read_jsonl(p)
    return [_question_prompt(p.stem, r) for r in _limit(rows, limit)]


DATASETS: dict[str, Callable[[int | None], list[Prompt]]] = {
    "humaneval": load_humaneval,
    "gsm8k": load_gsm8k,
    "mt_bench": load_mt_bench,
    "wmt16": load_wmt16,
    "mbpp": load_mbpp,
}


def split_names(values: Iterable[str] | str | None) -> list[str]:
    """``["humaneval,gsm8k", "mt_bench"]`` -> ``["humaneval", "gsm8k", "mt_bench"]`` (order kept, no repeats)."""
    if values is None:
        return []
    if isinstance(values, str):
        values = [values]
    out: list[str] = []
    for v in values:
        for part in v.split(","):
            part = part.strip()
            if part and part not in out:
                out.append(part)
    return out


def _is_path(name: str) -> bool:
    return name.endswith(".jsonl") or "/" in name or "\\" in name or Path(name).is_file()


def check_dataset_name(name: str) -> None:
    """Raise :class:`InvalidInputError` unless ``name`` is a known set or an existing file."""
    if name in DATASETS:
        return
    if _is_path(name):
        if not Path(name).is_file():
            raise InvalidInputError(f"dataset file not found: {name}")
        return
    raise InvalidInputError(
        f"unknown dataset {name!r}; choose from {', '.join(DATASETS)} or give a path to a question.jsonl file"
    )


def load_dataset(name: str, limit: int | None = None) -> list[Prompt]:
    """One set by name (``humaneval``, ``gsm8k``, ``mt_bench``, ``wmt16``, ``mbpp``) or by path."""
    check_dataset_name(name)
    if name in DATASETS:
        return DATASETS[name](limit)
    return load_question_file(name, limit)


def load_datasets(names: Iterable[str] | str, limit: int | None = None) -> dict[str, list[Prompt]]:
    """Several sets, keyed by dataset name (a file's name is its stem). All names are checked first."""
    names = split_names(names)
    if not names:
        raise InvalidInputError("no dataset given")
    for n in names:
        check_dataset_name(n)
    out: dict[str, list[Prompt]] = {}
    for n in names:
        prompts = load_dataset(n, limit)
        key = prompts[0].dataset if prompts else (n if n in DATASETS else Path(n).stem)
        out[key] = prompts
    return out
