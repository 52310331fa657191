"""The OpenAI wire format: request bodies (unknown fields refused), error bodies, response and chunk objects."""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from speculum.stats import Stats

# Method parameters that name files on the server's disk: a client may not make the server read or
# write a file of its choosing, so these are set on the command line only (speculum serve --param).
SERVER_ONLY_PARAMS = frozenset({"pool_path", "acceptance_head", "heads"})


def names_a_file(name: str, value) -> bool:
    """Whether a method parameter names a file: one of SERVER_ONLY_PARAMS, or a value that looks like a path."""
    looks_like_path = isinstance(value, str) and ("/" in value or "\\" in value or value.startswith(("~", ".")))
    return name in SERVER_ONLY_PARAMS or name.endswith(("_path", "_dir", "_file")) or looks_like_path


class ApiError(Exception):
    """An error answered with OpenAI's error body: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def timeout_error(seconds: float) -> ApiError:
    return ApiError(
        504,
        f"the request ran past the server's time limit of {seconds:g} s (speculum serve --request-timeout)",
        type="timeout_error",
        code="timeout",
    )


# ---------------------------------------------------------------------------------------- requests


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# Stop strings are searched for after every step on the worker thread all requests share, and text
# that may begin one is held back from the stream: both bounded (OpenAI allows 4 strings too).
MAX_STOP_STRINGS = 4
MAX_STOP_LENGTH = 256  # characters
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_LENGTH)]


class StreamOptions(Strict):
    include_usage: bool = False


class SamplingFields(Strict):
    """What completions and chat completions share: sampling, length, stop strings, the method."""

    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    # 0 = greedy, speculum's default (OpenAI's is 1.0): the output then equals plain greedy decoding
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 0.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(ge=-1)] = 0  # vLLM's extension; -1 or 0 = no top-k filter
    # a seeded sample is the text plain sampling gives with that seed, whatever the method drafts
    seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Literal[1] = 1  # one choice per request
    user: str | None = None
    # speculum's extension: {"method": "anpd", "num_speculative_tokens": 5, ...}; absent = the server's method
    speculative_config: dict[str, Any] | None = None

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(SamplingFields):
    prompt: str | list[StrictInt] | Annotated[list[str], Field(min_length=1, max_length=1)]


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None  # OpenAI's newer name for max_tokens


# ---------------------------------------------------------------------------------------- responses


def speculation_stats(method: str, stats: Stats, *, time_to_first_token: float | None, queue_time: float) -> dict:
    """The request's speculation statistics, by vLLM's names where they exist."""
    return {
        "method": method,
        "num_spec_steps": stats.target_forwards,
        "num_draft_tokens": stats.drafted_tokens,
        "num_accepted_tokens": stats.accepted_tokens,
        "mean_acceptance_length": round(stats.mean_acceptance_length, 4),
        "draft_acceptance_rate": round(stats.draft_acceptance_rate, 4),
        "acceptance_rate_per_position": [round(a, 4) for a in stats.acceptance_per_position],
        "num_draft_forwards": stats.draft_forwards,
        "tokens_per_second": round(stats.tokens_per_second, 3),
        "time_to_first_token": None if time_to_first_token is None else round(time_to_first_token, 4),
        "queue_time": round(queue_time, 4),
        "generation_time": round(stats.wall_time, 4),
        **({"accepted_by": dict(stats.accepted_by)} if stats.accepted_by else {}),
        **(
            {
                "rounds_drafted": stats.rounds_drafted,
                "rounds_plain": stats.rounds_plain,
                "nodes_pruned": stats.nodes_pruned,
                "rounds_explored": stats.rounds_explored,
                "chains_stopped": stats.chains_stopped,
            }
            if stats.rounds_drafted or stats.rounds_plain
            else {}
        ),
    }


class Formatter:
    """Builds the objects of one response: completion or chat, whole or as stream chunks."""

    def __init__(self, chat: bool, model: str):
        self.chat = chat
        self.model = model
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _envelope(self, object_: str, choices: list[dict], **extra: Any) -> dict:
        return {"id": self.id, "object": object_, "created": self.created, "model": self.model, "choices": choices} | {
            k: v for k, v in extra.items() if v is not None
        }

    def response(self, text: str, finish_reason: str, usage: dict, speculation: dict) -> dict:
        if self.chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
            return self._envelope("chat.completion", [choice], usage=usage, speculation=speculation)
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return self._envelope("text_completion", [choice], usage=usage, speculation=speculation)

    def chunk(self, text: str | None, finish_reason: str | None = None, *, role: bool = False, **extra: Any) -> dict:
        """One stream chunk; ``extra`` (speculation, usage) rides beside OpenAI's fields."""
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            return self._envelope("chat.completion.chunk", [choice], **extra)
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        return self._envelope("text_completion", [choice], **extra)

    def usage_chunk(self, usage: dict) -> dict:
        """The last chunk when the client asked for stream_options.include_usage: no choices, the usage."""
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [], usage=usage)
