"""speculum serve against real server processes on loopback (tiny models): the official openai
client, streaming, load, queueing, disconnects, timeouts, bad input, API keys, metrics, pools."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager

import pytest
import torch

pytest.importorskip("fastapi", reason="the server tests need the server extra: pip install -e '.[server,test]'")
openai = pytest.importorskip("openai", reason="the server tests need the openai client (test extra)")
httpx = pytest.importorskip("httpx")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from server_launcher import build_spec, running_server  # noqa: E402
from speculum.drafters.auto import AutoDrafter  # noqa: E402
from speculum.errors import InvalidInputError  # noqa: E402
from speculum.methods import SpeculativeConfig  # noqa: E402
from speculum.server import ServerSettings, create_app  # noqa: E402
from speculum.server.output import Output, Piece  # noqa: E402

from tiny_models import repetitive_prompt  # noqa: E402

KEY = "sk-test-key"
MODEL = "tiny-llama"


def words(ids: list[int]) -> str:
    return " ".join(f"w{t}" for t in ids)


@pytest.fixture(scope="module")
def spec():
    """The server's model, built again here: what every response is compared with. One thread, as
    the server: a tiny model gains nothing from two, and two threads crawl on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield build_spec()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def server():
    # without the controller: tests compare the server's rounds with the library's, and the
    # controller decides on measured times (its own tests are in test_controller.py)
    with running_server("--api-key", KEY, "--method", "anpd", "--params", '{"controller": false}') as s:
        yield s


@pytest.fixture(scope="module")
def slow_server():
    """0.05 s per target forward, one request at a time, one waiting place, requests limited to 2 s."""
    args = ("--step-delay", "0.05", "--max-queue", "1", "--max-batch", "1", "--request-timeout", "2",
            "--method", "autoregressive")  # fmt: skip
    with running_server(*args) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def auth() -> dict:
    return {"Authorization": f"Bearer {KEY}"}


def metric(url: str, name: str, headers=None, **labels) -> float:
    """The sum of the samples of /metrics with this name and these labels (0 when absent)."""
    text = httpx.get(url + "/metrics", headers=headers or {}).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )


def sources_of(spec, prompt, method, **kwargs) -> list[str]:
    """Where each output token comes from, as the library's stream says (draft or target)."""
    out = []
    for chunk in spec.generate(prompt, method, stream=True, **kwargs):
        out += ["draft"] * chunk.num_draft_tokens + ["target"] * (len(chunk.token_ids) - chunk.num_draft_tokens)
    return out


def stream_parts(chunks):
    """Text, per-token pieces, finish reason, final speculation stats and usage of a list of stream chunks."""
    text, tokens, finish, stats, usage = "", [], None, None, None
    for chunk in chunks:
        extra = getattr(chunk, "speculation", None)
        if chunk.usage is not None:
            usage = chunk.usage
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        text += choice.text if hasattr(choice, "text") else (choice.delta.content or "")
        if choice.finish_reason:
            finish, stats = choice.finish_reason, extra
        elif extra:
            tokens += extra["tokens"]
    return text, tokens, finish, stats, usage


# ---------------------------------------------------------------------------------------- the openai client


def test_completion_streamed_equals_whole_equals_generate(client, spec):
    prompt = words(repetitive_prompt(24, 5))
    expected = spec.generate(prompt, "anpd", max_new_tokens=40, controller=False)
    assert expected.text == spec.generate(prompt, "autoregressive", max_new_tokens=40).text  # lossless

    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40)
    assert whole.choices[0].text == expected.text
    assert whole.choices[0].finish_reason == ("stop" if expected.stats.stop_reason == "eos" else "length")
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (
        len(expected.prompt_ids),
        len(expected.token_ids),
    )
    stats = whole.speculation
    assert stats["method"] == "anpd"
    assert stats["num_spec_steps"] == expected.stats.target_forwards < 40  # the n-grams of the prompt paid off
    assert stats["num_accepted_tokens"] == expected.stats.accepted_tokens > 0
    assert stats["mean_acceptance_length"] == pytest.approx(expected.stats.mean_acceptance_length, abs=1e-3)
    assert stats["draft_acceptance_rate"] == pytest.approx(expected.stats.draft_acceptance_rate, abs=1e-3)

    chunks = list(
        client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=40, stream=True, stream_options={"include_usage": True}
        )
    )
    text, tokens, finish, final, usage = stream_parts(chunks)
    assert text == expected.text
    assert "".join(t["text"] for t in tokens) == expected.text
    # every token coloured by its origin, exactly as the engine committed it
    assert [t["source"] for t in tokens] == sources_of(spec, prompt, "anpd", max_new_tokens=40, controller=False)
    assert finish == whole.choices[0].finish_reason
    assert final["num_accepted_tokens"] == stats["num_accepted_tokens"]
    assert usage.completion_tokens == len(expected.token_ids)


def test_chat_streamed_equals_whole_equals_generate(client, spec):
    messages = [{"role": "user", "content": words(repetitive_prompt(16, 4, seed=3))}]
    expected = spec.generate(messages, "anpd", max_new_tokens=24, controller=False)
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24)
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == expected.text
    assert whole.usage.completion_tokens == len(expected.token_ids)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    text, tokens, finish, final, _ = stream_parts(chunks)
    assert text == expected.text == "".join(t["text"] for t in tokens)
    assert finish == whole.choices[0].finish_reason
    assert final["num_spec_steps"] == expected.stats.target_forwards


def test_auto_reports_which_drafter_was_accepted_and_the_controller_rounds(client, spec):
    prompt = words(repetitive_prompt(20, 6, seed=7))
    extra = {"speculative_config": {"method": "auto", "controller": True}}
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, extra_body=extra)
    assert whole.choices[0].text == spec.generate(prompt, "autoregressive", max_new_tokens=24).text
    speculation = whole.speculation
    assert speculation["method"] == "auto"
    assert sum(speculation["accepted_by"].values()) == speculation["num_accepted_tokens"] > 0
    assert speculation["rounds_drafted"] + speculation["rounds_plain"] == speculation["num_spec_steps"]


def test_request_picks_method_and_sampling(client, spec):
    prompt = words(repetitive_prompt(20, 6, seed=5))
    sampling = dict(temperature=0.9, top_p=0.95, seed=11)
    # without the controller: what is drafted then does not depend on measured times
    expected = spec.generate(
        prompt, "draft_model", max_new_tokens=24, top_k=20, num_speculative_tokens=3, controller=False, **sampling
    )
    config = {"method": "draft_model", "num_speculative_tokens": 3, "controller": False}
    extra = {"top_k": 20, "speculative_config": config}
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, extra_body=extra, **sampling)
    assert whole.choices[0].text == expected.text
    assert whole.speculation["method"] == "draft_model"
    assert whole.speculation["num_draft_tokens"] == expected.stats.drafted_tokens
    chunks = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=24, stream=True, extra_body=extra, **sampling
    )
    assert stream_parts(chunks)[0] == expected.text


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings(client, spec, stream):
    prompt = words(repetitive_prompt(24, 5, seed=1))
    full = spec.generate(prompt, "anpd", max_new_tokens=30)
    words_out = full.text.split()
    stop = " ".join(words_out[4:6])  # two tokens: the text before them is held back until they complete
    cut = full.text.index(stop)
    needed = next(n for n in range(1, 31) if len(spec.decode(full.token_ids[:n])) >= cut + len(stop))
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, stop=["w999", stop], stream=stream)
    if stream:
        text, tokens, finish, _, _ = stream_parts(response)
        assert "".join(t["text"] for t in tokens) == text
    else:
        text, finish = response.choices[0].text, response.choices[0].finish_reason
        assert response.usage.completion_tokens == needed
    assert text == full.text[:cut]
    assert finish == "stop"


# ---------------------------------------------------------------------------------------- load


def test_64_concurrent_streams_all_complete_and_equal_sequential(server, spec):
    """64 streaming clients at once, mixed methods and sampling: every one completes and gets exactly
    what it would get alone (greedy: plain greedy decoding; sampled: the library's own result)."""
    methods = ["anpd", "autoregressive", "prompt_lookup", "draft_model", "lookahead", "ouroboros"]
    jobs = []
    for i in range(64):
        prompt = words(repetitive_prompt(12 + i % 13, 3 + i % 5, seed=100 + i))
        method = methods[i % len(methods)]
        if i % 4 == 3:  # sampled, with methods whose drafts do not depend on earlier requests
            method = ("anpd", "draft_model")[i % 2]
            params = dict(temperature=0.8, seed=i)
            expected = spec.generate(prompt, method, max_new_tokens=24, **params).text
        else:
            params = {}
            expected = spec.generate(prompt, "autoregressive", max_new_tokens=24).text
        jobs.append((prompt, method, params, expected))

    async def one(client, prompt, method, params):
        stream = await client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=24,
            stream=True,
            extra_body={"speculative_config": {"method": method}},
            **params,
        )
        chunks = [chunk async for chunk in stream]
        return stream_parts(chunks)

    async def run_all():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0) as client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, *job[:3]) for job in jobs)), timeout=150)

    before = metric(server.url, "speculum_requests_total", auth())
    results = asyncio.run(run_all())
    for (prompt, method, params, expected), (text, tokens, finish, stats, _) in zip(jobs, results, strict=True):
        assert finish in ("stop", "length"), (method, params)
        assert stats["method"] == method
        assert text == expected, (prompt, method, params)
        assert "".join(t["text"] for t in tokens) == text
    assert metric(server.url, "speculum_requests_total", auth()) == before + 64


@pytest.fixture(scope="module")
def batch_server():
    """0.05 s per target forward, at most 4 requests decoded together, 8 prompt tokens prefilled a step."""
    args = ("--step-delay", "0.05", "--max-batch", "4", "--prefill-chunk", "8", "--method", "autoregressive")
    with running_server(*args) as s:
        yield s


def test_requests_decode_together_and_one_leaving_does_not_disturb_the_others(batch_server, spec):
    """Continuous batching: 4 streams run as rows of one batch (the running gauge shows 4, a fifth
    waits in the queue), one client leaves mid-way, and every other one gets its sequential text."""
    url = batch_server.url
    prompts = [words(repetitive_prompt(6 + 3 * i, 3 + i, seed=200 + i)) for i in range(5)]
    expected = [spec.generate(p, "autoregressive", max_new_tokens=30).text for p in prompts]
    seen_running, seen_queued = [], []

    async def watch(stop: asyncio.Event):
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            while not stop.is_set():
                text = (await client.get("/metrics")).text
                for family in text_string_to_metric_families(text):
                    for sample in family.samples:
                        if sample.name == "speculum_requests_running":
                            seen_running.append(sample.value)
                        if sample.name == "speculum_queue_length":
                            seen_queued.append(sample.value)
                await asyncio.sleep(0.05)

    async def one(client, prompt, leave_after=None):
        body = {"prompt": prompt, "max_tokens": 30, "stream": True}
        text, events = "", 0
        async with client.stream("POST", "/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                text += chunk["choices"][0]["text"] if chunk.get("choices") else ""
                events += 1
                if leave_after is not None and events >= leave_after:
                    return None  # the client goes away mid-stream
        return text

    async def scenario():
        stop = asyncio.Event()
        watcher = asyncio.create_task(watch(stop))
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            results = await asyncio.gather(*(one(client, p, 5 if i == 1 else None) for i, p in enumerate(prompts)))
        stop.set()
        await watcher
        return results

    results = asyncio.run(scenario())
    assert results[1] is None
    assert [r for i, r in enumerate(results) if i != 1] == [e for i, e in enumerate(expected) if i != 1]
    assert max(seen_running) == 4 and max(seen_queued) >= 1
    assert metric(url, "speculum_decode_seconds_total") > 0 and metric(url, "speculum_prefill_seconds_total") > 0


def test_a_short_prompt_decodes_while_a_long_prompt_is_still_prefilled(batch_server, spec):
    """Prefill goes a chunk at a time even while nothing decodes, the fewest tokens left first: a
    short request sent just after a long one streams before the long prompt's prefill is done."""
    url = batch_server.url
    long_prompt = words(repetitive_prompt(60, 7, seed=300))
    short_prompt = words(repetitive_prompt(4, 2, seed=301))
    expected = [spec.generate(p, "autoregressive", max_new_tokens=12).text for p in (long_prompt, short_prompt)]
    arrivals = []  # which stream each token chunk came to, in order

    async def one(client, name, prompt, delay):
        await asyncio.sleep(delay)
        text = ""
        body = {"prompt": prompt, "max_tokens": 12, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0]["text"]:
                    text += chunk["choices"][0]["text"]
                    arrivals.append(name)
        return text

    async def scenario():
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            return await asyncio.gather(one(client, "long", long_prompt, 0.0), one(client, "short", short_prompt, 0.03))

    assert list(asyncio.run(scenario())) == expected
    assert arrivals.index("long") >= 3  # the short one had streamed several tokens by then


# ---------------------------------------------------------------------------------------- queue, disconnect, timeout


def test_queue_full_answers_503_with_retry_after(slow_server):
    long = {"prompt": "w5 w6 w7", "max_tokens": 200, "stream": True}
    short = {"prompt": "w5 w6 w7", "max_tokens": 3}

    async def scenario():
        async with httpx.AsyncClient(base_url=slow_server.url, timeout=30) as client:
            async with client.stream("POST", "/v1/completions", json=long) as running:
                assert running.status_code == 200
                lines = running.aiter_lines()  # held: dropping it would close the stream
                async for line in lines:
                    if line.startswith("data: "):
                        break  # the first request is generating
                waiting = asyncio.create_task(client.post("/v1/completions", json=short))
                await asyncio.sleep(0.3)  # ... the second fills the one waiting place
                refused = await client.post("/v1/completions", json=short)
            # leaving the stream disconnects the first request: the waiting one runs next
            return refused, await waiting

    refused, waited = asyncio.run(scenario())
    assert refused.status_code == 503
    assert int(refused.headers["Retry-After"]) >= 1
    assert refused.json()["error"]["code"] == "queue_full"
    assert waited.status_code == 200
    assert waited.json()["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_cancels_the_generation(slow_server, stream):
    url = slow_server.url
    before = metric(url, "speculum_requests_total", finish_reason="cancelled", method="autoregressive")
    body = {"prompt": "w5 w6 w7", "max_tokens": 200, "stream": stream}  # 10 s of work
    with httpx.Client(timeout=10) as client:
        if stream:
            with client.stream("POST", url + "/v1/completions", json=body) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        break
        else:
            with pytest.raises(httpx.ReadTimeout):
                client.post(url + "/v1/completions", json=body, timeout=0.3)
        # the connection is closed: the worker stops at its next step, well before the 2 s limit
        deadline = time.monotonic() + 1.5
        while metric(url, "speculum_requests_total", finish_reason="cancelled", method="autoregressive") == before:
            assert time.monotonic() < deadline, "the generation went on after the client left"
            time.sleep(0.05)
        start = time.monotonic()
        quick = client.post(url + "/v1/completions", json={"prompt": "w5", "max_tokens": 2})
        assert quick.status_code == 200 and time.monotonic() - start < 1.5  # the worker is free


def test_timeout(slow_server):
    body = {"prompt": "w5 w6 w7", "max_tokens": 200}
    start = time.monotonic()
    response = httpx.post(slow_server.url + "/v1/completions", json=body, timeout=10)
    assert response.status_code == 504
    assert response.json()["error"]["code"] == "timeout"
    assert 1.9 < time.monotonic() - start < 4
    # a stream has sent its status line already: it ends with an error event, then [DONE]
    with httpx.stream("POST", slow_server.url + "/v1/completions", json={**body, "stream": True}, timeout=10) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert r.status_code == 200
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "timeout"
    assert all("choices" in json.loads(e) for e in events[:-2])


# ---------------------------------------------------------------------------------------- bad input


LONG_PROMPT = " ".join(["w5"] * 300)  # the tiny model's context is 256 positions


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/completions", b'{"prompt": "w5",', 400, None),  # malformed JSON
        ("/v1/completions", b"[1, 2]", 400, None),
        ("/v1/completions", b"", 400, None),
        ("/v1/completions", {"prompt": "w5", "logprobs": 3}, 400, "logprobs"),
        ("/v1/completions", {"prompt": "w5", "temperature": 2.5}, 400, "temperature"),
        ("/v1/completions", {"prompt": "w5", "top_p": 0}, 400, "top_p"),
        ("/v1/completions", {"prompt": "w5", "top_k": -2}, 400, "top_k"),
        ("/v1/completions", {"prompt": "w5", "max_tokens": 0}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "w5", "max_tokens": 100000}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "w5", "seed": -1}, 400, "seed"),
        ("/v1/completions", {"prompt": "w5", "n": 2}, 400, "n"),
        ("/v1/completions", {"prompt": "w5", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
        ("/v1/completions", {"prompt": "w5", "stop": ""}, 400, "stop"),
        ("/v1/completions", {"prompt": ""}, 400, "prompt"),
        ("/v1/completions", {"prompt": []}, 400, "prompt"),
        ("/v1/completions", {"prompt": [[]]}, 400, "prompt"),
        ("/v1/completions", {"prompt": [[5, 6]]}, 400, "prompt"),
        ("/v1/completions", {"prompt": [""]}, 400, "prompt"),
        ("/v1/completions", {"prompt": ["   "]}, 400, "prompt"),
        ("/v1/completions", {"prompt": ["", ""]}, 400, "prompt"),
        ("/v1/completions", {"prompt": [-1]}, 400, "prompt"),
        ("/v1/completions", {"prompt": [2**70]}, 400, "prompt"),
        ("/v1/completions", {"prompt": None}, 400, "prompt"),
        ("/v1/completions", {"prompt": "w5", "stop": "x" * 257}, 400, "stop"),
        ("/v1/completions", {"prompt": "w5", "stop": ["w6", "x" * 257]}, 400, "stop"),
        ("/v1/completions", {"prompt": [5, 999]}, 400, "prompt"),
        ("/v1/completions", {"prompt": ["w5", 3]}, 400, "prompt"),
        ("/v1/completions", {"prompt": LONG_PROMPT}, 400, "prompt"),
        ("/v1/completions", {"prompt": "w5", "model": "gpt-4"}, 404, "model"),
        ("/v1/completions", {"prompt": "w5", "speculative_config": {"method": "nope"}}, 400, "speculative_config.method"),  # noqa: E501
        ("/v1/completions", {"prompt": "w5", "speculative_config": {"method": "anpd", "k": 1}}, 400, "speculative_config"),  # noqa: E501
        ("/v1/completions", {"prompt": "w5", "speculative_config": {"method": "anpd", "preset": "fast"}}, 400, "speculative_config"),  # noqa: E501
        ("/v1/completions", {"prompt": "w5", "speculative_config": {"num_speculative_tokens": 0}}, 400, "speculative_config"),  # noqa: E501
        ("/v1/completions", {"prompt": "w5", "speculative_config": {"window_size": 10**6, "method": "lookahead"}}, 400, "speculative_config.window_size"),  # noqa: E501
        ("/v1/completions", {"prompt": "w5", "speculative_config": {"pool_path": "/tmp/x"}}, 400, "speculative_config.pool_path"),  # noqa: E501
        ("/v1/completions", {"prompt": "w5", "speculative_config": {"heads": "x"}}, 400, "speculative_config.heads"),  # noqa: E501
        ("/v1/completions", {"prompt": "w5", "speculative_config": {"method": "draft_model", "length_policy": "../h"}}, 400, "speculative_config.length_policy"),  # noqa: E501
        ("/v1/completions", {"prompt": "w5", "speculative_config": {"method": "anpd", "persist": True}}, 400, "speculative_config.persist"),  # noqa: E501
        ("/v1/completions", {"prompt": "w5", "speculative_config": {"method": "ouroboros", "reuse_history": True}}, 400, "speculative_config.reuse_history"),  # noqa: E501
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w5"}], "stop": "x" * 257}, 400, "stop"),
        ("/v1/chat/completions", {"messages": []}, 400, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "w5"}]}, 400, "messages.0.role"),
        ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, "messages.0.content"),
        ("/v1/chat/completions", {"prompt": "w5"}, 400, None),
    ],
)  # fmt: skip
def test_bad_input_gets_an_openai_error(server, path, body, status, param):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {**auth(), "Content-Type": "application/json"}
    response = httpx.post(server.url + path, content=content, headers=headers)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param, error


def test_bad_input_message_says_what_is_wrong(server):
    headers = auth()
    empty = httpx.post(server.url + "/v1/completions", json={"prompt": []}, headers=headers).json()["error"]
    assert "empty" in empty["message"]
    stop = httpx.post(server.url + "/v1/completions", json={"prompt": "w5", "stop": "x" * 257}, headers=headers)
    assert "256 characters" in stop.json()["error"]["message"]


def test_a_near_zero_temperature_is_greedy(client, spec):
    """1e-40 would overflow the logits to inf and the probabilities to NaN: it counts as 0 (greedy)."""
    prompt = words(repetitive_prompt(20, 4, seed=9))
    greedy = spec.generate(prompt, "anpd", max_new_tokens=16).text
    for temperature in (1e-40, 1e-6):
        response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=temperature)
        assert response.choices[0].text == greedy


def test_request_bodies_over_the_limit_get_413(server):
    """The default limit is 1 MiB, whether the body says its length or comes in chunks."""
    body = json.dumps({"prompt": "w5", "user": "x" * (1 << 20)}).encode()
    headers = {**auth(), "Content-Type": "application/json"}
    before = metric(server.url, "speculum_rejected_requests_total", auth(), reason="too_large")
    for content in (body, (body[i : i + 65536] for i in range(0, len(body), 65536))):
        response = httpx.post(server.url + "/v1/completions", content=content, headers=headers)
        assert response.status_code == 413
        error = response.json()["error"]
        assert error["code"] == "request_too_large" and "1048576 bytes" in error["message"]
    assert metric(server.url, "speculum_rejected_requests_total", auth(), reason="too_large") == before + 2
    small = {"prompt": "w5", "max_tokens": 2, "user": "x" * 1000}
    assert httpx.post(server.url + "/v1/completions", json=small, headers=auth()).status_code == 200


def test_bad_input_through_the_openai_client(client):
    with pytest.raises(openai.BadRequestError, match="unknown method"):
        client.completions.create(model=MODEL, prompt="w5", extra_body={"speculative_config": {"method": "nope"}})
    with pytest.raises(openai.BadRequestError, match="context"):
        client.completions.create(model=MODEL, prompt=LONG_PROMPT, stream=True)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="w5")


# ---------------------------------------------------------------------------------------- API key, metrics


def test_api_key(server):
    url = server.url
    for path in ("/v1/models", "/metrics", "/"):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic !!"}):
            response = httpx.get(url + path, headers=headers)
            assert response.status_code == 401
            assert response.json()["error"]["code"] == "invalid_api_key"
            assert "WWW-Authenticate" in response.headers
    response = httpx.post(url + "/v1/completions", json={"prompt": "w5"})
    assert response.status_code == 401
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    card = httpx.get(url + "/v1/models", headers=auth()).json()["data"][0]
    assert (card["id"], card["chat_template"], card["speculation"]["default"]) == (
        MODEL,
        True,
        {"method": "anpd", "controller": False},
    )
    assert "speculum" in httpx.get(url + "/", auth=("anyone", KEY)).text  # a browser's Basic login
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()


def test_metrics_move(server, client):
    url, h = server.url, auth()
    labels = dict(method="prompt_lookup", finish_reason="length")
    before = {
        "requests": metric(url, "speculum_requests_total", h, **labels),
        "tokens": metric(url, "speculum_generation_tokens_total", h, method="prompt_lookup"),
        "ttft": metric(url, "speculum_time_to_first_token_seconds_count", h, method="prompt_lookup"),
        "steps": metric(url, "speculum_spec_steps_total", h, method="prompt_lookup"),
        "unauthorized": metric(url, "speculum_rejected_requests_total", h, reason="unauthorized"),
        "invalid": metric(url, "speculum_rejected_requests_total", h, reason="invalid"),
    }
    extra = {"speculative_config": {"method": "prompt_lookup"}}
    response = client.completions.create(model=MODEL, prompt="w5 w6 w5 w6 w5", max_tokens=12, extra_body=extra)
    httpx.get(url + "/v1/models")
    httpx.post(url + "/v1/completions", json={"prompt": ""}, headers=h)
    assert metric(url, "speculum_requests_total", h, **labels) == before["requests"] + 1
    assert metric(url, "speculum_generation_tokens_total", h, method="prompt_lookup") == before["tokens"] + 12
    assert metric(url, "speculum_time_to_first_token_seconds_count", h, method="prompt_lookup") == before["ttft"] + 1
    steps = metric(url, "speculum_spec_steps_total", h, method="prompt_lookup") - before["steps"]
    assert steps == response.speculation["num_spec_steps"]
    assert metric(url, "speculum_mean_acceptance_length", h, method="prompt_lookup") >= 1.0
    assert metric(url, "speculum_rejected_requests_total", h, reason="unauthorized") == before["unauthorized"] + 1
    assert metric(url, "speculum_rejected_requests_total", h, reason="invalid") == before["invalid"] + 1


# ---------------------------------------------------------------------------------------- the CLI, pools


def test_speculum_serve_saves_its_pool_on_shutdown(model_dir, tmp_path):
    """The real command: serve, answer, and on SIGTERM save the persistent n-gram table atomically."""
    from transformers import AutoTokenizer

    from speculum.drafters.ngram_table import NgramTable
    from speculum.models import vocab_fingerprint

    pool = tmp_path / "anpd.pool"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "speculum.cli", "serve", "--model", model_dir, "--port", str(port)]
    command += ["--method", "anpd", "--param", "persist=true", "--param", f"pool_path={pool}", "--share-pools"]
    command += ["--log-level", "warning"]
    env = {**os.environ, "SPECULUM_API_KEY": KEY}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert process.poll() is None and time.monotonic() < deadline, process.stdout.read()
            time.sleep(0.2)
        assert httpx.get(url + "/v1/models").status_code == 401  # the key came from the environment
        prompt = "w5 w6 w7 w8 w5 w6 w7 w8"
        response = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 4}, headers=auth())
        assert response.status_code == 200
        assert response.json()["model"] == model_dir
        assert not pool.exists()  # ANPD saves at shutdown
    finally:
        process.send_signal(signal.SIGTERM)
        output = process.communicate(timeout=60)[0]
    assert process.returncode in (0, -signal.SIGTERM), output  # uvicorn re-raises the signal once shut down
    assert "Traceback" not in output
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    table = NgramTable.load(pool, model_key=vocab_fingerprint(tokenizer))
    assert table.draft_chain(tokenizer(prompt)["input_ids"][:5], 3)  # the prompt's n-grams are in it
    assert [p.name for p in tmp_path.iterdir()] == ["anpd.pool"]  # no temp file left behind


def test_serve_refuses_bad_options():
    from typer.testing import CliRunner

    from speculum.cli import app

    result = CliRunner().invoke(app, ["serve", "--method", "nope"])
    assert result.exit_code == 2
    assert "unknown method" in result.output and "Traceback" not in result.output
    # a pool kept across requests is shared by every client: only with --share-pools (refused before loading)
    for param in ("persist=true", "pool_path=anpd.pool"):
        result = CliRunner().invoke(app, ["serve", "--method", "anpd", "--param", param])
        assert result.exit_code == 2, result.output
        assert "--share-pools" in result.output and "Traceback" not in result.output
    result = CliRunner().invoke(app, ["serve", "--max-body-bytes", "0"])
    assert result.exit_code == 2


# ---------------------------------------------------------------------------------------- stop strings, unit


def pieces(*texts: str) -> list[Piece]:
    return [Piece(t, "target") for t in texts]


def test_output_holds_back_only_what_a_stop_string_may_begin():
    out = Output(["w7 w8"])
    out.add(pieces("w5", " w6"))
    assert [p.text for p in out.take()] == ["w5", " w6"]  # nothing a stop string begins with
    out.add(pieces(" w7"))
    assert out.take() == []  # " w7" may begin "w7 w8"
    out.add(pieces(" w9"))
    assert [p.text for p in out.take()] == [" w7", " w9"]
    out.add(pieces(" w7", " w8", " w10"))
    assert out.stopped and out.text == "w5 w6 w7 w9 "
    assert [p.text for p in out.take()] == [" ", ""]  # the stop string is cut; its tokens count
    assert out.num_tokens == 6


def test_output_without_stop_strings_shows_everything():
    out = Output([])
    out.add(pieces("a", "b"))
    assert [p.text for p in out.take()] == ["a", "b"] and out.num_tokens == 2 and not out.stopped


def naive_output(stop: list[str], batches: list[list[str]]) -> list[tuple[str, bool, int]]:
    """What Output must say after each batch (text, stopped, held back), the slow obvious way: the
    earliest stop string that ends in the new text cuts it; else the longest end of the text that a
    stop string begins with is held back."""
    text, states = "", []
    for batch in batches:
        new = text + "".join(batch)
        hits = [(at, s) for s in stop if (at := new.find(s, max(0, len(text) - len(s) + 1))) >= 0]
        if hits:
            at, _ = min(hits)
            return [*states, (new[:at], True, 0)]
        text = new
        held = max((k for s in stop for k in range(len(s)) if text.endswith(s[:k])), default=0)
        states.append((text, False, held))
    return states


def test_output_matches_the_naive_search():
    import random

    rng = random.Random(0)
    for _ in range(2000):
        stop = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(1, 3))]
        batches = [
            ["".join(rng.choice("abc") for _ in range(rng.randint(0, 3))) for _ in range(rng.randint(1, 3))]
            for _ in range(rng.randint(1, 8))
        ]
        out, states = Output(stop), []
        for batch in batches:
            out.add(pieces(*batch))
            states.append((out.text, out.stopped, 0 if out.stopped else out._pending_stop()))
            if out.stopped:
                break
        assert states == naive_output(stop, batches), (stop, batches)


def test_output_cost_per_step_does_not_grow_with_the_output():
    """The longest stop strings allowed, one character per step, a text that ends with no long
    beginning of one: the search reads each new character once (the old one tried every end of the
    text up to 255 characters long, every step)."""
    out = Output(["x" + "a" * 255, "y" * 3, "ab" * 128])
    start = time.perf_counter()
    for _ in range(40_000):
        out.add(pieces("a"))
        out.take()
    assert time.perf_counter() - start < 2.0  # about 0.1 s; the old search took 6 s
    assert not out.stopped and out._pending_stop() == 1
    out.add(pieces("b" + "ab" * 127))
    assert out.stopped and len(out.text) == 40_000 - 1


# ---------------------------------------------------------------------------------------- in-process apps


@contextmanager
def app_client(method: str = "anpd", params: dict | None = None, **settings):
    """An app on a fresh copy of the tiny model (its own drafters and pools), served in this process."""
    from fastapi.testclient import TestClient

    spec = build_spec()
    spec.default_config = SpeculativeConfig.coerce(method, **(params or {}))
    app = create_app(spec, ServerSettings(**settings))
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client, spec


def speculation_of(client, body: dict) -> dict:
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["speculation"]


def counted(client, name: str) -> float:
    return sum(
        sample.value
        for family in text_string_to_metric_families(client.get("/metrics").text)
        for sample in family.samples
        if sample.name == name
    )


# without the controller: these tests compare the rounds of two runs, which measured times would change
OUROBOROS = dict(
    window_size=2, ngram_size=3, guess_set_size=3, num_speculative_tokens=3, context_phrases=True, controller=False
)


@pytest.mark.parametrize("share", [False, True])
def test_pools_are_per_request_unless_shared(share):
    """By default a request drafts only from its own text: the same request twice runs the same way.
    With share_pools, what the first generated serves the second (Ouroboros' phrase pool, ANPD's table)."""
    body = {"prompt": words(repetitive_prompt(12, 3, seed=7)), "max_tokens": 40}
    keys = ("num_spec_steps", "num_accepted_tokens", "num_draft_forwards")
    with app_client("ouroboros", OUROBOROS, share_pools=share) as (client, _):
        first, second = (speculation_of(client, body) for _ in range(2))
        same = all(first[k] == second[k] for k in keys)
        assert same != share, (first, second)
        anpd = {"method": "anpd", "persist": True, "controller": False}  # (rounds compared: not on measured times)
        if share:
            first, second = (speculation_of(client, {**body, "speculative_config": anpd}) for _ in range(2))
            assert second["num_accepted_tokens"] > first["num_accepted_tokens"]
        else:
            response = client.post("/v1/completions", json={**body, "speculative_config": anpd})
            assert response.status_code == 400 and "--share-pools" in response.json()["error"]["message"]


@pytest.mark.parametrize("share", [False, True])
def test_auto_keeps_its_ouroboros_pool_per_request_unless_shared(share):
    """``auto``, the server's default, runs the draft model as Ouroboros: without share_pools its phrase
    pool holds one request's text only, as the method's alone does; with it the pool serves later requests."""
    body = {"prompt": words(repetitive_prompt(12, 3, seed=7)), "max_tokens": 24}
    with app_client("auto", share_pools=share) as (client, spec):
        speculation_of(client, body)
        (drafter,) = [d for d in spec.built_drafters() if isinstance(d, AutoDrafter)]
        (part,) = [p.drafter for p in drafter.parts if p.name == "ouroboros"]
        assert part.options.reuse_history == share
        pools = [value for key, value in spec._shared.items() if "phrase_pool" in str(key)]
        assert (len(pools) == 1 and len(pools[0]) > 0) if share else not pools


def test_keeping_pools_needs_share_pools():
    spec = build_spec()
    for params in ({"persist": True}, {"pool_path": "anpd.pool"}):
        spec.default_config = SpeculativeConfig.coerce("anpd", **params)
        with pytest.raises(InvalidInputError, match="--share-pools"):
            create_app(spec, ServerSettings())
        create_app(spec, ServerSettings(share_pools=True))


def test_evicted_configurations_take_their_shared_pools_along():
    """Clients sending many Ouroboros configurations: only the kept drafters' pools stay."""
    with app_client(share_pools=True, max_configs=2) as (client, spec):
        for n in range(2, 8):
            config = {"method": "ouroboros", **OUROBOROS, "ngram_size": n}
            speculation_of(client, {"prompt": "w5 w6 w7 w5 w6", "max_tokens": 4, "speculative_config": config})
        pools = {id(d.pool) for d in spec.built_drafters() if hasattr(d, "pool")}
        assert len(spec._drafters) == 2
        from speculum.drafters.phrase_pool import PhrasePool

        shared_pools = {id(p) for p in spec._shared.values() if isinstance(p, PhrasePool)}  # (not the clock)
        assert shared_pools == pools and len(pools) == 2


def test_a_failed_pool_save_fails_no_request(tmp_path):
    """Ouroboros saved its pool after every request, on the worker thread: a write that failed turned
    the finished request into a 500. The server saves between requests, logs and counts failures."""
    params = {**OUROBOROS, "pool_path": str(tmp_path / "missing" / "ouroboros.pool")}
    with app_client("ouroboros", params, share_pools=True, pool_save_interval=0) as (client, _):
        assert counted(client, "speculum_pool_save_failures_total") == 0
        response = client.post("/v1/completions", json={"prompt": "w5 w6 w7 w5 w6", "max_tokens": 8})
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 8
        deadline = time.monotonic() + 10
        while counted(client, "speculum_pool_save_failures_total") < 1:
            assert time.monotonic() < deadline, "the failed save was not counted"
            time.sleep(0.05)


def test_pools_are_saved_on_schedule_and_at_shutdown(tmp_path):
    path = tmp_path / "ouroboros.pool"
    params = {**OUROBOROS, "pool_path": str(path)}
    with app_client("ouroboros", params, share_pools=True, pool_save_interval=3600) as (client, _):
        speculation_of(client, {"prompt": "w5 w6 w7 w5 w6", "max_tokens": 8})
        time.sleep(0.5)  # a few turns of the worker's loop
        assert not path.exists()  # not after every request: at most once an hour here
    assert path.exists()  # at shutdown
    with app_client("ouroboros", params, share_pools=True, pool_save_interval=0) as (client, _):
        before = path.stat().st_mtime_ns
        speculation_of(client, {"prompt": "w8 w9 w8 w9", "max_tokens": 8})
        deadline = time.monotonic() + 10
        while path.stat().st_mtime_ns == before:  # saved between requests, not waiting for shutdown
            assert time.monotonic() < deadline, "the pool was not saved after the request"
            time.sleep(0.05)


def test_the_body_limit_is_configurable():
    with app_client(max_body_bytes=2000) as (client, _):
        body = {"prompt": "w5", "max_tokens": 2, "user": "x" * 1900}
        assert client.post("/v1/completions", json=body).status_code == 200
        body["user"] = "x" * 2000
        response = client.post("/v1/completions", json=body)
        assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"


# ---------------------------------------------------------------------------------------- the library's stream


def test_stream_chunks_say_which_tokens_were_drafted(spec):
    prompt = words(repetitive_prompt(24, 5))
    stream = spec.generate(prompt, "anpd", max_new_tokens=200, stream=True)
    chunks = [c for c in stream if c.token_ids]
    for chunk in chunks[:-1]:  # the accepted draft tokens, then the target's own
        assert len(chunk.token_ids) == chunk.num_draft_tokens + 1
    last = chunks[-1]  # may be cut at EOS or at the length limit
    assert 0 <= last.num_draft_tokens <= len(last.token_ids) <= last.num_draft_tokens + 1
    drafted = sum(c.num_draft_tokens for c in chunks)
    stats = stream.result.stats
    assert drafted > 0 and len(chunks) == stats.target_forwards
    if len(last.token_ids) == last.num_draft_tokens + 1:  # nothing accepted was cut away
        assert drafted == stats.accepted_tokens
    else:
        assert drafted < stats.accepted_tokens
    plain = spec.generate(prompt, "autoregressive", max_new_tokens=20, stream=True)
    assert all(c.num_draft_tokens == 0 for c in plain)


def test_closing_a_stream_ends_the_request_and_keeps_its_result(spec):
    stream = spec.generate(words(repetitive_prompt(24, 5)), "anpd", max_new_tokens=100, stream=True)
    chunks = iter(stream)
    received = [t for _, chunk in zip(range(3), chunks, strict=False) for t in chunk.token_ids]
    chunks.close()
    assert stream.result.token_ids == received
    assert stream.result.stats.stop_reason == "cancelled"
    assert stream.result.text == spec.decode(received)
