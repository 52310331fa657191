"""Summaries of bench records: per dataset and overall, per method; markdown and JSON output.

Definitions (per group of records, per method):

- tokens/s = Σ new tokens / Σ wall time
- speedup = tokens/s of the method / tokens/s of the baseline, over the prompts both completed;
  "mean/prompt" is the mean of the per-prompt ratios of tokens/s
- mean acceptance length = Σ tokens committed by verification steps / Σ verification forwards (from
  ``accept_lengths``; bonus token included; 1.00 for plain decoding); rows without ``accept_lengths``
  use Σ new tokens / Σ target forwards
- draft acceptance rate = Σ accepted draft tokens / Σ drafted tokens (mean of the per-generation
  rates when the counts are missing)
- time split = Σ time_prefill, Σ time_draft, Σ time_verify, Σ time_other as shares of their total
- identical = generations whose token ids equal the baseline's, out of those compared
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
from collections.abc import Iterable
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch
import transformers
from rich.console import Console
from rich.markdown import Markdown

OVERALL = "overall"


# ----------------------------------------------------------------------------------------------
# machine


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


# the flags that decide bfloat16's speed and which kernels run (every figure names them)
KERNEL_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_int8", "amx_tile")


def cpu_flags() -> str:
    """The CPU's flags among ``KERNEL_FLAGS`` (from /proc/cpuinfo; "unknown" where there is none)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            line = next(line for line in f if line.startswith("flags"))
    except (OSError, StopIteration):
        return "unknown"
    present = set(line.split(":", 1)[1].split())
    return " ".join(flag for flag in KERNEL_FLAGS if flag in present)


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "cpu": cpu_model(),
        "cpu_flags": cpu_flags(),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }
    info["torch"] = torch.__version__
    info["threads"] = torch.get_num_threads()
    info["cpu_capability"] = torch.backends.cpu.get_cpu_capability()  # which machine defaults apply
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    info["transformers"] = transformers.__version__
    try:
        info["speculum"] = version("speculum")
    except Exception:  # noqa: BLE001 - not installed as a distribution
        pass
    return info


def now_iso() -> str:
    return _dt.datetime.now().astimezone().isoformat(timespec="seconds")


# ----------------------------------------------------------------------------------------------
# arithmetic


def _sum(records: Iterable[dict], key: str) -> float:
    return float(sum(r[key] for r in records if r.get(key) is not None))


def _tps(records: list[dict]) -> float | None:
    wall = _sum(records, "wall_time")
    return _sum(records, "new_tokens") / wall if wall > 0 else None


def _prompt_key(r: dict) -> tuple:
    return (r.get("dataset"), str(r.get("question_id")))


def method_row(records: list[dict], baseline_records: list[dict] | None) -> dict[str, Any]:
    """The summary numbers for one method over ``records`` (see the module docstring)."""
    row: dict[str, Any] = {
        "prompts": len(records),
        "new_tokens": int(_sum(records, "new_tokens")),
        "wall_time": _sum(records, "wall_time"),
        "tokens_per_second": _tps(records),
        "speedup": None,
        "speedup_mean_per_prompt": None,
        "mean_acceptance_length": None,
        "draft_acceptance_rate": None,
        "time_prefill_pct": None,
        "time_draft_pct": None,
        "time_verify_pct": None,
        "time_other_pct": None,
        "identical": None,
        "compared": 0,
        "rounds_plain_pct": None,
        "control_pct": None,
        "nodes_verified": None,
        "accepted_by": None,
    }
    rounds = _sum(records, "rounds_drafted") + _sum(records, "rounds_plain")
    if rounds > 0:  # the controller was on: how often it chose a plain step, what deciding cost
        row["rounds_plain_pct"] = 100.0 * _sum(records, "rounds_plain") / rounds
        row["control_pct"] = 100.0 * _sum(records, "time_control") / max(_sum(records, "wall_time"), 1e-9)
    sizes = [n for r in records for n in (r.get("draft_sizes") or [])]
    if sizes:
        row["nodes_verified"] = sum(sizes) / len(sizes)
    by: dict[str, int] = {}
    for r in records:
        for name, count in (r.get("accepted_by") or {}).items():
            by[name] = by.get(name, 0) + count
    if by:
        row["accepted_by"] = by
    steps = accepted = 0
    for r in records:
        if r.get("accept_lengths"):  # the engine's own steps (the prefill's token is not a step)
            steps += len(r["accept_lengths"])
            accepted += sum(r["accept_lengths"])
        elif r.get("target_forwards"):
            steps += r["target_forwards"]
            accepted += r["new_tokens"]
    if steps > 0:
        row["mean_acceptance_length"] = accepted / steps
    counted = [r for r in records if r.get("drafted_tokens") is not None and r.get("accepted_tokens") is not None]
    drafted = _sum(counted, "drafted_tokens")
    if counted and drafted > 0:
        row["draft_acceptance_rate"] = _sum(counted, "accepted_tokens") / drafted
    elif not counted:
        rates = [r["draft_acceptance_rate"] for r in records if r.get("draft_acceptance_rate") is not None]
        if rates:
            row["draft_acceptance_rate"] = sum(rates) / len(rates)
    parts = {k: _sum(records, f"time_{k}") for k in ("prefill", "draft", "verify", "other")}
    total = sum(parts.values())
    if total > 0:
        for k, v in parts.items():
            row[f"time_{k}_pct"] = 100.0 * v / total
    compared = [r for r in records if r.get("equal_to_baseline") is not None]
    row["compared"] = len(compared)
    if compared:
        row["identical"] = sum(1 for r in compared if r["equal_to_baseline"])
    if baseline_records:
        base = {_prompt_key(r): r for r in baseline_records}
        pairs = [(r, base[_prompt_key(r)]) for r in records if _prompt_key(r) in base]
        if pairs:
            m_tps = _tps([a for a, _ in pairs])
            b_tps = _tps([b for _, b in pairs])
            if m_tps is not None and b_tps:
                row["speedup"] = m_tps / b_tps
            ratios = []
            for a, b in pairs:
                ta, tb = _tps([a]), _tps([b])
                if ta is not None and tb:
                    ratios.append(ta / tb)
            if ratios:
                row["speedup_mean_per_prompt"] = sum(ratios) / len(ratios)
                row["speedup_min_per_prompt"], row["speedup_max_per_prompt"] = min(ratios), max(ratios)
    return row


def repeats_of(label: str, labels: list[str]) -> list[str]:
    """The rows that run ``label``'s method again under a ``#tag`` (``autoregressive#2``)."""
    stem = label.split("#", 1)[0]
    return [m for m in labels if m != label and m.split("#", 1)[0] == stem and "#" in m]


def summarize_records(
    records: list[dict], methods: list[str] | None = None, baseline: str | None = None
) -> dict[str, dict[str, dict]]:
    """``{dataset or "overall": {method: row}}`` (datasets in first-seen order, "overall" last)."""
    if methods is None:
        methods = list(dict.fromkeys(r["method"] for r in records))
    datasets = list(dict.fromkeys(r["dataset"] for r in records))
    groups: dict[str, dict[str, dict]] = {}
    for name in [*datasets, OVERALL]:
        rs = records if name == OVERALL else [r for r in records if r["dataset"] == name]
        base = [r for r in rs if r["method"] == baseline] if baseline else None
        groups[name] = {}
        for m in methods:
            mr = [r for r in rs if r["method"] == m]
            if mr:
                groups[name][m] = method_row(mr, base)
    return groups


def mismatches(records: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in records:
        if r.get("equal_to_baseline") is False:
            out.setdefault(r["method"], []).append(
                {"dataset": r["dataset"], "question_id": r["question_id"], "first_mismatch": r.get("first_mismatch")}
            )
    return out


def summarize(result) -> dict[str, Any]:
    """Everything summary.json holds (and summary.md shows), from a :class:`BenchResult`."""
    meta = dict(result.meta)
    meta.setdefault("machine", machine_info())
    meta.setdefault("date", now_iso())
    return {
        "meta": meta,
        "baseline": result.baseline,
        "methods": list(result.methods),
        "datasets": list(result.datasets),
        "groups": summarize_records(result.records, list(result.methods), result.baseline),
        "mismatches": mismatches(result.records),
        "errors": dict(result.errors),
        "notes": list(result.notes),
    }


# ----------------------------------------------------------------------------------------------
# markdown


def _f(x: float | None, fmt: str, none: str = "–") -> str:
    return none if x is None else format(x, fmt)


def _noise_floor(summary: dict, baseline: str) -> list[str]:
    """The baseline run again per prompt (an A/A comparison): how far two runs of the same code
    differ on this machine in this run, per set, as a speedup."""
    groups = summary["groups"]
    lines = ["## Noise floor (the baseline run twice)", ""]
    lines.append("| row | " + " | ".join(groups) + " |")
    lines.append("|---|" + "---:|" * len(groups))
    for m in repeats_of(baseline, list(groups.get(OVERALL, {}))):
        cells = []
        for rows in groups.values():
            r = rows.get(m, {})
            low, high = r.get("speedup_min_per_prompt"), r.get("speedup_max_per_prompt")
            span = f" ({low:.2f}–{high:.2f})" if low is not None and high is not None else ""
            speedup = r.get("speedup")
            cells.append("–" if speedup is None else f"{speedup:.2f}×{span}")
        lines.append(f"| `{m}` ÷ `{baseline}` | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Each cell: the same plain decoding run again on the same prompts, Σ ratio (per-prompt range). "
        "A method's speedup that differs from 1.00× by no more than this row does is within this run's noise.",
        "",
    ]
    return lines


def _table(rows: dict[str, dict], baseline: str | None) -> list[str]:
    lines = [
        "| method | prompts | new tokens | tokens/s | speedup | mean/prompt | mean acc. length "
        "| draft acc. rate | prefill / draft / verify / other % | identical |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for m, r in rows.items():
        split = (
            "–"
            if r["time_draft_pct"] is None
            else " / ".join(f"{r[f'time_{k}_pct']:.0f}" for k in ("prefill", "draft", "verify", "other"))
        )
        ident = "–" if r["identical"] is None else f"{r['identical']}/{r['compared']}"
        label = f"{m} (baseline)" if m == baseline else m
        lines.append(
            f"| `{label}` | {r['prompts']} | {r['new_tokens']} | {_f(r['tokens_per_second'], '.2f')} "
            f"| {_f(r['speedup'], '.2f')}{'×' if r['speedup'] is not None else ''} "
            f"| {_f(r['speedup_mean_per_prompt'], '.2f')}{'×' if r['speedup_mean_per_prompt'] is not None else ''} "
            f"| {_f(r['mean_acceptance_length'], '.2f')} "
            f"| {_f(None if r['draft_acceptance_rate'] is None else 100 * r['draft_acceptance_rate'], '.1f')}"
            f"{'%' if r['draft_acceptance_rate'] is not None else ''} | {split} | {ident} |"
        )
    return lines


def _low_precision(dtype: Any) -> bool:
    d = str(dtype or "").lower()
    return any(x in d for x in ("bfloat16", "bf16", "float16", "fp16", "half"))


def to_markdown(summary: dict[str, Any]) -> str:
    meta = summary["meta"]
    baseline = summary.get("baseline")
    lines = ["# speculum bench", ""]
    lines.extend(_run_lines(meta, baseline))
    lines.append("")
    for name, rows in summary["groups"].items():
        if not rows:
            continue
        n = max(r["prompts"] for r in rows.values())
        lines.append(f"## {name} ({n} prompts)")
        lines.append("")
        lines.extend(_table(rows, baseline))
        lines.append("")
    overall = summary["groups"].get(OVERALL, {})
    if baseline and repeats_of(baseline, list(overall)):
        lines.extend(_noise_floor(summary, baseline))
    lines.extend(_controller_lines(overall))
    lines.extend(_losslessness_lines(summary, overall))
    for note in summary.get("notes", []):
        lines.append(f"- note: {note}")
    if summary.get("errors"):
        lines.append("")
        lines.append("## Errors")
        lines.append("")
        for m, e in summary["errors"].items():
            lines.append(f"- `{m}`: {e}")
    lines.append("")
    lines.append(
        "tokens/s = Σ new tokens / Σ wall time (prefill included); speedup = ratio of tokens/s to the baseline "
        "(mean/prompt: mean of per-prompt ratios); mean acc. length = tokens per verification forward, bonus "
        "token included (Σ accept_lengths / number of steps); draft acc. rate = Σ accepted / Σ drafted draft tokens."
    )
    return "\n".join(lines) + "\n"


def _run_lines(meta: dict[str, Any], baseline: str | None) -> list[str]:
    """The list of what ran: command, date, machine, model, prompts, baseline."""
    mach = meta.get("machine", {})
    lines = []
    if meta.get("command"):
        lines.append(f"- command: `{meta['command']}`")
    lines.append(f"- date: {meta.get('date', '')}")
    if meta.get("resumed"):  # an interrupted run continued: its prompts kept, the rest run now
        r = meta["resumed"]
        earlier_cpu = (r.get("machine") or {}).get("cpu", "?")
        lines.append(
            f"- resumed: {r.get('records')} records from the run started {r.get('date')} on {earlier_cpu} "
            "(a prompt's methods always ran together, in one run)"
        )
    capability = f" ({mach['cpu_capability']})" if mach.get("cpu_capability") else ""
    machine = f"{mach.get('cpu', '?')}{capability}, {mach.get('threads', '?')} threads"
    if mach.get("gpu"):
        machine += f", GPU {mach['gpu']}"
    versions = ", ".join(f"{k} {mach[k]}" for k in ("python", "torch", "transformers", "speculum") if mach.get(k))
    lines.append(f"- machine: {machine}; {versions}")
    model = f"- model: `{meta.get('model', '?')}`"
    if meta.get("draft"):
        model += f", draft `{meta['draft']}`"
    model += f"; dtype {meta.get('dtype', '?')}; device {meta.get('device', '?')}"
    if meta.get("prepacked"):
        model += "; speculum rows on oneDNN-prepacked weights, transformers rows on the stock model"
    lines.append(model)
    prompts = ", ".join(f"{k} × {v}" for k, v in (meta.get("prompts") or {}).items())
    temp = meta.get("temperature") or 0
    decoding = "greedy" if not temp else f"temperature {temp}, top_p {meta.get('top_p')}, top_k {meta.get('top_k')}"
    lines.append(
        f"- prompts: {prompts}; max_new_tokens {meta.get('max_new_tokens')}; {decoding}; "
        f"warm-up {meta.get('warmup')} per method; methods interleaved per prompt"
    )
    lines.append(f"- baseline: `{baseline}`" if baseline else "- baseline: none")
    return lines


def _controller_lines(overall: dict[str, dict]) -> list[str]:
    """The controller's section, for the methods it ran (none: no section)."""
    controlled = {m: r for m, r in overall.items() if r.get("rounds_plain_pct") is not None or r.get("accepted_by")}
    if not controlled:
        return []
    lines = ["## Controller (all prompts)", ""]
    lines.append(
        "| method | plain rounds % | controller time % of wall | draft nodes verified per forward "
        "| accepted draft tokens by drafter |"
    )
    lines.append("|---|---:|---:|---:|---|")
    for m, r in controlled.items():
        by = ", ".join(f"{k} {v}" for k, v in sorted((r.get("accepted_by") or {}).items(), key=lambda kv: -kv[1]))
        lines.append(
            f"| `{m}` | {_f(r.get('rounds_plain_pct'), '.0f')} | {_f(r.get('control_pct'), '.2f')} "
            f"| {_f(r.get('nodes_verified'), '.1f')} | {by or '–'} |"
        )
    lines.append("")
    return lines


def _losslessness_lines(summary: dict[str, Any], overall: dict[str, dict]) -> list[str]:
    meta, baseline = summary["meta"], summary.get("baseline")
    lines = ["## Losslessness", ""]
    if not (meta.get("check_lossless") and baseline):
        return [*lines, "- not checked"]
    for m, r in overall.items():
        if m == baseline or r["identical"] is None:
            continue
        mis = summary["mismatches"].get(m, [])
        line = f"- `{m}`: {r['identical']}/{r['compared']} outputs identical to `{baseline}`"
        if mis:
            firsts = ", ".join(f"{x['dataset']}/{x['question_id']} at token {x['first_mismatch']}" for x in mis[:5])
            line += f"; first mismatches: {firsts}" + (" …" if len(mis) > 5 else "")
        lines.append(line)
    if _low_precision(meta.get("dtype")):
        lines.append(
            f"- dtype {meta.get('dtype')}: batched verification and one-token decoding round differently, so "
            "near-ties of the argmax can flip and a lossless method may still differ from the baseline; "
            "check in float32 to tell a flip from a bug."
        )
    return lines


# ----------------------------------------------------------------------------------------------
# files


def write_records(records: Iterable[dict], path: str | Path) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def write_result(result, out_dir: str | Path, *, records: bool = True) -> dict[str, str]:
    """Write ``records.jsonl`` (unless ``records=False``), ``summary.json`` and ``summary.md``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = summarize(result)
    paths = {}
    if records:
        write_records(result.records, out / "records.jsonl")
        paths["records"] = str(out / "records.jsonl")
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n", encoding="utf-8")
    (out / "summary.md").write_text(to_markdown(summary), encoding="utf-8")
    paths["summary_json"] = str(out / "summary.json")
    paths["summary_md"] = str(out / "summary.md")
    return paths


def print_markdown(md: str) -> None:
    """Rendered with rich on a wide terminal; as plain markdown (readable and pasteable) on a narrow one."""
    console = Console()
    if console.width >= 160:
        console.print(Markdown(md))
    else:
        console.print(md, markup=False, highlight=False, soft_wrap=True)
