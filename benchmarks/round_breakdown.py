"""Where a method's rounds spend their time, from one ``speculum bench`` run's records.

    python benchmarks/round_breakdown.py bench-out/i18/qwen-bf16p-greedy-128 [--methods draft_model,auto] [--out F]

A method's speedup over plain decoding factors exactly into what a round gives and what it costs:

    speedup = L * t_plain / t_round,   t_round = verify + draft + catch-up + control + other

where L is the tokens committed per target forward (the bonus token included) and t_plain is
``autoregressive``'s time per forward in the same run (prefill left out of both). Each part of a
round is given in units of t_plain, so a reader sees at once what drafting costs against what a
longer commit brings: e.g. ``draft 1.40`` means each round spent 1.4 plain steps drafting. Per set
and over all prompts; rounds are target forwards.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

BASE = "autoregressive"
PARTS = ("time_verify", "time_draft", "time_draft_catch_up", "time_control", "time_other")


def load(run: Path) -> list[dict]:
    with open(run / "records.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def totals(records: list[dict]) -> dict[tuple[str, str], dict[str, float]]:
    """(set, method) -> summed tokens, forwards, plain-path seconds and each part's seconds
    (records of a set also count under ``all``)."""
    sums: dict[tuple[str, str], dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for r in records:
        if not r.get("target_forwards"):  # transformers' rows count no forwards
            continue
        for group in (r["dataset"], "all"):
            s = sums[group, r["method"]]
            s["tokens"] += r["new_tokens"]
            s["forwards"] += r["target_forwards"]
            s["wall"] += r["wall_time"]
            s["prefill"] += r.get("time_prefill") or 0.0
            for part in PARTS:
                s[part] += r.get(part, 0.0) or 0.0
            s["time_draft"] -= r.get("time_draft_catch_up", 0.0) or 0.0  # (catching up is part of time_draft)
    return sums


def report(records: list[dict], methods: list[str] | None) -> str:
    sums = totals(records)
    groups = list(dict.fromkeys([r["dataset"] for r in records] + ["all"]))
    names = methods or [m for m in dict.fromkeys(r["method"] for r in records) if m != BASE and not m.startswith("hf_")]
    lines = [
        "| set | method | L (tokens / forward) | verify | draft | catch-up | control | other | round "
        "| L / round | measured |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for group in groups:
        base = sums.get((group, BASE))
        if not base or not base["forwards"]:
            continue
        # plain decoding's seconds per forward, prefill left out (its forwards are its tokens)
        t_plain = (base["wall"] - base["prefill"]) / base["forwards"]
        plain_rate = base["tokens"] / base["wall"]
        for method in names:
            s = sums.get((group, method))
            if not s or not s["forwards"]:
                continue
            per_round = {part: s[part] / s["forwards"] / t_plain for part in PARTS}
            round_cost = sum(per_round.values())
            length = s["tokens"] / s["forwards"]
            measured = (s["tokens"] / s["wall"]) / plain_rate
            parts = " | ".join(f"{per_round[part]:.2f}" for part in PARTS)
            lines.append(
                f"| {group} | `{method}` | {length:.2f} | {parts} | {round_cost:.2f} "
                f"| {length / round_cost:.2f}× | {measured:.2f}× |"
            )
    note = (
        "\nParts of a round in plain steps (t_plain: `autoregressive`'s seconds per forward in the same run, "
        "prefill left out); `L / round` is the speedup with prefill left out, `measured` (tokens/s over plain's) "
        "keeps it in. `catch-up`: a draft model processing committed text it did not draft (after plain rounds "
        "and its own rejected tokens); `other`: the engine's bookkeeping."
    )
    return "\n".join(lines) + "\n" + note + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="a speculum bench --out folder (holds records.jsonl)")
    parser.add_argument("--methods", help="comma-separated methods (default: every speculum method but the baseline)")
    parser.add_argument("--out", type=Path, help="also write the table here")
    args = parser.parse_args()
    if not (args.run / "records.jsonl").is_file():
        parser.error(f"{args.run} holds no records.jsonl")
    text = report(load(args.run), args.methods.split(",") if args.methods else None)
    print(text)
    if args.out:
        args.out.write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main()
