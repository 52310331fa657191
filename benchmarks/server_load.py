"""Load on `speculum serve`: throughput and latency for N concurrent streaming clients, per method,
and the server's resident memory after 10 and after 1,000 requests.

    # starts `speculum serve` itself (on a free loopback port) and stops it at the end
    python benchmarks/server_load.py --model gemma-3-270m --methods autoregressive,anpd \
        --concurrency 1,4,16 --requests 32 --max-tokens 128 --rss 10,1000 --out benchmarks/results/server-load.md
    # or against a server already running (memory needs its --pid)
    python benchmarks/server_load.py --url http://127.0.0.1:8000 --methods autoregressive,anpd

    # the same run against a second server with other options (e.g. one request at a time): both
    # servers up, each level run on one then the other, one client's requests alternating
    python benchmarks/server_load.py --model gemma-3-270m --methods autoregressive,anpd \
        --concurrency 1,16 --requests 16 --versus "--max-batch 1"

Each client is closed-loop: it sends its next request as soon as the previous one ends, with the
prompts of --dataset in turn (their own chat/plain rendering). Every request names its method
(speculative_config), so one server serves them all; the server's own method is the last of
--methods, so its --serve-args parameters apply to that one. Times are measured by the client:
time to first token (TTFT: request sent -> first text), time per output token (TPOT: the rest of
the request / (tokens - 1)), throughput (output tokens of all clients / wall time of the level).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from speculum.bench.datasets import load_datasets
from speculum.bench.report import machine_info, now_iso


@dataclass
class Result:
    ok: bool
    ttft: float = 0.0
    tpot: float = 0.0
    latency: float = 0.0
    tokens: int = 0
    steps: int = 0
    error: str = ""


@dataclass
class Level:
    method: str
    concurrency: int
    wall: float
    results: list[Result] = field(default_factory=list)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def request_body(prompt, method: str, max_tokens: int) -> tuple[str, dict]:
    body = {
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "speculative_config": {"method": method},
    }
    if isinstance(prompt, list):
        return "/v1/chat/completions", {**body, "messages": prompt}
    return "/v1/completions", {**body, "prompt": prompt}


async def one_request(client: httpx.AsyncClient, prompt, method: str, max_tokens: int) -> Result:
    path, body = request_body(prompt, method, max_tokens)
    start = time.perf_counter()
    first = None
    tokens = steps = 0
    try:
        async with client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                return Result(False, error=f"{response.status_code}: {(await response.aread())[:200]!r}")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return Result(False, error=chunk["error"]["message"])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices", []):
                    text = choice.get("text") or (choice.get("delta") or {}).get("content")
                    # the first token: its text, or speculum's per-token pieces (a token may decode to "")
                    if first is None and (text or (chunk.get("speculation") or {}).get("tokens")):
                        first = time.perf_counter()
                    if choice.get("finish_reason"):
                        steps = chunk["speculation"]["num_spec_steps"]
    except httpx.HTTPError as exc:
        return Result(False, error=repr(exc))
    end = time.perf_counter()
    first = first or end
    tpot = (end - first) / (tokens - 1) if tokens > 1 else 0.0
    return Result(True, first - start, tpot, end - start, tokens, steps)


async def run_level(url: str, prompts: list, method: str, concurrency: int, requests: int, max_tokens: int) -> Level:
    """``concurrency`` closed-loop clients share ``requests`` requests."""
    todo = iter(range(requests))
    results: list[Result] = []

    async def client_loop(client):
        for i in todo:
            results.append(await one_request(client, prompts[i % len(prompts)], method, max_tokens))

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits, headers=auth_headers()) as client:
        start = time.perf_counter()
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
        wall = time.perf_counter() - start
    return Level(method, concurrency, wall, results)


async def run_alternating(urls: list[str], prompts: list, method: str, requests: int, max_tokens: int) -> list[Level]:
    """One closed-loop client per server, taking turns request by request (the same prompt on each
    server in a row): the servers see the same load at the same moments of a shared machine."""
    results: list[list[Result]] = [[] for _ in urls]
    async with httpx.AsyncClient(timeout=3600, headers=auth_headers()) as client:
        for i in range(requests):
            for k, url in enumerate(urls):
                client.base_url = url
                results[k].append(await one_request(client, prompts[i % len(prompts)], method, max_tokens))
    # a closed-loop client's wall time is the sum of its requests'
    return [Level(method, 1, sum(r.latency for r in res), res) for res in results]


def auth_headers() -> dict:
    key = os.environ.get("SPECULUM_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


def rss_mib(pid: int) -> float:
    """Resident memory of a process (Linux /proc), MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def start_server(args, extra: str = "") -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "speculum.cli", "serve", "--model", args.model, "--port", str(port)]
    command += ["--method", args.methods[-1], "--log-level", "warning", "--max-queue", "1024"]
    if args.draft:
        command += ["--draft", args.draft]
    command += shlex.split(args.serve_args) + shlex.split(extra)
    print("starting:", shlex.join(command), file=sys.stderr)
    process = subprocess.Popen(command)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900  # a first run converts the model
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return process, url
        except httpx.TransportError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("the server did not start")
        time.sleep(0.5)


def level_row(level: Level) -> str:
    ok = [r for r in level.results if r.ok]
    tokens = sum(r.tokens for r in ok)
    steps = sum(r.steps for r in ok)
    ttft = [r.ttft for r in ok]
    tpot = [r.tpot * 1000 for r in ok if r.tokens > 1]
    cells = [
        level.method,
        str(level.concurrency),
        f"{len(ok)}/{len(level.results)}",
        f"{tokens / level.wall:.1f}",
        f"{percentile(ttft, 0.5):.3f}",
        f"{percentile(ttft, 0.9):.3f}",
        f"{percentile(ttft, 0.99):.3f}",
        f"{percentile(tpot, 0.5):.1f}",
        f"{percentile(tpot, 0.9):.1f}",
        f"{statistics.mean(r.latency for r in ok):.2f}" if ok else "-",
        f"{tokens / steps:.2f}" if steps else "-",
    ]
    return "| " + " | ".join(cells) + " |"


def rate(level: Level) -> float:
    return sum(r.tokens for r in level.results if r.ok) / level.wall


def ttft_p50(level: Level) -> float:
    return percentile([r.ttft for r in level.results if r.ok], 0.5)


HEADER = (
    "| method | clients | ok | output tok/s | TTFT p50 (s) | TTFT p90 | TTFT p99 | TPOT p50 (ms) | TPOT p90 | "
    "latency mean (s) | tokens / target forward |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
)


async def memory_run(url: str, pid: int, prompts: list, methods: list[str], marks: list[int], args) -> list[str]:
    """Requests with the methods in turn (``args.rss_concurrency`` clients); RSS at each mark."""
    lines, done = [], 0
    for mark in marks:
        while done < mark:
            batch = min(args.rss_concurrency, mark - done)
            async with httpx.AsyncClient(base_url=url, timeout=3600, headers=auth_headers()) as client:
                results = await asyncio.gather(
                    *(
                        one_request(client, prompts[(done + i) % len(prompts)], methods[(done + i) % len(methods)],
                                    args.rss_max_tokens)
                        for i in range(batch)
                    )
                )  # fmt: skip
            failed = [r.error for r in results if not r.ok]
            if failed:
                raise SystemExit(f"request failed during the memory run: {failed[0]}")
            done += batch
        rss = rss_mib(pid)
        lines.append(f"| {mark} | {rss:.1f} |")
        print(f"RSS after {mark} requests: {rss:.1f} MiB", file=sys.stderr)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="A running server (default: start `speculum serve` here).")
    parser.add_argument("--pid", type=int, help="The running server's process id (for --rss with --url).")
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--draft")
    parser.add_argument("--serve-args", default="", help="More `speculum serve` options, e.g. '--param k=v'.")
    parser.add_argument("--methods", default="autoregressive,anpd", type=lambda s: s.split(","))
    parser.add_argument("--concurrency", default="1,4,16", type=lambda s: [int(c) for c in s.split(",")])
    parser.add_argument("--requests", type=int, default=32, help="Requests per method and concurrency level.")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--dataset", default="humaneval,gsm8k")
    parser.add_argument("--limit", type=int, default=16, help="Prompts per dataset.")
    parser.add_argument("--ids", help="Only these prompt ids, comma-separated (e.g. held-out MT-bench questions).")
    parser.add_argument("--warmup", type=int, default=2, help="Requests per method before timing.")
    parser.add_argument("--rss", default="", help="Measure the server's RSS after these request counts, e.g. 10,1000.")
    parser.add_argument("--rss-max-tokens", type=int, default=32)
    parser.add_argument("--rss-concurrency", type=int, default=4)
    parser.add_argument("--versus", help="Options of a second server run in the same run (e.g. '--max-batch 1').")
    parser.add_argument("--out", help="Also write the tables (markdown) here.")
    args = parser.parse_args()

    process = versus = None
    if args.url:
        url, pid = args.url.rstrip("/"), args.pid
    else:
        process, url = start_server(args)
        pid = process.pid
    if args.versus is not None:
        if args.url:
            raise SystemExit("--versus starts both servers itself: leave --url out")
        versus, versus_url = start_server(args, args.versus)
    try:
        card = httpx.get(url + "/v1/models", headers=auth_headers()).json()["data"][0]
        # as `speculum bench`: each set's own default (chat or plain), chat only where the model has a template
        datasets = load_datasets(args.dataset, args.limit).values()
        wanted = None if args.ids is None else {i.strip() for i in args.ids.split(",") if i.strip()}
        prompts = [p.render(p.chat_default and card.get("chat_template", False))
                   for ps in datasets for p in ps if wanted is None or str(p.question_id) in wanted]  # fmt: skip
        if not prompts:
            raise SystemExit("no prompt matches --ids")
        lines = [
            f"`speculum serve` load, {now_iso()}: {args.model}, {args.dataset} ({len(prompts)} prompts), "
            f"{args.max_tokens} tokens, {args.requests} requests per row; {machine_info().get('cpu', '?')}",
            "",
            HEADER,
        ]
        print("\n".join(lines))
        urls = [url] if versus is None else [url, versus_url]
        labels = [""] if versus is None else ["", f" [{args.versus}]"]
        for method in args.methods:
            for u in urls:
                asyncio.run(run_level(u, prompts, method, 1, args.warmup, args.max_tokens))
        pairs = []  # (method, clients, this server's level, the versus server's level)
        for concurrency in args.concurrency:
            for method in args.methods:
                if concurrency == 1 and versus is not None:
                    levels = asyncio.run(run_alternating(urls, prompts, method, args.requests, args.max_tokens))
                else:
                    levels = [asyncio.run(run_level(u, prompts, method, concurrency, args.requests, args.max_tokens))
                              for u in urls]  # fmt: skip
                for level, label in zip(levels, labels, strict=True):
                    errors = [r.error for r in level.results if not r.ok]
                    if errors:
                        print(f"{len(errors)} failed, e.g. {errors[0]}", file=sys.stderr)
                    level.method += label
                    lines.append(level_row(level))
                    print(lines[-1], flush=True)
                if versus is not None:
                    pairs.append((method, concurrency, *levels))
        if pairs:
            lines += ["", f"| method | clients | tok/s / tok/s [{args.versus}] | TTFT p50 / TTFT p50 [{args.versus}] |",
                      "|---|---:|---:|---:|"]  # fmt: skip
            for method, concurrency, mine, theirs in pairs:
                lines.append(f"| {method} | {concurrency} | {rate(mine) / rate(theirs):.2f}x | "
                             f"{ttft_p50(mine):.3f} / {ttft_p50(theirs):.3f} s |")  # fmt: skip
            print("\n".join(lines[-len(pairs) - 2 :]))
        if args.rss:
            if pid is None:
                raise SystemExit("--rss needs the server's --pid (or let this script start the server)")
            marks = sorted(int(m) for m in args.rss.split(","))
            lines += ["", f"| requests ({args.rss_max_tokens} tokens, methods in turn) | RSS (MiB) |", "|---:|---:|"]
            lines += asyncio.run(memory_run(url, pid, prompts, args.methods, marks, args))
            print("\n".join(lines[-len(marks) - 2 :]))
        if args.out:
            Path(args.out).write_text("\n".join(lines) + "\n", encoding="utf-8")
    finally:
        for started in (process, versus):
            if started is not None:
                started.send_signal(signal.SIGTERM)
                started.wait(60)


if __name__ == "__main__":
    main()
