"""A real ``speculum serve`` process on a tiny model, for the server tests.

``python server_launcher.py [--method M] [--params JSON] [--api-key K] ...`` builds the tiny Llama
(and a perturbed copy as its draft) from tiny_models, binds a free loopback port, prints it on
stdout and serves until SIGTERM. ``running_server(...)`` starts one from a test and stops it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch

HERE = Path(__file__).resolve().parent


def build_spec(step_delay: float = 0.0):
    """The tiny target (+ draft) every server test uses; the same weights in every process (seeded)."""
    import speculum

    from tiny_models import perturbed_copy, tiny_model, word_tokenizer

    target = tiny_model("llama")
    draft = perturbed_copy(target)
    if step_delay:  # slow every target forward down, so that queueing, timeouts and disconnects can be timed
        target.get_input_embeddings().register_forward_pre_hook(lambda *_: time.sleep(step_delay))
    tokenizer = word_tokenizer()
    return speculum.Speculum(target, tokenizer, draft, tokenizer, name="tiny-llama", draft_name="perturbed")


@dataclass
class Server:
    url: str
    process: subprocess.Popen
    log: Path

    def stop(self) -> int:
        """SIGTERM (what a service manager sends), then wait: uvicorn shuts down gracefully."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


@contextmanager
def running_server(*args: str):
    log = Path(tempfile.mkstemp(prefix="speculum-server-", suffix=".log")[1])
    with open(log, "w") as err:
        process = subprocess.Popen(
            [sys.executable, str(HERE / "server_launcher.py"), *args],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            cwd=HERE,
            env={**os.environ, "PYTHONPATH": str(HERE)},
        )
    server = Server("", process, log)
    try:
        line = process.stdout.readline()
        if not line.strip().isdigit():
            raise RuntimeError(f"the test server did not start:\n{log.read_text()}")
        server.url = f"http://127.0.0.1:{int(line)}"
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the test server did not answer /health:\n{log.read_text()}")
            time.sleep(0.1)
        yield server
    finally:
        server.stop()
        process.stdout.close()
        log.unlink(missing_ok=True)


def main() -> None:
    from speculum.methods import SpeculativeConfig
    from speculum.server import ServerSettings, serve

    parser = argparse.ArgumentParser()
    parser.add_argument("--method", default="anpd")
    parser.add_argument("--params", default="{}", help="the method's parameters, as a JSON object")
    parser.add_argument("--api-key")
    parser.add_argument("--max-queue", type=int, default=128)
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--prefill-chunk", type=int, default=256)
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument("--step-delay", type=float, default=0.0)
    args = parser.parse_args()
    torch.set_num_threads(1)  # a tiny model; leave the other core to the test process
    spec = build_spec(args.step_delay)
    spec.default_config = SpeculativeConfig.coerce(args.method, **json.loads(args.params))
    settings = ServerSettings(
        api_key=args.api_key,
        max_queue=args.max_queue,
        max_batch=args.max_batch,
        prefill_chunk=args.prefill_chunk,
        request_timeout=args.request_timeout,
        max_tokens_limit=1024,
    )
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    print(sock.getsockname()[1], flush=True)
    serve(spec, settings, sockets=[sock], log_level="warning")


if __name__ == "__main__":
    main()
