"""Batched decoding throughput: aggregate output tokens/s of B prompts decoded together.

For each batch size B, in one run, methods interleaved per batch of prompts:

- ``hf_generate``: transformers' ``generate`` on the same prompts, left-padded, greedy, stopping at
  the same EOS tokens (a finished row of a padded batch keeps being computed; only its tokens up
  to EOS are counted);
- ``one_at_a_time``: speculum's plain decoding, one request after the other (today's server);
- each method named (``autoregressive`` is batched plain decoding), through
  ``spec.generate([...])``: one target forward per step for every row.

Each batched row is compared with its single-request output (greedy), and the table says how many
are identical; for each row that is not, a second table gives the target's logit gap between the two
competing tokens at the first difference (one plain forward over the shared prefix): a gap of the
order of the dtype's rounding step is a near-tie that batched and single-row kernels round apart.
Prompts come from the report sets (HumanEval, GSM8K, MT-bench, WMT16), chat template where the set
uses one::

    python benchmarks/batch_throughput.py gemma-3-270m --dtype float32 --batches 1,4,16 \\
        --methods autoregressive,prompt_lookup,anpd --max-new-tokens 128

``--fresh`` runs every (batch, method) in a process of its own, as a user's first
``spec.generate([...])`` runs: nothing learned by an earlier batch (the controller's verdicts,
``auto``'s gates) helps a later one. Only the named methods run then (no peers, no single-request
outputs: rows are compared with batched ``autoregressive``'s, the first method). ``--ids`` picks
prompts by their dataset id, e.g. held-out MT-bench questions::

    python benchmarks/batch_throughput.py qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --fresh \\
        --datasets mt_bench --per-set 80 --ids 101,102,111,112,131,132,141,142,151,152 \\
        --batches 1,4,10 --methods autoregressive,auto --groups 1 --max-new-tokens 128

Prints a markdown table with a machine/date/command header (and writes it to ``--out``).
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch

from speculum.bench.datasets import load_datasets
from speculum.bench.report import machine_info, now_iso


def hf_generate(spec, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy generate over a left-padded batch; each row cut after its first EOS."""
    pad = spec.tokenizer.pad_token_id if spec.tokenizer.pad_token_id is not None else 0
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = spec.model.generate(
        input_ids=ids.to(spec.runner.input_device),
        attention_mask=mask.to(spec.runner.input_device),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=pad,
        eos_token_id=sorted(spec.eos_token_ids) or None,
    )
    rows = []
    for row in out[:, width:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in spec.eos_token_ids), len(row))
        rows.append(row[:cut])
    return rows


@torch.inference_mode()
def logit_gap(spec, prefix: list[int], a: int, b: int) -> float:
    """|logit(a) - logit(b)| after ``prefix``, from one plain forward of the target."""
    logits = spec.model(input_ids=torch.tensor([prefix], device=spec.runner.input_device)).logits[0, -1].float()
    return abs(float(logits[a] - logits[b]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default="gemma-3-270m")
    ap.add_argument("--draft", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default="none", help="none, gguf (the file's own blocks) or auto")
    ap.add_argument("--batches", default="1,4,16", help="comma-separated batch sizes B")
    ap.add_argument("--methods", default="autoregressive,prompt_lookup,anpd")
    ap.add_argument("--datasets", default="humaneval,gsm8k,mt_bench,wmt16")
    ap.add_argument("--per-set", type=int, default=4, help="prompts taken from each set (the pool rows cycle over)")
    ap.add_argument("--groups", type=int, default=2, help="batches timed per B (different prompts each)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--exact", default="auto", choices=["auto", "on", "off"], help="speculum.load's exact")
    ap.add_argument("--out", default=None, help="also write the table here")
    ap.add_argument("--ids", default=None, help="comma-separated prompt ids to keep (e.g. MT-bench question ids)")
    ap.add_argument("--repeats", type=int, default=1, help="times each of --methods is timed per batch, in turn")
    ap.add_argument("--fresh", action="store_true", help="each (batch, method) in a fresh process (see above)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)  # (--fresh's worker: a JSON job)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.fresh:
        return fresh_main(args, argv)

    import speculum

    exact = {"on": True, "off": False}.get(args.exact, args.exact)
    spec = speculum.load(args.model, draft=args.draft, dtype=args.dtype, exact=exact, quantization=args.quantization)
    pool = prompt_pool(spec, args)
    if args.child is not None:
        return child(spec, pool, json.loads(args.child))
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    batches = [int(b) for b in args.batches.split(",")]
    n = args.max_new_tokens

    single: dict[int, list[int]] = {}  # prompt index -> its single-request greedy output

    def one(i: int) -> list[int]:
        if i not in single:
            single[i] = spec.generate(pool[i], "autoregressive", max_new_tokens=n).token_ids
        return single[i]

    for method in ["autoregressive", *methods]:  # warm-up (first forwards, cost models, a draft's first load)
        spec.generate(pool[:2], method, max_new_tokens=8)
    hf_generate(spec, pool[:2], 8)
    totals: dict[tuple[int, str], list[float]] = {}  # (B, method) -> [tokens, seconds, identical, rows]
    mismatches: list[tuple[int, str, int, list[int], list[int]]] = []  # (B, method, prompt, single, batched)
    offset = 0
    for batch in batches:
        for group in range(args.groups):
            index = [(offset + group * batch + r) % len(pool) for r in range(batch)]
            prompts = [pool[i] for i in index]
            # --repeats: the methods timed again in turn, the order reversed each time (the host drifts)
            timed = [m for rep in range(args.repeats) for m in (methods if rep % 2 == 0 else methods[::-1])]
            for method in ["hf_generate", "one_at_a_time", *timed]:
                start = time.perf_counter()
                if method == "hf_generate":
                    outputs = hf_generate(spec, prompts, n)
                elif method == "one_at_a_time":
                    single.update({i: spec.generate(pool[i], "autoregressive", max_new_tokens=n).token_ids
                                   for i in index})  # fmt: skip
                    outputs = [single[i] for i in index]
                else:
                    outputs = [r.token_ids for r in spec.generate(prompts, method, max_new_tokens=n)]
                seconds = time.perf_counter() - start
                same = sum(out == one(i) for out, i in zip(outputs, index, strict=True))
                mismatches += [(batch, method, i, one(i), out) for out, i in zip(outputs, index, strict=True)
                               if out != one(i)]  # fmt: skip
                t = totals.setdefault((batch, method), [0.0, 0.0, 0, 0])
                t[0] += sum(len(o) for o in outputs)
                t[1] += seconds
                t[2] += same
                t[3] += batch
                print(f"B={batch} group {group} {method}: {sum(len(o) for o in outputs) / seconds:.1f} tok/s, "
                      f"{same}/{batch} identical", file=sys.stderr, flush=True)  # fmt: skip
        offset += args.groups * batch

    mach = machine_info()
    given = argv if argv is not None else sys.argv[1:]
    lines = [
        "# batched decoding throughput",
        "",
        f"- command: `{shlex.join(['python', 'benchmarks/batch_throughput.py', *given])}`",
        f"- date: {now_iso()}",
        f"- machine: {mach.get('cpu')}, {torch.get_num_threads()} threads; torch {mach.get('torch')}, "
        f"transformers {mach.get('transformers')}",
        f"- model: `{args.model}`" + (f", draft `{args.draft}`" if args.draft else "") + f"; {spec.runner.dtype}, "
        f"quantization {args.quantization}; {args.groups} batches per B from {len(pool)} prompts ({args.datasets}); "
        f"greedy, up to {n} new tokens, "
        "stopping at EOS",
        "- tokens/s is the aggregate over the batch's rows; ratios are to `hf_generate` and to batched "
        "`autoregressive` at the same B; identical: rows equal to their single-request output",
        "",
        "| B | method | tokens/s | × hf_generate | × batched plain | × one at a time | identical |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for batch in batches:
        rate = {m: totals[(batch, m)][0] / totals[(batch, m)][1] for m in ["hf_generate", "one_at_a_time", *methods]}
        plain = rate.get("autoregressive")
        for m in ["hf_generate", "one_at_a_time", *methods]:
            tok, _, same, rows = totals[(batch, m)]
            vs_plain = f"{rate[m] / plain:.2f}×" if plain else "–"
            lines.append(
                f"| {batch} | `{m}` | {rate[m]:.1f} | {rate[m] / rate['hf_generate']:.2f}× | {vs_plain} | "
                f"{rate[m] / rate['one_at_a_time']:.2f}× | {int(same)}/{int(rows)} |"
            )
    if mismatches:
        lines += [
            "",
            f"Rows not identical to their single-request output: the target's logit gap ({spec.runner.dtype}) "
            "between the single-request token and the batched one at the first difference.",
            "",
            "| B | method | prompt | position | gap |",
            "|---:|---|---:|---:|---:|",
        ]
        for batch, method, i, single_out, batched_out in mismatches:
            at = next((k for k, (x, y) in enumerate(zip(single_out, batched_out, strict=False)) if x != y), None)
            if at is None:  # one is a prefix of the other (an EOS taken apart)
                lines.append(f"| {batch} | `{method}` | {i} | {min(len(single_out), len(batched_out))} | – |")
                continue
            gap = logit_gap(spec, pool[i] + single_out[:at], single_out[at], batched_out[at])
            lines.append(f"| {batch} | `{method}` | {i} | {at} | {gap:.3f} |")
    return emit(lines, args.out)


def emit(lines: list[str], out: str | None) -> int:
    """Print the table (and write it to ``out``); the exit status."""
    text = "\n".join(lines) + "\n"
    print(text)
    if out:
        Path(out).write_text(text)
    return 0


def prompt_pool(spec, args) -> list[list[int]]:
    """The prompts' token ids (only those of ``--ids`` when given, in the sets' order)."""
    sets = load_datasets(args.datasets, args.per_set)
    chat = bool(getattr(spec.tokenizer, "chat_template", None))
    wanted = None if args.ids is None else {i.strip() for i in args.ids.split(",") if i.strip()}
    prompts = [p for ps in sets.values() for p in ps if wanted is None or str(p.question_id) in wanted]
    if not prompts:
        raise SystemExit("no prompt matches --ids")
    return [spec.encode_prompt(p.render(chat and p.chat_default)) for p in prompts]


def child(spec, pool: list[list[int]], job: dict) -> int:
    """One timed batch in this fresh process, as a user's first call (no warm-up: every method pays
    its own first forwards; only the cost model is read first, from the disk cache where a machine
    measures it once); prints its result as one JSON line."""
    spec.cost_model  # noqa: B018 - read (or, the first time on this machine, measured) before timing
    prompts = [pool[i] for i in job["index"]]
    start = time.perf_counter()
    results = spec.generate(prompts, job["method"], max_new_tokens=job["max_new_tokens"])
    seconds = time.perf_counter() - start
    stats = [r.stats for r in results]
    accepted_by: dict[str, int] = {}
    for s in stats:
        for by, n in s.accepted_by.items():
            accepted_by[by] = accepted_by.get(by, 0) + n
    print("RESULT " + json.dumps({
        "outputs": [r.token_ids for r in results], "seconds": seconds,
        "rounds_drafted": sum(s.rounds_drafted for s in stats), "rounds_plain": sum(s.rounds_plain for s in stats),
        "draft_seconds": max(s.time_draft for s in stats),
        "catch_up_seconds": max(s.time_draft_catch_up for s in stats),
        "verify_seconds": max(s.time_verify for s in stats), "mean_tree": sum(sum(s.draft_sizes) for s in stats)
        / max(1, sum(len(s.draft_sizes) for s in stats)), "accepted_by": accepted_by,
        # the drafted rounds as the controller predicted them against what they gave and cost (each
        # row's share of a step), summed over the rows
        "predicted": [sum(s.predicted_tokens for s in stats), sum(s.predicted_time for s in stats)],
        "drafted": [sum(s.drafted_round_tokens for s in stats), sum(s.drafted_round_time for s in stats)],
    }))  # fmt: skip
    return 0


def fresh_main(args, argv: list[str] | None) -> int:
    """``--fresh``: every (group, method) a child process of this script; methods interleaved per group."""
    given = argv if argv is not None else sys.argv[1:]
    base = [a for a in given if a != "--fresh"]
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    batches = [int(b) for b in args.batches.split(",")]
    pool_size = len(args.ids.split(",")) if args.ids else None
    totals: dict[tuple[int, str], list[float]] = {}  # (B, method) -> [tokens, seconds, identical, rows]
    trace: list[str] = []  # one line per batch run: what its rows drafted, predicted and cost
    offset = 0
    for batch in batches:
        for group in range(args.groups):
            size = pool_size or batch * args.groups
            index = [(offset + group * batch + r) % size for r in range(batch)]
            reference = None
            for method in methods:
                job = {"index": index, "method": method, "max_new_tokens": args.max_new_tokens}
                cmd = [sys.executable, __file__, *base, "--child", json.dumps(job)]
                done = subprocess.run(cmd, capture_output=True, text=True)
                if done.returncode != 0:
                    sys.stderr.write(done.stderr[-4000:])
                    raise SystemExit(f"{method} at B={batch} failed (exit {done.returncode})")
                line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
                result = json.loads(line[len("RESULT ") :])
                outputs = result["outputs"]
                reference = outputs if reference is None else reference
                same = sum(a == b for a, b in zip(outputs, reference, strict=True))
                t = totals.setdefault((batch, method), [0.0, 0.0, 0, 0])
                t[0] += sum(len(o) for o in outputs)
                t[1] += result["seconds"]
                t[2] += same
                t[3] += batch
                rate = sum(len(o) for o in outputs) / result["seconds"]
                (p_tokens, p_seconds), (d_tokens, d_seconds) = result["predicted"], result["drafted"]
                trace.append(f"B={batch} group {group} {method}: {rate:.1f} tok/s, {same}/{batch} as {methods[0]}, "
                      f"rounds drafted/plain {result['rounds_drafted']}/{result['rounds_plain']}, "
                      f"draft {result['draft_seconds']:.1f} s (catch-up {result['catch_up_seconds']:.1f}), "
                      f"verify {result['verify_seconds']:.1f} s, tree {result['mean_tree']:.1f}, "
                      f"drafted rounds predicted {p_tokens:.0f} tokens in {p_seconds:.1f} s, "
                      f"gave {d_tokens:.0f} in {d_seconds:.1f} s, accepted by {result['accepted_by']}")  # fmt: skip
                print(trace[-1], file=sys.stderr, flush=True)
        offset += args.groups * batch
    mach = machine_info()
    lines = [
        "# batched decoding throughput, each batch in a fresh process",
        "",
        f"- command: `{shlex.join(['python', 'benchmarks/batch_throughput.py', *given])}`",
        f"- date: {now_iso()}",
        f"- machine: {mach.get('cpu')} (flags {mach.get('cpu_flags')}), {torch.get_num_threads()} threads; "
        f"torch {mach.get('torch')}, transformers {mach.get('transformers')}; commit {git_commit()}",
        f"- model: `{args.model}`" + (f", draft `{args.draft}`" if args.draft else "") + f", dtype {args.dtype}, "
        f"quantization {args.quantization}; {args.groups} batch(es) per B; greedy, up to {args.max_new_tokens} "
        "new tokens, stopping at EOS",
        f"- tokens/s is the aggregate over the batch's rows; identical: rows equal to batched `{methods[0]}`'s",
        "",
        f"| B | method | tokens/s | × `{methods[0]}` | identical |",
        "|---:|---|---:|---:|---:|",
    ]
    for batch in batches:
        first = totals[(batch, methods[0])][0] / totals[(batch, methods[0])][1]
        for m in methods:
            tok, sec, same, rows = totals[(batch, m)]
            lines.append(f"| {batch} | `{m}` | {tok / sec:.1f} | {tok / sec / first:.2f}× | {int(same)}/{int(rows)} |")
    lines += ["", "Each batch run (draft and verify seconds: the slowest row's):", "", "```", *trace, "```"]
    return emit(lines, args.out)


def git_commit() -> str:
    """This checkout's commit (with "+" where it has changes), or "unknown" outside git."""
    root = Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "-uno"], cwd=root, capture_output=True, text=True)
    except OSError:
        return "unknown"
    return (head.stdout.strip() or "unknown") + ("+" if dirty.stdout.strip() else "")


if __name__ == "__main__":
    raise SystemExit(main())
