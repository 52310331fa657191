"""Chat questions written by the target itself, to train heads on chat text of MT-bench's kinds
without MT-bench's own questions (its 80 are the report set and the tuning prompts).

The target is asked, once per (category, subject) pair, for one request a user might send an
assistant; its greedy answers become a question file (``question_id``, ``category``, ``turns``)
that ``speculum train ... --texts FILE.jsonl --generate N`` continues like any prompt set. The
categories are MT-bench's eight; the subjects are a fixed list below, each paired with four
categories in turn, so the file is the same on every machine for the same model.

    python tools/make_chat_questions.py --model qwen2.5-coder-1.5b \
        --out benchmarks/data/qwen2.5-coder-1.5b-chat-questions.jsonl
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

CATEGORIES = {
    "writing": "a piece of writing to compose: an email, a blog post, a story, a speech",
    "roleplay": "a role for the assistant to play, or a character to speak as",
    "reasoning": "a puzzle or a question that needs careful step-by-step reasoning",
    "math": "a math problem with numbers to work out",
    "coding": "a programming task or a question about code",
    "extraction": "information to extract, summarise or reformat from a short text given in the request",
    "stem": "a question about science, technology or engineering",
    "humanities": "a question about history, economics, philosophy, art or society",
}
SUBJECTS = [
    "travel", "cooking", "personal finance", "climate change", "ancient Rome", "the solar system", "photosynthesis",
    "job interviews", "a small bakery business", "renewable energy", "chess", "the French Revolution",
    "machine learning", "healthy sleep", "a city park", "social media", "public transport", "volcanoes",
    "music theory", "a detective story", "a startup pitch", "a school science fair", "gardening",
    "the immune system", "databases", "a museum visit", "a wedding speech", "probability", "geometry",
    "electric cars", "ocean tides", "a product review", "supply and demand", "the printing press",
    "a mountain hike", "a customer complaint", "time management", "computer networks", "the water cycle",
    "a birthday party",
]  # fmt: skip
ASK = (
    "Write one request that a user might send to an AI assistant.\n"
    "Category: {category} ({description}).\nTopic: {subject}.\n"
    "Make it specific and self-contained, one to four sentences. Reply with the request only, no preamble."
)


def pairs(per_subject: int) -> list[tuple[str, str]]:
    names = list(CATEGORIES)
    return [(names[(i + j) % len(names)], s) for i, s in enumerate(SUBJECTS) for j in range(per_subject)]


def clean(text: str) -> str:
    text = text.strip()
    for prefix in ("Request:", "User:", "Question:"):
        if text.startswith(prefix):
            text = text[len(prefix) :].strip()
    if len(text) > 1 and text[0] == text[-1] and text[0] in "\"'":
        text = text[1:-1].strip()
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--out", required=True)
    parser.add_argument("--per-subject", type=int, default=4, help="categories asked per subject")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()

    import torch

    import speculum
    from speculum.poolfile import write_atomic

    if args.threads:
        torch.set_num_threads(args.threads)
    spec = speculum.load(args.model)
    asks = pairs(args.per_subject)
    rows, started = [], time.perf_counter()
    for first in range(0, len(asks), args.batch):
        chunk = asks[first : first + args.batch]
        prompts = [
            [{"role": "user", "content": ASK.format(category=c, description=CATEGORIES[c], subject=s)}]
            for c, s in chunk
        ]
        results = spec.generate(prompts, "autoregressive", max_new_tokens=args.max_new_tokens)
        for (category, subject), result in zip(chunk, results, strict=True):
            text = clean(result.text)
            ended = bool(result.token_ids) and result.token_ids[-1] in spec.eos_token_ids
            if ended and len(text) > 20:  # cut-off or empty answers are dropped
                rows.append({"question_id": len(rows) + 1, "category": category, "subject": subject, "turns": [text]})
        print(f"{first + len(chunk)}/{len(asks)} asked, {len(rows)} kept, {time.perf_counter() - started:.0f} s",
              flush=True)  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, "".join(json.dumps(r) + "\n" for r in rows).encode("utf-8"), what="question file")
    print(f"{len(rows)} questions -> {out}")


if __name__ == "__main__":
    main()
