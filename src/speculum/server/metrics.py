"""Prometheus metrics of the server (prometheus-client), per speculative method.

Each app has its own registry, so several apps (tests) can live in one process.
"""

from __future__ import annotations

import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from speculum.stats import Stats

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
RATE_BUCKETS = (1, 2, 5, 10, 20, 30, 50, 75, 100, 150, 200, 300, 500, 1000)


class Metrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        by_method = ["method"]
        self.requests = Counter(
            "speculum_requests",
            "Generation requests that ended, by method and finish reason (stop, length, cancelled, timeout, error).",
            ["method", "finish_reason"],
            registry=r,
        )
        self.rejected = Counter(
            "speculum_rejected_requests",
            "Requests refused before generating: invalid, too_large, queue_full, unauthorized, shutting_down.",
            ["reason"],
            registry=r,
        )
        self.prompt_tokens = Counter("speculum_prompt_tokens", "Prompt tokens processed.", by_method, registry=r)
        self.generation_tokens = Counter(
            "speculum_generation_tokens", "Output tokens returned to clients.", by_method, registry=r
        )
        self.spec_steps = Counter(
            "speculum_spec_steps", "Target verification forwards (one per speculation step).", by_method, registry=r
        )
        self.draft_tokens = Counter("speculum_spec_draft_tokens", "Draft tokens verified.", by_method, registry=r)
        self.accepted_tokens = Counter(
            "speculum_spec_accepted_tokens", "Draft tokens accepted by the target.", by_method, registry=r
        )
        self.mean_acceptance_length = Gauge(
            "speculum_mean_acceptance_length",
            "Tokens committed per target forward, over all requests so far (1.0 = plain decoding).",
            by_method,
            registry=r,
        )
        self.draft_acceptance_rate = Gauge(
            "speculum_draft_acceptance_rate",
            "Accepted / verified draft tokens, over all requests so far.",
            by_method,
            registry=r,
        )
        self.time_to_first_token = Histogram(
            "speculum_time_to_first_token_seconds",
            "From arrival (queueing included) to the first output token.",
            by_method,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.time_per_output_token = Histogram(
            "speculum_time_per_output_token_seconds",
            "Mean time between output tokens after the first, per request.",
            by_method,
            buckets=TOKEN_LATENCY_BUCKETS,
            registry=r,
        )
        self.tokens_per_second = Histogram(
            "speculum_request_tokens_per_second",
            "Output tokens per second of generation, per request.",
            by_method,
            buckets=RATE_BUCKETS,
            registry=r,
        )
        self.latency = Histogram(
            "speculum_request_latency_seconds",
            "From arrival to the last token.",
            by_method,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_length = Gauge("speculum_queue_length", "Requests waiting for the worker.", registry=r)
        self.running = Gauge(
            "speculum_requests_running",
            "Requests generating now: the running batch's rows and those being prefilled to join it.",
            registry=r,
        )
        self.prefill_seconds = Counter(
            "speculum_prefill_seconds", "Seconds the worker spent prefilling prompts.", registry=r
        )
        self.decode_seconds = Counter(
            "speculum_decode_seconds", "Seconds the worker spent in batched decoding steps.", registry=r
        )
        self.pool_save_failures = Counter(
            "speculum_pool_save_failures",
            "Pool files (pool_path) that could not be written; the server goes on and tries again later.",
            registry=r,
        )
        self._lock = threading.Lock()
        self._totals: dict[str, list[int]] = {}  # method -> [committed tokens, forwards, drafted, accepted]

    def observe(
        self,
        method: str,
        finish_reason: str,
        prompt_tokens: int,
        output_tokens: int,
        stats: Stats,
        time_to_first_token: float | None,
        arrival: float,
    ) -> None:
        """A request that ran to its end (EOS, length or a stop string)."""
        self.requests.labels(method, finish_reason).inc()
        self.prompt_tokens.labels(method).inc(prompt_tokens)
        self.generation_tokens.labels(method).inc(output_tokens)
        self.spec_steps.labels(method).inc(stats.target_forwards)
        self.draft_tokens.labels(method).inc(stats.drafted_tokens)
        self.accepted_tokens.labels(method).inc(stats.accepted_tokens)
        now = time.monotonic()
        self.latency.labels(method).observe(now - arrival)
        if time_to_first_token is not None:
            self.time_to_first_token.labels(method).observe(time_to_first_token)
            if output_tokens > 1:
                per_token = (now - arrival - time_to_first_token) / (output_tokens - 1)
                self.time_per_output_token.labels(method).observe(per_token)
        if stats.wall_time > 0:
            self.tokens_per_second.labels(method).observe(stats.tokens_per_second)
        with self._lock:
            totals = self._totals.setdefault(method, [0, 0, 0, 0])
            totals[0] += sum(stats.accept_lengths)
            totals[1] += stats.target_forwards
            totals[2] += stats.drafted_tokens
            totals[3] += stats.accepted_tokens
            committed, forwards, drafted, accepted = totals
        if forwards:
            self.mean_acceptance_length.labels(method).set(committed / forwards)
        if drafted:
            self.draft_acceptance_rate.labels(method).set(accepted / drafted)
