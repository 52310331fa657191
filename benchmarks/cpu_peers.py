"""speculum beside the CPU stacks users run instead: OpenVINO GenAI's plain, prompt lookup and draft
model decoding (16-bit or int4 weights) and llama.cpp's plain and prompt lookup decoding of the
GGUF file itself, against speculum's plain and speculative methods, on the same prompt tokens.

Each OpenVINO mode and each llama.cpp mode is a process of its own (in the virtual environment that
has it), and speculum's methods share one process per kind (in this one, the model and the draft
loaded once: bfloat16 layers; "gguf", the file's own quantized layers; "on oneDNN", bfloat16 layers
on oneDNN instead of speculum's row kernel); all are
loaded at once, and every prompt runs on each engine in turn, the order rotating from
prompt to prompt, so a slow stretch of the shared machine falls on all of them alike. Every OpenVINO
mode has a pipeline of its own with prefix caching off, so no prompt's prefill is skipped; each
prompt runs once per engine. Time is wall time of the whole request, prefill included; OpenVINO's
own time to first token is reported beside it. Outputs are compared token for token with the same
stack's plain decoding (the same weights), and rates given as multiples of speculum's bfloat16 plain.

    python benchmarks/cpu_peers.py qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b \\
        --openvino-python .venv-openvino/bin/python \\
        --datasets benchmarks/data/unseen-chat-questions.jsonl --limit 10 --max-new-tokens 128 \\
        --out benchmarks/results/cpu-peers-qwen.md

OpenVINO's IR is exported once with optimum-intel from speculum's converted checkpoint (fp16 weights,
or int4 for the "openvino int4" engines: optimum-intel's data-free default, asymmetric group 128 with
an int8 embedding and head; run with bfloat16 compute: ``--openvino-precision bf16``), into
``~/.cache/speculum/openvino/``. llama.cpp (llama-cpp-python, built from source) reads the packaged
GGUF file, assembled once into ``~/.cache/speculum/llamacpp/``. Set-up of both environments:
benchmarks/README.md.
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
    # speculum on the GGUF's own quantized weights (quantization="gguf"), a process of its own
    "speculum gguf plain": ("speculum-gguf", "autoregressive"),
    "speculum gguf auto": ("speculum-gguf", "auto"),
    "speculum gguf draft_model": ("speculum-gguf", "draft_model"),
    "speculum gguf prompt_lookup": ("speculum-gguf", "prompt_lookup"),
    "openvino int4 plain": ("openvino-int4", "plain"),
    "openvino int4 prompt lookup": ("openvino-int4", "prompt_lookup"),
    "openvino int4 draft": ("openvino-int4", "draft"),
    "llama.cpp plain": ("llamacpp", "plain"),
    "llama.cpp prompt lookup": ("llamacpp", "prompt_lookup"),
}
# whose plain decoding an engine's texts are compared with: the same stack on the same weights
_PLAIN = {
    "openvino": "openvino plain",
    "openvino-int4": "openvino int4 plain",
    "speculum": "speculum plain",
    "speculum-onednn": "speculum plain on oneDNN",
    "speculum-gguf": "speculum gguf plain",
    "llamacpp": "llama.cpp plain",
}
DEFAULT_ENGINES = "openvino plain,openvino prompt lookup,openvino draft,speculum plain,speculum auto"
IR_CACHE = Path.home() / ".cache" / "speculum" / "openvino"
GGUF_CACHE = Path.home() / ".cache" / "speculum" / "llamacpp"


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


def _agreement(logits, reference: str) -> dict:
    """KL(reference || these) per position and top-1 agreement, against the log-probabilities saved
    in ``reference`` (numpy only: every worker's environment has it)."""
    import numpy as np

    ref = np.load(reference).astype(np.float64)
    own = np.asarray(logits, dtype=np.float64)[: ref.shape[0]]
    own = own - own.max(-1, keepdims=True)
    own = own - np.log(np.exp(own).sum(-1, keepdims=True))
    kl = (np.exp(ref) * (ref - own)).sum(-1)
    return {"kl": float(kl.sum()), "top1": int((ref.argmax(-1) == own.argmax(-1)).sum()), "positions": len(kl)}


def _serve_fidelity(logits_of) -> None:
    """Answer one JSON request per stdin line: {"ids": [...], "reference": path} -> agreement sums."""
    print("READY", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        print("RESULT " + json.dumps(_agreement(logits_of(request["ids"]), request["reference"])), flush=True)


class Worker(Engine):
    """A worker process answering one request at a time (the protocol of ``_serve``)."""

    def run(self, ids: list[int], max_tokens: int, spec: str) -> dict:
        return json.loads(self.ask({"ids": ids, "max_tokens": max_tokens, "spec": spec}))

    def ask(self, request: dict) -> str:
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        return self._wait("RESULT ")


def openvino_worker(args) -> None:
    import numpy as np
    import openvino as ov
    import openvino_genai

    if args.fidelity:  # the same IR and runtime, through optimum-intel's model class for its logits
        from optimum.intel import OVModelForCausalLM

        precision = (
            {} if args.openvino_precision == "default" else {"INFERENCE_PRECISION_HINT": args.openvino_precision}
        )
        model = OVModelForCausalLM.from_pretrained(
            args.ir, ov_config={"INFERENCE_NUM_THREADS": args.threads, **precision}
        )
        import torch  # optimum-intel's model class takes torch tensors

        return _serve_fidelity(lambda ids: model(input_ids=torch.tensor([ids])).logits[0].float().numpy())

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
    if args.fidelity:
        spec = speculum.load(args.model, dtype=args.dtype, quantization=args.quantization)

        def logits_of(ids):
            with torch.no_grad():
                return spec.model(torch.tensor([ids])).logits[0].float().numpy()

        return _serve_fidelity(logits_of)
    spec = speculum.load(args.model, draft=args.draft or None, dtype=args.dtype, quantization=args.quantization)
    quantized = f"; {spec.quantization.describe()}" if spec.quantization else ""
    print(f"speculum: {spec.dtype_choice}; {spec.row_padding.describe()}{quantized}", file=sys.stderr, flush=True)

    def generate(ids, max_tokens, method):
        result = spec.generate(ids, method, max_new_tokens=max_tokens)
        return list(result.token_ids), None

    _serve(generate)


def llamacpp_worker(args) -> None:
    import llama_cpp

    extra = {}
    if args.spec == "prompt_lookup":
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        extra["draft_model"] = LlamaPromptLookupDecoding(num_pred_tokens=args.k, max_ngram_size=args.max_ngram)
    if args.fidelity:
        llm = llama_cpp.Llama(args.gguf, n_threads=args.threads, n_ctx=4096, logits_all=True, verbose=False)

        def logits_of(ids):
            llm.reset()
            llm.eval(ids)
            return llm.scores[: len(ids)]

        return _serve_fidelity(logits_of)
    llm = llama_cpp.Llama(args.gguf, n_threads=args.threads, n_ctx=4096, verbose=False, **extra)
    stops = {int(t) for t in args.eos.split(",") if t}

    def generate(ids, max_tokens, _spec):
        llm.reset()  # no prefix of an earlier prompt reused: every prefill runs, as speculum runs it
        out = []
        for token in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
            out.append(int(token))
            if token in stops or len(out) >= max_tokens:
                break
        return out, None

    _serve(generate)


def packaged_gguf(alias: str) -> str:
    """The packaged model's GGUF file as it ships (assembled from its packages once, checksum checked)."""
    from speculum.models.convert import _assemble
    from speculum.models.registry import PACKAGED_MODELS

    entry = PACKAGED_MODELS[alias]
    path = GGUF_CACHE / entry.gguf_name
    if not path.exists():
        path = _assemble(entry, GGUF_CACHE)
    return str(path)


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


def _eos_ids(model_dir: str) -> list[int]:
    """The tokens that end a generation for speculum, so that llama.cpp stops where speculum stops."""
    from transformers import AutoConfig, GenerationConfig

    from speculum.models.loading import eos_token_ids

    class _Model:  # eos_token_ids reads the generation config, then the model config
        generation_config = GenerationConfig.from_pretrained(model_dir)
        config = AutoConfig.from_pretrained(model_dir)

    return sorted(eos_token_ids(_Model()))


def _machine() -> str:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    name = next((ln.split(":", 1)[1].strip() for ln in lscpu.splitlines() if ln.startswith("Model name")), "")
    flags = next((ln.split(":", 1)[1].split() for ln in lscpu.splitlines() if ln.startswith("Flags")), [])
    wanted = [f for f in flags if f in {"avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8"}]
    return f"{name}, {os.cpu_count()} CPUs, flags {' '.join(wanted)}"


def _versions(openvino_python: str, llamacpp_python: str) -> str:
    import torch
    import transformers

    def ask(python: str, code: str) -> str:
        if not Path(python).exists():
            return "not installed"
        return subprocess.run([python, "-c", code], capture_output=True, text=True).stdout.strip()

    ov = ask(openvino_python, "import openvino as o, openvino_genai as g; print(o.__version__, g.__version__)")
    llama = ask(llamacpp_python, "import llama_cpp; print(llama_cpp.__version__)")
    return (
        f"torch {torch.__version__}, transformers {transformers.__version__}; openvino, openvino-genai {ov}; "
        f"llama-cpp-python {llama}"
    )


def _report(args, names, prompts, results) -> str:
    order = [(s, i) for s, ps in prompts.items() for i in range(len(ps))]

    def rate(name, keys) -> float:
        return sum(len(results[name][k]["output"]) for k in keys) / sum(results[name][k]["seconds"] for k in keys)

    def equal_to_plain(name) -> str:
        plain = _PLAIN[ENGINES[name][0]]
        if plain == name:
            return "(itself)"
        if plain not in results:
            return "—"
        return f"{sum(results[name][k]['output'] == results[plain][k]['output'] for k in order)}/{len(order)}"

    peers = [n for n in names if not n.startswith("speculum")]
    fastest_peer = max(peers, key=lambda n: rate(n, order), default=None)
    lines = [
        f"# speculum and the CPU peers on one CPU — {args.model}, {time.strftime('%Y-%m-%d')}",
        "",
        f"- machine: {_machine()}; {args.threads} threads; {_versions(args.openvino_python, args.llamacpp_python)}",
        f"- speculum dtype {args.dtype} (gguf engines: {args.gguf_dtype}); OpenVINO IR {args.openvino_weights} "
        f"weights (int4 engines: int4), inference precision {args.openvino_precision}; "
        f"K = {args.k} (num_assistant_tokens, llama.cpp's num_pred_tokens), "
        f"max_ngram_size {args.max_ngram}; draft {args.draft}",
        f"- {len(order)} prompts ({', '.join(f'{s}: {len(p)}' for s, p in prompts.items())}), {args.max_new_tokens} "
        f"new tokens at most, greedy, one request at a time, prefill included; commit {_commit()}",
        f"- command: `python {' '.join(sys.argv)}`",
        "",
        "| engine | tok/s | × speculum plain (bf16) | × the fastest peer | = its own plain | TTFT, s (median) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    base = rate("speculum plain", order) if "speculum plain" in names else None
    best = rate(fastest_peer, order) if fastest_peer else None
    for name in names:
        own = rate(name, order)
        ttfts = [results[name][k]["ttft"] for k in order if results[name][k]["ttft"] is not None]
        lines.append(
            f"| {name} | {own:.2f} | {f'{own / base:.2f}×' if base else '—'} | {f'{own / best:.2f}×' if best else '—'} "
            f"| {equal_to_plain(name)} | {f'{statistics.median(ttfts):.2f}' if ttfts else ''} |"
        )
    if fastest_peer:
        lines += ["", f"The fastest peer here: {fastest_peer}."]
    if len(prompts) > 1:
        lines += ["", "| tok/s by set | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
        for s in prompts:
            keys = [k for k in order if k[0] == s]
            lines.append(f"| {s} | " + " | ".join(f"{rate(n, keys):.2f}" for n in names) + " |")
    return "\n".join(lines) + "\n"


def fidelity(args, names, prompts, model_dir, start_worker) -> str:
    """Per-token KL divergence and top-1 agreement of each stack's logits against the GGUF
    de-quantized in float32 (transformers), on the prompts followed by that model's greedy
    continuation: every position of each text, as llama.cpp's ``--kl-divergence`` measures."""
    import tempfile

    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    texts, files = [], []
    folder = Path(tempfile.mkdtemp(prefix="speculum-fidelity-"))
    with torch.no_grad():
        for ids in (p for ps in prompts.values() for p in ps):
            out = reference.generate(torch.tensor([ids]), max_new_tokens=args.max_new_tokens, do_sample=False)
            seq = out[0].tolist()
            logp = torch.log_softmax(reference(torch.tensor([seq])).logits[0].float(), -1)
            files.append(str(folder / f"{len(files)}.npy"))
            np.save(files[-1], logp.numpy())
            texts.append(seq)
    del reference
    kinds = list(dict.fromkeys(ENGINES[n][0] for n in names))
    lines = [
        f"# Fidelity to the GGUF file — {args.model}, {time.strftime('%Y-%m-%d')}",
        "",
        f"- machine: {_machine()}; {args.threads} threads; {_versions(args.openvino_python, args.llamacpp_python)}",
        f"- reference: the GGUF de-quantized in float32 (transformers); {len(texts)} texts (prompts and the "
        f"reference's own greedy continuation, {sum(map(len, texts))} positions); commit {_commit()}",
        f"- command: `python {' '.join(sys.argv)}`",
        "",
        "| stack | mean KL per token | top-1 agreement |",
        "|---|---:|---:|",
    ]
    try:
        for kind in kinds:
            worker = start_worker(kind)
            try:
                sums = {"kl": 0.0, "top1": 0, "positions": 0}
                for seq, path in zip(texts, files, strict=True):
                    for key, value in json.loads(worker.ask({"ids": seq, "reference": path})).items():
                        sums[key] += value
            finally:
                worker.close()
            label = {
                "speculum": f"speculum {args.dtype}",
                "speculum-gguf": f"speculum gguf ({args.gguf_dtype} elsewhere)",
                "speculum-onednn": f"speculum {args.dtype} on oneDNN",
                "openvino": f"OpenVINO {args.openvino_weights}",
                "openvino-int4": "OpenVINO int4",
                "llamacpp": "llama.cpp (the GGUF)",
            }[kind]
            n = sums["positions"]
            lines.append(f"| {label} | {sums['kl'] / n:.5f} | {sums['top1'] / n:.2%} |")
            print(lines[-1], file=sys.stderr, flush=True)
    finally:
        for path in files:
            Path(path).unlink(missing_ok=True)
        folder.rmdir()
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b", help="the draft model of the draft modes and auto")
    parser.add_argument("--openvino-python", default=".venv-openvino/bin/python")
    parser.add_argument("--llamacpp-python", default=".venv-llamacpp/bin/python")
    parser.add_argument("--engines", default=DEFAULT_ENGINES, help=f"comma-separated, of: {', '.join(ENGINES)}")
    parser.add_argument("--datasets", default="benchmarks/data/unseen-chat-questions.jsonl")
    parser.add_argument("--limit", type=int, default=10, help="prompts per set")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16", help="speculum's dtype")
    parser.add_argument("--gguf-dtype", default="auto", help="speculum's dtype with quantization='gguf'")
    parser.add_argument("--openvino-weights", default="fp16", help="the IR's --weight-format (fp16, int8, int4)")
    parser.add_argument("--openvino-precision", default="bf16", help="INFERENCE_PRECISION_HINT, or 'default'")
    parser.add_argument("--k", type=int, default=5, help="OpenVINO's num_assistant_tokens")
    parser.add_argument("--max-ngram", type=int, default=3, help="OpenVINO prompt lookup's max_ngram_size")
    parser.add_argument("--out", default=None)
    parser.add_argument(
        "--fidelity", action="store_true", help="measure KL and top-1 against the GGUF in float32 instead of speed"
    )
    parser.add_argument("--worker", choices=["openvino", "speculum", "llamacpp"], help=argparse.SUPPRESS)
    parser.add_argument("--quantization", default="none", help=argparse.SUPPRESS)
    parser.add_argument("--gguf", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--eos", default="", help=argparse.SUPPRESS)
    parser.add_argument("--spec", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--ir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--draft-ir", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker == "openvino":
        return openvino_worker(args)
    if args.worker == "speculum":
        return speculum_worker(args)
    if args.worker == "llamacpp":
        return llamacpp_worker(args)

    names = [n.strip() for n in args.engines.split(",") if n.strip()]
    unknown = [n for n in names if n not in ENGINES]
    if unknown:
        parser.error(f"unknown engine(s) {unknown}; engines: {', '.join(ENGINES)}")
    if any(ENGINES[n][0].startswith("openvino") for n in names) and not Path(args.openvino_python).exists():
        parser.error(f"no OpenVINO python at {args.openvino_python} (set-up: benchmarks/README.md)")
    if any(ENGINES[n][0] == "llamacpp" for n in names) and not Path(args.llamacpp_python).exists():
        parser.error(f"no llama.cpp python at {args.llamacpp_python} (set-up: benchmarks/README.md)")
    prompts, model_dir = _prompt_ids(args.model, args.datasets, args.limit)
    common = [args.model, "--threads", str(args.threads), "--draft", args.draft, "--k", str(args.k)]
    common += ["--max-ngram", str(args.max_ngram), "--openvino-precision", args.openvino_precision]
    common += ["--dtype", args.dtype]

    def start_worker(kind: str, spec: str = "plain", name: str | None = None) -> Worker:
        command = [sys.executable, __file__, "--worker", kind.split("-")[0], "--spec", spec, *common]
        if kind.startswith("openvino"):
            weights = "int4" if kind == "openvino-int4" else args.openvino_weights
            command[0] = args.openvino_python
            command += ["--ir", export_ir(model_dir, args.openvino_python, weights)]
            if spec == "draft":
                from speculum.models.loading import _resolve_source

                draft_dir = _resolve_source(args.draft, None)[0]
                command += ["--draft-ir", export_ir(draft_dir, args.openvino_python, weights)]
        if kind == "llamacpp":
            command[0] = args.llamacpp_python
            command += ["--gguf", packaged_gguf(args.model), "--eos", ",".join(map(str, _eos_ids(model_dir)))]
        if kind == "speculum-gguf":  # the rest of the model in --gguf-dtype (auto: float32 there)
            command += ["--quantization", "gguf", "--dtype", args.gguf_dtype]
        if args.fidelity:
            command += ["--fidelity"]
        print(f"starting {name or kind}", file=sys.stderr, flush=True)
        env = {"SPECULUM_BF16_KERNEL": "onednn"} if kind == "speculum-onednn" else None
        return Worker(name or kind, command, env)

    if args.fidelity:
        text = fidelity(args, names, prompts, model_dir, start_worker)
        print(text)
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(text)
        return
    workers: dict[str, Worker] = {}  # by engine name; speculum's engines share one
    try:
        # speculum's processes first: loading one takes far more memory than it keeps (conversion, packing)
        for name in sorted(names, key=lambda n: not ENGINES[n][0].startswith("speculum")):
            kind, spec = ENGINES[name]
            if kind.startswith("speculum") and kind in workers:
                workers[name] = workers[kind]
                continue
            workers[name] = start_worker(kind, spec, name)
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
