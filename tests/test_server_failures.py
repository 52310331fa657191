"""The server's worker when a generation raises or the server stops: a request that fails, fails
alone (the others in its batch get exactly their text), and at shutdown every request still in
flight gets an event that ends it."""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest
import torch

pytest.importorskip("fastapi", reason="the server tests need the server extra: pip install -e '.[server,test]'")

from server_launcher import build_spec  # noqa: E402
from speculum.drafters.prompt_lookup import PromptLookupDrafter  # noqa: E402
from speculum.engine import Batch, Request  # noqa: E402
from speculum.methods import SpeculativeConfig  # noqa: E402
from speculum.runner import ModelRunner  # noqa: E402
from speculum.sampling import SamplingParams  # noqa: E402
from speculum.server import ServerSettings, create_app  # noqa: E402
from speculum.server.jobs import Failed, Job, Started, Tokens  # noqa: E402
from speculum.server.metrics import Metrics  # noqa: E402
from speculum.server.worker import Worker  # noqa: E402
from speculum.tree import Draft  # noqa: E402

from helpers import build_drafter  # noqa: E402
from tiny_models import VOCAB, reference_greedy, repetitive_prompt, tiny_model  # noqa: E402

# the request that fails drafts by prompt lookup, a method no other request here runs
FAULTY = {"method": "prompt_lookup", "controller": False}
GOOD = [  # (method, stream) of the requests that must not notice it
    ({"method": "anpd", "controller": False}, True),
    ({"method": "autoregressive"}, False),
    ({"method": "anpd", "controller": False}, False),
]


def words(ids: list[int]) -> str:
    return " ".join(f"w{t}" for t in ids)


@pytest.fixture(scope="module")
def spec():
    """The reference: each prompt's text generated alone. One thread, as the server."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield build_spec()
    torch.set_num_threads(threads)


@contextmanager
def app_client(max_batch: int = 4):
    """An app whose every target forward takes 0.02 s, so that requests overlap."""
    from fastapi.testclient import TestClient

    served = build_spec(step_delay=0.02)
    served.default_config = SpeculativeConfig.coerce("autoregressive")
    app = create_app(served, ServerSettings(max_batch=max_batch))
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client, served


def complete(client, body: dict) -> tuple[int, str, dict | None]:
    """Status, text and error (in the body, or streamed after the status line) of one completion."""
    response = client.post("/v1/completions", json=body)
    if not body.get("stream"):
        data = response.json()
        return response.status_code, data["choices"][0]["text"] if "choices" in data else "", data.get("error")
    text, error = "", None
    for line in response.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            chunk = json.loads(line[6:])
            if "error" in chunk:
                error = chunk["error"]
            elif chunk.get("choices"):
                text += chunk["choices"][0]["text"] or ""
    return response.status_code, text, error


def together(client, bodies: list[dict], delays: list[float]) -> list[tuple[int, str, dict | None]]:
    def one(body, delay):
        time.sleep(delay)
        return complete(client, body)

    with ThreadPoolExecutor(len(bodies)) as pool:
        futures = [pool.submit(one, body, delay) for body, delay in zip(bodies, delays, strict=True)]
        return [future.result(timeout=120) for future in futures]


def assert_fails_alone(client, spec, faulty_stream: bool, faulty_prompt: str | None = None) -> None:
    """The GOOD requests, then the faulty one while they run: it alone fails, the others get their text."""
    prompts = [words(repetitive_prompt(10 + 3 * i, 3 + i, seed=400 + i)) for i in range(len(GOOD))]
    expected = [spec.generate(p, "autoregressive", max_new_tokens=40).text for p in prompts]
    bodies = [
        {"prompt": p, "max_tokens": 40, "stream": stream, "speculative_config": config}
        for p, (config, stream) in zip(prompts, GOOD, strict=True)
    ]
    faulty_prompt = faulty_prompt or words(repetitive_prompt(12, 4, seed=499))
    bodies.append({"prompt": faulty_prompt, "max_tokens": 40, "stream": faulty_stream, "speculative_config": FAULTY})
    *good, bad = together(client, bodies, [0.0] * len(GOOD) + [0.1])
    assert good == [(200, text, None) for text in expected]
    status, _, error = bad
    assert status == (200 if faulty_stream else 500)  # a stream's status line went before the failure
    assert error is not None and error["type"] == "server_error", bad
    metrics = client.get("/metrics").text
    assert 'speculum_requests_total{finish_reason="error",method="prompt_lookup"} 1.0' in metrics


class Faulty:
    """A drafter that drafts as ``inner`` does until its ``after``-th proposal, where ``fault`` happens."""

    def __init__(self, inner, fault: str, after: int = 3):
        self.inner, self.fault, self.after, self.calls = inner, fault, after, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def propose(self, ctx):
        self.calls += 1
        if self.calls >= self.after and self.fault == "propose":
            raise RuntimeError("a drafter's bug")
        if self.calls >= self.after and self.fault == "forward":
            return Draft.chain([VOCAB + 1000])  # out of the embedding's range
        return self.inner.propose(ctx)

    def observe(self, ctx, outcome):
        if self.calls >= self.after and self.fault == "observe":
            raise RuntimeError("a drafter's bug")
        self.inner.observe(ctx, outcome)


@pytest.mark.parametrize("fault", ["propose", "forward", "observe"])
def test_an_isolating_batch_steps_on_without_the_row_that_raises(fault):
    """Engine level: the failed row leaves with its error, every other row gives exactly its
    single-request tokens; a batch that does not isolate raises, as a lone request does."""
    model = tiny_model("llama")
    prompts = [repetitive_prompt(20, 5, 10), repetitive_prompt(9, 4, 11), repetitive_prompt(30, 7, 12)]
    refs = [reference_greedy(model, p, 24) for p in prompts]

    def requests():
        drafters = [build_drafter("anpd"), Faulty(build_drafter("prompt_lookup"), fault), build_drafter("anpd")]
        return [Request(p, d, SamplingParams(), 24) for p, d in zip(prompts, drafters, strict=True)]

    batch = Batch(ModelRunner(model), isolate=True)
    rows = [batch.join(request) for request in requests()]
    outputs, failed = {id(row): [] for row in rows}, []
    while batch.rows:
        for row, new in batch.step():
            outputs[id(row)].extend(new)
        failed += batch.failed
    assert [(row, type(error)) for row, error in failed] == [
        (rows[1], IndexError if fault == "forward" else RuntimeError)
    ]
    assert rows[1].stats.stop_reason == "error" and 0 < len(outputs[id(rows[1])]) < 24
    assert [outputs[id(rows[0])], outputs[id(rows[2])]] == [refs[0], refs[2]]
    plain = Batch(ModelRunner(model))
    for request in requests():
        plain.join(request)
    with pytest.raises(IndexError if fault == "forward" else RuntimeError):
        while plain.rows:
            plain.step()


def in_a_batch(ctx) -> bool:
    return ctx.rows > 1


@pytest.mark.parametrize("faulty_stream", [False, True])
@pytest.mark.parametrize("fault", ["propose", "forward", "observe"])
def test_a_row_that_raises_fails_alone(spec, monkeypatch, fault, faulty_stream):
    """A drafter that raises while drafting or learning, or a draft the target's forward cannot
    take (a token beyond the vocabulary), fails its own request only, a few steps into the batch."""
    propose, observe, calls = PromptLookupDrafter.propose, PromptLookupDrafter.observe, []

    def faulty_propose(self, ctx):
        calls.append(ctx.rows)
        if fault in ("propose", "forward") and in_a_batch(ctx) and len(calls) >= 3:
            if fault == "propose":
                raise RuntimeError("a drafter's bug")
            return Draft.chain([VOCAB + 1000])  # out of the embedding's range
        return propose(self, ctx)

    def faulty_observe(self, ctx, outcome):
        if fault == "observe" and in_a_batch(ctx) and len(calls) >= 3:
            raise RuntimeError("a drafter's bug")
        return observe(self, ctx, outcome)

    monkeypatch.setattr(PromptLookupDrafter, "propose", faulty_propose)
    monkeypatch.setattr(PromptLookupDrafter, "observe", faulty_observe)
    with app_client() as (client, _):
        assert_fails_alone(client, spec, faulty_stream)
        # the server goes on: the method that failed serves the next request
        assert complete(client, {"prompt": "w5 w6 w7", "max_tokens": 5, "speculative_config": FAULTY})[0] == 200


@pytest.mark.parametrize("fault", ["prefill", "start"])
def test_a_request_whose_prefill_or_join_raises_fails_alone(spec, monkeypatch, fault):
    """Its prompt's prefill, or its drafter's start as it joins the batch, raises while others decode."""
    marker = VOCAB - 1  # a token of the faulty prompt only
    with app_client() as (client, served):
        prefill, start = served.runner.prefill, PromptLookupDrafter.start

        def faulty_prefill(cache, token_ids, *args, **kwargs):
            if fault == "prefill" and marker in token_ids:
                raise RuntimeError("a prefill's bug")
            return prefill(cache, token_ids, *args, **kwargs)

        def faulty_start(self, ctx):
            if fault == "start":
                raise RuntimeError("a drafter's bug")
            return start(self, ctx)

        monkeypatch.setattr(served.runner, "prefill", faulty_prefill)
        monkeypatch.setattr(PromptLookupDrafter, "start", faulty_start)
        assert_fails_alone(client, spec, faulty_stream=False, faulty_prompt=words([5, 6, marker, 5, 6, marker]))


def test_requests_in_flight_at_shutdown_get_a_final_event(spec):
    """Stopping the worker ends the running request and the queued one with a 503 each, at once:
    a handler waiting on its events returns instead of waiting for the server's grace period."""
    served = build_spec(step_delay=0.02)
    worker = Worker(served, Metrics(), max_queue=4, max_batch=1)
    config = SpeculativeConfig.coerce("autoregressive")

    async def scenario():
        loop = asyncio.get_running_loop()

        def job(prompt: str) -> Job:
            return Job(served.encode_prompt(prompt), config, 200, 0.0, 1.0, 0, None, [], 60.0, loop)

        running, queued = job("w5 w6 w7 w5 w6"), job("w8 w9 w8 w9")
        worker.start()
        worker.submit(running)
        worker.submit(queued)
        assert isinstance(await asyncio.wait_for(running.events.get(), 10), Started)
        assert isinstance(await asyncio.wait_for(running.events.get(), 10), Tokens)  # it streams
        stopping = loop.run_in_executor(None, worker.stop)
        ends = []
        for current in (running, queued):
            while True:
                event = await asyncio.wait_for(current.events.get(), 2)  # not the whole generation's 4 s
                if isinstance(event, Failed):
                    ends.append(event.error)
                    break
        await stopping
        return ends

    started = time.monotonic()
    ends = asyncio.run(scenario())
    assert time.monotonic() - started < 3
    assert [(e.status, e.code) for e in ends] == [(503, "shutting_down")] * 2
