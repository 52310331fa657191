"""speculum beside the CPU stacks users run instead: OpenVINO GenAI's plain, prompt lookup and draft
model decoding against speculum's plain and speculative methods, on the same prompt tokens.

Each OpenVINO mode is a process of its own (in the virtual environment that has OpenVINO), and
speculum's methods share one process (in this one, the model and the draft loaded once; the "on
oneDNN" engines, speculum with its bfloat16 layers on oneDNN instead of its row kernel, one more); all are
loaded at once, and every prompt runs on each engine in turn, the order rotating from
prompt to prompt, so a slow stretch of the shared machine falls on all of them alike. Every OpenVINO
mode has a pipeline of its own with prefix caching off, so no prompt's prefill is skipped; each
prompt runs once per engine. Time is wall time of the whole request, prefill included; OpenVINO's
own time to first token is reported beside it. Outputs are compared token for token with OpenVINO
plain's and with speculum plain's.

    python benchmarks/cpu_peers.py qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b \\
        --openvino-python .venv-openvino/bin/python \\
        --datasets benchmarks/data/unseen-chat-questions.jsonl --limit 10 --max-new-tokens 128 \\
        --out benchmarks/results/cpu-peers-qwen.md

OpenVINO's IR is exported once with optimum-intel from speculum's converted checkpoint (fp16 weights,
run with bfloat16 compute: ``--openvino-precision bf16``), into ``~/.cache/speculum/openvino/``.
Set-up of the OpenVINO environment: benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_side_by_side import Engine, _commit, _prompt_ids  # noqa: E402

ENGINES = {
    "openvino plain": ("openvino", "plain"),
    "openvino prompt lookup": ("openvino", "prompt_lookup"),
    "openvino draft": ("openvino", "draft"),
    "speculum plain": ("speculum", "autoregressive"),
    "speculum auto": ("speculum", "auto"),
    "speculum prompt_lookup": ("speculum", "prompt_lookup"),
    "speculum draft_model": ("speculum", "draft_model"),
    # speculum with its bfloat16 linear layers on oneDNN instead of its own row kernel (a process of its own)
    "speculum plain on oneDNN": ("speculum-onednn", "autoregressive"),
    "speculum auto on oneDNN": ("speculum-onednn", "auto"),
}
DEFAULT_ENGINES = "openvino plain,openvino prompt lookup,openvino draft,speculum plain,speculum auto"
IR_CACHE = Path.home() / ".cache" / "speculum" / "openvino"


# ---------------------------------------------------------------------------------------- workers


def _serve(generate) -> None:
    """Answer one JSON request per stdin line: {"ids": [...], "max_tokens": n, "spec": method}."""
    print("READY", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        started = time.perf_counter()
        output, first_token_s = generate(request["ids"], request["max_tokens"], request["spec"])
        seconds = time.perf_counter() - started
        print("RESULT " + json.dumps({"output": output, "seconds": seconds, "ttft": first_token_s}), flush=True)


class Worker(Engine):
    """A worker process answering one request at a time (the protocol of ``_serve``)."""

    def run(self, ids: list[int], max_tokens: int, spec: str) -> dict:
        self.process.stdin.write(json.dumps({"ids": ids, "max_tokens": max_tokens, "spec": spec}) + "\n")
        self.process.stdin.flush()
        return json.loads(self._wait("RESULT "))


def openvino_worker(args) -> None:
    import numpy as np
    import openvino as ov
    import openvino_genai

    properties = {"INFERENCE_NUM_THREADS": args.threads, "PERFORMANCE_HINT": "LATENCY"}
    if args.openvino_precision != "default":
        properties["INFERENCE_PRECISION_HINT"] = args.openvino_precision
    scheduler = openvino_genai.SchedulerConfig()
    scheduler.enable_prefix_caching = False  # every prompt's prefill is run, as speculum runs it
    extra = {}
    if args.spec == "draft":
        extra["draft_model"] = openvino_genai.draft_model(args.draft_ir, "CPU", **properties)
    pipe = openvino_genai.LLMPipeline(args.ir, "CPU", scheduler_config=scheduler, **extra, **properties)
    config = openvino_genai.GenerationConfig()
    config.do_sample = False
    config.apply_chat_template = False  # the prompts are token ids, already templated
    if args.spec in ("draft", "prompt_lookup"):
        config.num_assistant_tokens = args.k
    if args.spec == "prompt_lookup":
        config.max_ngram_size = args.max_ngram

    def generate(ids, max_tokens, _spec):
        config.max_new_tokens = max_tokens
        tensor = ov.Tensor(np.array([ids], dtype=np.int64))
        if args.spec == "prompt_lookup":
            result = pipe.generate(tensor, config, prompt_lookup=True)
        else:
            result = pipe.generate(tensor, config)
        ttft = result.perf_metrics.get_ttft().mean / 1000.0
        return [int(t) for t in result.tokens[0]], ttft

    _serve(generate)


def speculum_worker(args) -> None:
    import torch

    import speculum

    torch.set_num_threads(args.threads)
    spec = speculum.load(args.model, draft=args.draft or None, dtype=args.dtype)
    print(f"speculum: {spec.dtype_choice}; {spec.row_padding.describe()}", file=sys.stderr, flush=True)

    def generate(ids, max_tokens, method):
        result = spec.generate(ids, method, max_new_tokens=max_tokens)
        return list(result.token_ids), None

    _serve(generate)


def export_ir(model_dir: str, openvino_python: str, weight_format: str) -> str:
    """The OpenVINO IR of a converted checkpoint folder, exported by optimum-intel on first use."""
    out = IR_CACHE / f"{Path(model_dir).name}-{weight_format}"
    if not (out / "openvino_model.xml").exists():
        print(f"exporting {model_dir} to OpenVINO IR ({weight_format}) in {out} ...", file=sys.stderr, flush=True)
        cli = str(Path(openvino_python).parent / "optimum-cli")
        command = [cli, "export", "openvino", "--model", model_dir, "--task", "text-generation-with-past"]
        done = subprocess.run([*command, "--weight-format", weight_format, str(out)])
        if done.returncode:
            raise SystemExit(f"optimum-intel could not export {model_dir} (its message is above); no OpenVINO run")
    return str(out)


# ----------------------------------------------------------------------------------- orchestrator


def _machine() -> str:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    name = next((ln.split(":", 1)[1].strip() for ln in lscpu.splitlines() if ln.startswith("Model name")), "")
    flags = next((ln.split(":", 1)[1].split() for ln in lscpu.splitlines() if ln.startswith("Flags")), [])
    wanted = [f for f in flags if f in {"avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8"}]
    return f"{name}, {os.cpu_count()} CPUs, flags {' '.join(wanted)}"


def _versions(openvino_python: str) -> str:
    import torch
    import transformers

    code = "import openvino, openvino_genai; print(openvino.__version__, openvino_genai.__version__)"
    ov = subprocess.run([openvino_python, "-c", code], capture_output=True, text=True).stdout.strip()
    return f"torch {torch.__version__}, transformers {transformers.__version__}; openvino, openvino-genai {ov}"


def _report(args, names, prompts, results) -> str:
    order = [(s, i) for s, ps in prompts.items() for i in range(len(ps))]
    reference = {n: results.get(n) for n in ("openvino plain", "speculum plain")}

    def rate(name, keys) -> float:
        return sum(len(results[name][k]["output"]) for k in keys) / sum(results[name][k]["seconds"] for k in keys)

    def equal(name, base, keys) -> str:
        if reference[base] is None:
            return "—"
        same = sum(results[name][k]["output"] == reference[base][k]["output"] for k in keys)
        return f"{same}/{len(keys)}"

    fastest_ov = max((n for n in names if n.startswith("openvino")), key=lambda n: rate(n, order), default=None)
    lines = [
        f"# speculum and OpenVINO GenAI on one CPU — {args.model}, {time.strftime('%Y-%m-%d')}",
        "",
        f"- machine: {_machine()}; {args.threads} threads; {_versions(args.openvino_python)}",
        f"- speculum dtype {args.dtype}; OpenVINO IR {args.openvino_weights} weights, inference precision "
        f"{args.openvino_precision}; K = {args.k} (num_assistant_tokens), max_ngram_size {args.max_ngram}; "
        f"draft {args.draft}",
        f"- {len(order)} prompts ({', '.join(f'{s}: {len(p)}' for s, p in prompts.items())}), {args.max_new_tokens} "
        f"new tokens at most, greedy, one request at a time, prefill included; commit {_commit()}",
        f"- command: `python {' '.join(sys.argv)}`",
        "",
        "| engine | tok/s | × OpenVINO plain | × OpenVINO's fastest | = OpenVINO plain | = speculum plain "
        "| OpenVINO TTFT, s (median) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    base = rate("openvino plain", order) if "openvino plain" in names else None
    best = rate(fastest_ov, order) if fastest_ov else None
    for name in names:
        own = rate(name, order)
        ttfts = [results[name][k]["ttft"] for k in order if results[name][k]["ttft"] is not None]
        lines.append(
            f"| {name} | {own:.2f} | {f'{own / base:.2f}×' if base else '—'} | {f'{own / best:.2f}×' if best else '—'} "
            f"| {equal(name, 'openvino plain', order)} | {equal(name, 'speculum plain', order)} "
            f"| {f'{statistics.median(ttfts):.2f}' if ttfts else ''} |"
        )
    if fastest_ov:
        lines += ["", f"OpenVINO's fastest mode here: {fastest_ov}."]
    if len(prompts) > 1:
        lines += ["", "| tok/s by set | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
        for s in prompts:
            keys = [k for k in order if k[0] == s]
            lines.append(f"| {s} | " + " | ".join(f"{rate(n, keys):.2f}" for n in names) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b", help="the draft model of the draft modes and auto")
    parser.add_argument("--openvino-python", default=".venv-openvino/bin/python")
    parser.add_argument("--engines", default=DEFAULT_ENGINES, help=f"comma-separated, of: {', '.join(ENGINES)}")
    parser.add_argument("--datasets", default="benchmarks/data/unseen-chat-questions.jsonl")
    parser.add_argument("--limit", type=int, default=10, help="prompts per set")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16", help="speculum's dtype")
    parser.add_argument("--openvino-weights", default="fp16", help="the IR's --weight-format (fp16, int8, int4)")
    parser.add_argument("--openvino-precision", default="bf16", help="INFERENCE_PRECISION_HINT, or 'default'")
    parser.add_argument("--k", type=int, default=5, help="OpenVINO's num_assistant_tokens")
    parser.add_argument("--max-ngram", type=int, default=3, help="OpenVINO prompt lookup's max_ngram_size")
    parser.add_argument("--out", default=None)
    parser.add_argument("--worker", choices=["openvino", "speculum"], help=argparse.SUPPRESS)
    parser.add_argument("--spec", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--ir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--draft-ir", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker == "openvino":
        return openvino_worker(args)
    if args.worker == "speculum":
        return speculum_worker(args)

    names = [n.strip() for n in args.engines.split(",") if n.strip()]
    unknown = [n for n in names if n not in ENGINES]
    if unknown:
        parser.error(f"unknown engine(s) {unknown}; engines: {', '.join(ENGINES)}")
    if any(ENGINES[n][0] == "openvino" for n in names) and not Path(args.openvino_python).exists():
        parser.error(f"no OpenVINO python at {args.openvino_python} (set-up: benchmarks/README.md)")
    prompts, model_dir = _prompt_ids(args.model, args.datasets, args.limit)
    common = [args.model, "--threads", str(args.threads), "--draft", args.draft, "--k", str(args.k)]
    common += ["--max-ngram", str(args.max_ngram), "--openvino-precision", args.openvino_precision]
    common += ["--dtype", args.dtype]
    workers: dict[str, Worker] = {}  # by engine name; speculum's engines share one
    try:
        # speculum's processes first: loading one takes far more memory than it keeps (conversion, packing)
        for name in sorted(names, key=lambda n: not ENGINES[n][0].startswith("speculum")):
            kind, spec = ENGINES[name]
            if kind.startswith("speculum") and kind in workers:
                workers[name] = workers[kind]
                continue
            command = [sys.executable, __file__, "--worker", kind.split("-")[0], "--spec", spec, *common]
            if kind == "openvino":
                command[0] = args.openvino_python
                command += ["--ir", export_ir(model_dir, args.openvino_python, args.openvino_weights)]
                if spec == "draft":
                    from speculum.models.loading import _resolve_source

                    draft_dir = _resolve_source(args.draft, None)[0]
                    command += ["--draft-ir", export_ir(draft_dir, args.openvino_python, args.openvino_weights)]
            print(f"starting {name}", file=sys.stderr, flush=True)
            env = {"SPECULUM_BF16_KERNEL": "onednn"} if kind == "speculum-onednn" else None
            workers[name] = Worker(name, command, env)
            workers.setdefault(kind, workers[name])
        for name in names:  # warm-up: first calls compile, allocate and pack
            workers[name].run(list(range(100, 164)), 8, ENGINES[name][1])
        results: dict[str, dict] = {n: {} for n in names}
        for i, (dataset, j, ids) in enumerate((s, j, p) for s, ps in prompts.items() for j, p in enumerate(ps)):
            for name in names[i % len(names) :] + names[: i % len(names)]:
                result = workers[name].run(ids, args.max_new_tokens, ENGINES[name][1])
                results[name][(dataset, j)] = result
                tokens = len(result["output"])
                print(f"{dataset} {j} {name}: {tokens / result['seconds']:.2f} tok/s", file=sys.stderr, flush=True)
    finally:
        for worker in {id(w): w for w in workers.values()}.values():
            worker.close()
    text = _report(args, names, prompts, results)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
