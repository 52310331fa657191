"""The public surface: ``load()`` a target (and optionally a draft), then ``generate()``."""

from __future__ import annotations

import secrets
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from speculum import accel, engine, models, row_padding
from speculum import exact as exact_mode
from speculum.controller import Controller
from speculum.costs import CostModel, measured_cost_model
from speculum.drafters.base import Resources
from speculum.errors import InvalidInputError
from speculum.exact import ExactChoice
from speculum.methods import DEFAULT_METHOD, SpeculativeConfig
from speculum.runner import ModelRunner
from speculum.sampling import PositionNoise, SamplingParams
from speculum.stats import Stats

Prompt = str | list[dict] | list[int]


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]  # new tokens only
    prompt_ids: list[int]
    stats: Stats
    method: str = ""


@dataclass
class StreamChunk:
    text: str  # the new text since the previous chunk
    token_ids: list[int]  # the tokens committed in this step
    # how many of token_ids (the first ones) are accepted draft tokens; the rest is the target's own token
    num_draft_tokens: int = 0


@dataclass
class GenerationStream:
    """Iterate for text chunks as tokens are accepted; ``result`` is set once the stream ends."""

    _chunks: Iterator[StreamChunk]
    result: GenerationResult | None = field(default=None)

    def __iter__(self) -> Iterator[StreamChunk]:
        return self._chunks


class Speculum:
    """A loaded target model (and optional draft) ready to generate with any method."""

    def __init__(self, model, tokenizer, draft_model=None, draft_tokenizer=None, *, name: str = "", draft_name=None):
        self.model = model
        self.tokenizer = tokenizer
        self.draft_model = draft_model
        self.draft_tokenizer = draft_tokenizer
        self.name = name
        self.draft_name = draft_name
        self.runner = ModelRunner(model)
        # set by load(): the dtype and why, whether small forwards are padded (speculum.accel), and
        # whether the target runs in exact mode (speculum.exact)
        self.dtype_choice = self.row_padding = self.draft_row_padding = self.exact = None
        self.quantization = self.quantization_choice = None  # quantization="gguf": what was swapped, and why
        self._drafters: dict[tuple, list] = {}  # configuration -> its drafters (one per row of a batch)
        self._shared: dict = {}  # pools shared by all drafters (and requests) of this Speculum
        # True: each configuration keeps its own pools (benchmarks comparing configurations on the same
        # prompts need this: a second Ouroboros setting would otherwise reuse the first one's phrases)
        self.pools_per_config = False
        self._shared_uses: dict[tuple, set] = {}  # drafter key -> the keys of _shared that drafter used
        self._controllers: dict[tuple, Controller] = {}  # (drafter key, sampled) -> its controller (what it learned)
        self._cost_model: CostModel | None = None
        self._vocab_key: str | None = None
        self.eos_token_ids = models.eos_token_ids(model, tokenizer)
        # what generate() runs when no method is named: load(config=...) sets it
        self.default_config = SpeculativeConfig(DEFAULT_METHOD)

    @property
    def vocab_size(self) -> int:
        return accel.output_size(self.model)

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt: raw text, chat messages (chat template applied) or ids as they are."""
        ids = self._encode(prompt)
        if not ids:  # e.g. text the tokenizer drops entirely: the engine needs at least one token
            raise InvalidInputError("the prompt encodes to no tokens")
        return ids

    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt.strip():
                raise InvalidInputError("the prompt is empty")
            return list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])
        if isinstance(prompt, list) and not prompt:
            raise InvalidInputError("the prompt is empty")
        if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
            if not getattr(self.tokenizer, "chat_template", None):
                raise InvalidInputError("this model's tokenizer has no chat template; pass the prompt as text")
            for message in prompt:
                if "role" not in message or "content" not in message:
                    raise InvalidInputError("each chat message needs a 'role' and a 'content'")
            text = self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            if min(prompt) < 0 or max(prompt) >= self.vocab_size:
                raise InvalidInputError(f"token ids must be in [0, {self.vocab_size})")
            return list(prompt)
        raise InvalidInputError("the prompt must be non-empty text, a list of chat messages, or a list of token ids")

    @property
    def vocab_key(self) -> str:
        """Identifies the tokenizer's vocabulary: saved n-gram/phrase pools are only reused under the same one."""
        if self._vocab_key is None:
            self._vocab_key = models.vocab_fingerprint(self.tokenizer) if self.tokenizer is not None else self.name
        return self._vocab_key

    def drafter_for(self, config: SpeculativeConfig, sampled: bool = False):
        """Drafters are built once per configuration and reused (their per-request state resets in start())."""
        return self.drafters_for(config, 1, sampled)[0]

    def drafters_for(self, config: SpeculativeConfig, rows: int, sampled: bool = False) -> list:
        """``rows`` drafters of ``config``, one per row of a batch (each keeps its own request's
        state; pools such as Ouroboros' phrases are shared between them). Built once and reused.

        ``sampled``: for sampled requests, whose drafters are others where the device's measured
        setting differs for them (``SAMPLED_MACHINE_DEFAULTS``); they share the greedy drafters' pools."""
        key = config.key()
        options = config.options(self.device_type, sampled)
        own = (key, "sampled") if sampled and options != config.options(self.device_type) else key
        built = self._drafters.setdefault(own, [])
        if key not in self._shared_uses:
            self._shared_uses[key] = set()
        namespace = key if self.pools_per_config else None
        resources = replace(self.resources(), shared=_SharedView(self._shared, self._shared_uses[key], namespace))
        try:
            while len(built) < rows:
                built.append(config.drafter_class()(options, resources))
        except BaseException:
            if not built:
                del self._drafters[own]
                if key not in self._drafters and (key, "sampled") not in self._drafters:
                    del self._shared_uses[key]
            raise
        return built[:rows]

    def built_drafters(self) -> list:
        """One drafter per configuration built so far (the rows' drafters of a configuration share
        its pools, so this one stands for them all)."""
        return [built[0] for built in self._drafters.values() if built]

    @property
    def device_type(self) -> str:
        """Where the target computes ("cpu", "cuda", ...): which measured defaults apply."""
        return torch.device(self.runner.output_device).type

    def forget(self, config: str | SpeculativeConfig) -> None:
        """Drop the drafter built for ``config``, and the shared objects (e.g. Ouroboros' phrase pool)
        that no remaining drafter of ``drafter_for`` uses: a long-running server that keeps only its
        recent configurations bounds their pools this way too. The next use of ``config`` starts afresh."""
        key = SpeculativeConfig.coerce(config).key()
        self._drafters.pop(key, None)
        self._drafters.pop((key, "sampled"), None)
        for sampled in (False, True):
            self._controllers.pop((key, sampled), None)
        self._shared_uses.pop(key, None)
        in_use = set().union(*self._shared_uses.values())
        for name in [name for name in self._shared if name not in in_use]:
            del self._shared[name]

    @property
    def cost_model(self) -> CostModel:
        """What a verification forward of n tree nodes costs the target on this machine: measured once
        (a few seconds, cached on disk for this model, dtype, device, threads and CPU), then refined
        by every forward the controller sees."""
        if self._cost_model is None:
            self._cost_model = measured_cost_model(self.runner)
        return self._cost_model

    @cost_model.setter
    def cost_model(self, model: CostModel) -> None:
        self._cost_model = model

    def controller_for(self, config: SpeculativeConfig, sampled: bool = False) -> Controller:
        """The controller of ``config``'s drafter for greedy or sampled requests (kept, with what it
        learned, across requests; sampled requests carry its back-off over too)."""
        key = (config.key(), sampled)
        if key not in self._controllers:
            self._controllers[key] = Controller(self.cost_model, carry_backoff=sampled)
        return self._controllers[key]

    def resources(self) -> Resources:
        """What drafters may use: the target (LM head, embeddings), the draft model, the tokenizer..."""
        return Resources(
            target=self.model,
            draft_model=self.draft_model,
            tokenizer=self.tokenizer,
            vocab_size=self.vocab_size,
            model_key=self.vocab_key,
            device=self.runner.output_device,
            shared=self._shared,
        )

    def generate(
        self,
        prompt: Prompt | list[Prompt],
        method: str | SpeculativeConfig | None = None,
        *,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stream: bool = False,
        **method_params: Any,
    ) -> GenerationResult | GenerationStream | list[GenerationResult] | BatchStream:
        """Generate from one prompt, or from a list of prompts decoded together in one batch (one
        result each, in order; a stream then yields ``(index, chunk)``). In float32 every prompt of a
        batch gives what it would give alone, seed included (``seed`` seeds each row as it would
        seed that prompt's own request); in bfloat16 a row can part from it at a near-tie of the
        two best tokens, since a forward over several rows rounds differently."""
        config = SpeculativeConfig.coerce(self.default_config if method is None else method, **method_params)
        batched = _is_batch(prompt)
        prompts = [self.encode_prompt(p) for p in (prompt if batched else [prompt])]
        sampled = not SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k).greedy  # (checked here)
        drafters = self.drafters_for(config, len(prompts), sampled)
        requests = [
            self.request(ids, config, drafter, max_new_tokens=max_new_tokens, temperature=temperature,
                         top_p=top_p, top_k=top_k, seed=seed, own_controller=batched)
            for ids, drafter in zip(prompts, drafters, strict=True)
        ]  # fmt: skip
        if batched:
            return self._generate_batch(requests, config.method, stream)
        request = requests[0]
        steps = engine.run(
            self.runner, request.prompt_ids, request.drafter, request.sampling, request.max_new_tokens,
            self.eos_token_ids, request.generator, request.stats, request.controller, request.noise,
        )  # fmt: skip
        if not stream:
            new_ids = [token for step in steps for token in step]
            return GenerationResult(self.decode(new_ids), new_ids, request.prompt_ids, request.stats, config.method)
        holder = GenerationStream(iter(()))
        holder._chunks = self._stream(steps, request.prompt_ids, request.stats, config.method, holder)
        return holder

    def request(
        self,
        prompt_ids: list[int],
        config: SpeculativeConfig,
        drafter,
        *,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        own_controller: bool = False,
    ) -> engine.Request:
        """What the engine runs for one prompt (a row of a batch or a request alone): its sampling,
        generator and controller. ``drafter``: one of ``drafters_for(config, ...)`` that no other
        row in flight uses; ``own_controller``: the row runs beside others in a batch, with a
        controller of its own (sharing what the configuration's has learned) instead of the
        configuration's."""
        sampling = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise InvalidInputError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
            raise InvalidInputError(f"seed must be a non-negative integer, got {seed!r}")
        controller = None
        if config.controlled():
            controller = self.controller_for(config, not sampling.greedy)
            controller = controller.for_row() if own_controller else controller
        generator = self._generator(sampling, seed)
        # a seed gives the same text again, whatever is drafted: sampled by noise fixed per position
        # (also without a seed where the drafter's drafts are accepted more often that way)
        by_noise = seed is not None or getattr(drafter, "samples_by_noise", False)
        noise = PositionNoise(generator) if by_noise and generator is not None else None
        return engine.Request(
            list(prompt_ids), drafter, sampling, max_new_tokens, self.eos_token_ids,
            generator, Stats(), controller, noise,
        )  # fmt: skip

    def _generator(self, sampling: SamplingParams, seed: int | None) -> torch.Generator | None:
        """One generator per request, on the device where sampling happens (where the target's
        logits are); without a seed, fresh entropy that leaves torch's global RNG alone."""
        if sampling.greedy:
            return None
        generator = torch.Generator(device=self.runner.output_device)
        generator.manual_seed(seed if seed is not None else secrets.randbits(63))
        return generator

    def _generate_batch(
        self, requests: list[engine.Request], method: str, stream: bool
    ) -> list[GenerationResult] | BatchStream:
        steps = engine.run_batch(self.runner, requests)
        if not stream:
            outputs: list[list[int]] = [[] for _ in requests]
            for row, new in steps:
                outputs[row].extend(new)
            return [
                GenerationResult(self.decode(ids), ids, r.prompt_ids, r.stats, method)
                for ids, r in zip(outputs, requests, strict=True)
            ]
        holder = BatchStream(iter(()), [None] * len(requests))
        holder._chunks = self._stream_batch(steps, requests, method, holder)
        return holder

    def _stream_batch(self, steps, requests, method: str, holder: BatchStream) -> Iterator[tuple[int, StreamChunk]]:
        outputs: list[list[int]] = [[] for _ in requests]
        texts = [IncrementalText(self.decode) for _ in requests]
        accepted = [0] * len(requests)

        def result(row: int) -> GenerationResult:
            request = requests[row]
            return GenerationResult(self.decode(outputs[row]), outputs[row], request.prompt_ids, request.stats, method)

        try:
            for row, step in steps:
                outputs[row].extend(step)
                stats = requests[row].stats
                drafted = min(len(step), stats.accepted_tokens - accepted[row])
                accepted[row] = stats.accepted_tokens
                yield row, StreamChunk(texts[row].add(outputs[row]), step, drafted)
                if stats.stop_reason:  # the row has finished (and left the batch)
                    holder.results[row] = result(row)
                    tail = texts[row].finish(holder.results[row].text)
                    if tail:
                        yield row, StreamChunk(tail, [])
        except GeneratorExit:  # the reader closed the stream: every row ends now, with what it produced
            steps.close()
            for row in range(len(requests)):
                holder.results[row] = holder.results[row] or result(row)
            raise

    def _stream(self, steps, prompt_ids, stats, method, holder: GenerationStream) -> Iterator[StreamChunk]:
        new_ids: list[int] = []
        text = IncrementalText(self.decode)
        accepted = 0  # stats.accepted_tokens before this step
        try:
            for step in steps:
                new_ids.extend(step)
                # a step commits the accepted draft tokens first, then the target's one (cut at EOS/length)
                drafted = min(len(step), stats.accepted_tokens - accepted)
                accepted = stats.accepted_tokens
                yield StreamChunk(text.add(new_ids), step, drafted)
        except GeneratorExit:  # the reader closed the stream: end the request now, keep what it produced
            steps.close()
            holder.result = GenerationResult(self.decode(new_ids), new_ids, prompt_ids, stats, method)
            raise
        full = self.decode(new_ids)
        tail = text.finish(full)
        if tail:
            yield StreamChunk(tail, [])
        holder.result = GenerationResult(full, new_ids, prompt_ids, stats, method)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)


@dataclass
class BatchStream:
    """Iterate for ``(index of the prompt, chunk)`` as each row's tokens are accepted; ``results[i]``
    is set once row i ends."""

    _chunks: Iterator[tuple[int, StreamChunk]]
    results: list[GenerationResult | None]

    def __iter__(self) -> Iterator[tuple[int, StreamChunk]]:
        return self._chunks


def _is_batch(prompt) -> bool:
    """A list of prompts (texts, chat message lists or token id lists), not one prompt."""
    return isinstance(prompt, list) and bool(prompt) and all(isinstance(p, (str, list)) for p in prompt)


class _SharedView(MutableMapping):
    """``Speculum._shared`` as one drafter sees it: records the keys the drafter reads or sets, so that
    ``Speculum.forget`` knows which shared objects are still in use."""

    def __init__(self, shared: dict, used: set, namespace: tuple | None = None):
        self._shared = shared
        self._used = used
        self._namespace = namespace  # set: this drafter's own pools, apart from other configurations'

    def _key(self, key):
        return key if self._namespace is None else (self._namespace, key)

    def __getitem__(self, key):
        self._used.add(self._key(key))
        return self._shared[self._key(key)]

    def __setitem__(self, key, value) -> None:
        self._used.add(self._key(key))
        self._shared[self._key(key)] = value

    def __delitem__(self, key) -> None:
        del self._shared[self._key(key)]

    def __iter__(self):
        if self._namespace is None:
            return iter(self._shared)
        return (k[1] for k in self._shared if isinstance(k, tuple) and len(k) == 2 and k[0] == self._namespace)

    def __len__(self) -> int:
        return sum(1 for _ in self)


class IncrementalText:
    """Text deltas of a growing token list, decoding only a short window each time (not the whole output).

    As in vLLM / TGI: decode the tokens from ``prefix`` (a few tokens back, so that tokenizers that
    drop a leading space see the context) to the end, and emit what goes beyond the text of the same
    window up to ``read``. An incomplete multi-byte character is held back until it completes.
    """

    def __init__(self, decode):
        self.decode = decode
        self.prefix = 0  # the window starts here
        self.read = 0  # tokens already turned into emitted text
        self.emitted: list[str] = []

    def add(self, ids: list[int]) -> str:
        before = self.decode(ids[self.prefix : self.read])
        after = self.decode(ids[self.prefix :])
        if len(after) <= len(before) or after.endswith("\ufffd") or not after.startswith(before):
            return ""
        self.prefix, self.read = self.read, len(ids)
        delta = after[len(before) :]
        self.emitted.append(delta)
        return delta

    def finish(self, full: str) -> str:
        """What is still missing from ``full`` (the whole output decoded once) after the deltas."""
        shown = "".join(self.emitted)
        return full[len(shown) :] if full.startswith(shown) else ""


def _load_draft(draft: str, dtype, device: str, quantization: str):
    """The draft model: on its GGUF file's own blocks too where the target is and the draft is a GGUF
    (a draft that is not one stays as it is)."""
    try:
        model, tokenizer, _ = models.load_with_dtype_choice(
            draft, dtype=dtype, device=device, quantization=quantization
        )
    except InvalidInputError as error:
        if quantization == "none" or "needs a GGUF file" not in str(error):
            raise
        model, tokenizer, _ = models.load_with_dtype_choice(draft, dtype=dtype, device=device)
    return model, tokenizer


def load(
    model: str | None = None,
    draft: str | None = None,
    *,
    dtype: str | torch.dtype = "auto",
    device: str = "cpu",
    draft_device: str | None = None,
    device_map: str | dict | None = None,
    offload_folder: str | None = None,
    gguf_file: str | None = None,
    prepack: bool | str = "auto",
    config: str | SpeculativeConfig | None = None,
    exact: bool | str = "auto",
    quantization: str = "auto",
) -> Speculum:
    """Load a target model (packaged alias, hub id, local directory or .gguf) and an optional draft.

    ``draft`` is another model (same tokenizer) or ``"self:N"``: the target's own first N layers
    with its final norm and LM head (no extra weights). ``draft_device`` puts the draft elsewhere.
    ``device_map`` (accelerate's: ``"auto"`` or a dict of module -> device, with ``offload_folder``
    for ``"disk"``) splits a big target over several devices; the draft goes on ``draft_device``.
    ``prepack`` ("auto": where supported, i.e. float32 on CPU, and bfloat16 on a CPU that computes it
    natively) reorders linear weights once for oneDNN, which makes verifying a few tokens cost about
    one decode step, and makes a bfloat16 step cheaper too (see ``speculum.accel``).
    ``config``: a method config (or the path of a config file from ``speculum tune --out``) that
    ``generate()`` then uses when no method is named; ``model`` and ``draft`` default to the ones
    the file names.
    ``dtype="auto"`` on a CPU times prepacked float32 against (prepacked) bfloat16 on the target's shapes (once per
    machine and model, cached; float32 where the CPU has no native bfloat16) and a draft model takes
    the same dtype; ``spec.dtype_choice`` (a ``speculum.models.DtypeChoice``) says what was chosen and why.
    Prepacked models' one- and two-token forwards are padded to 4 rows where that measures faster
    (``spec.row_padding``, ``spec.draft_row_padding``: see ``speculum.row_padding.choose_row_padding``).
    ``exact`` (True, False, "auto": on in bfloat16 and float16) runs the target so that its greedy output and a
    seeded sampled text do not depend on what was drafted or on the other rows of a batch: attention per query,
    linear layers measured for row-count invariance (``spec.exact``, a ``speculum.exact.ExactChoice``, says what
    was done; see docs/exactness.md).
    ``quantization`` ("auto", "none" or "gguf", vLLM's name): "gguf" computes the linear layers of a GGUF
    model (and its draft's) on the file's own quantized blocks, on speculum's quantized CPU kernel, the rest
    of the model in ``dtype`` (auto: float32); "none" de-quantizes them; "auto" measures which of the two
    decodes faster on this CPU (cached). ``spec.quantization`` says what was quantized (None: nothing),
    ``spec.quantization_choice`` why "auto" chose.
    """
    if config is not None:
        config = SpeculativeConfig.coerce(config)
        model = model or config.metadata.get("model")
        draft = draft or config.metadata.get("draft")
    exact_mode.wants_exact(exact, torch.float32)  # a bad value fails before the model loads
    if prepack not in (True, False, "auto"):
        raise InvalidInputError(f"prepack must be True, False or 'auto', got {prepack!r}")
    models.check_quantization(quantization, device)
    name = model or models.DEFAULT_MODEL
    target, tokenizer, dtype_choice = models.load_with_dtype_choice(
        name,
        dtype=dtype,
        device=device,
        gguf_file=gguf_file,
        device_map=device_map,
        offload_folder=offload_folder,
        prepack=bool(prepack),
        exact=exact,
        quantization=quantization,
    )
    if prepack:
        accel.prepack(target)  # before building a self-draft, which then shares the packed layers
    draft_model = draft_tokenizer = self_layers = None
    if draft:
        self_layers = models.parse_draft_spec(draft)
        if self_layers is not None:
            draft_model, draft_tokenizer = models.make_self_draft(target, self_layers), tokenizer
        else:
            draft_device = draft_device or (device if device_map is None else "cpu")
            # "auto" on a CPU: the draft takes the dtype measured for the target (the pair shares one dtype)
            same_cpu = dtype_choice.requested == "auto" and str(device) == str(draft_device) == "cpu"
            draft_dtype = dtype_choice.dtype if same_cpu else dtype
            draft_model, draft_tokenizer = _load_draft(draft, draft_dtype, draft_device, quantization)
            models.check_draft_compatible(target, tokenizer, draft_model, draft_tokenizer)
            if prepack:
                accel.prepack(draft_model)
    spec = Speculum(target, tokenizer, draft_model, draft_tokenizer, name=name, draft_name=draft)
    spec.dtype_choice = dtype_choice  # the target's dtype and why (dtype="auto" measures on a CPU)
    spec.quantization = target.speculum_quantization  # what quantization="gguf" swapped (None: nothing)
    spec.quantization_choice = target.speculum_quantization_choice  # why, where quantization="auto" chose
    if prepack:  # small forwards padded where a kernel for more rows is faster (measured once, cached)
        spec.row_padding = row_padding.choose_row_padding(spec.runner)
        if draft_model is not None and self_layers is None:  # a self-draft shares the target's layers
            spec.draft_row_padding = row_padding.choose_row_padding(ModelRunner(draft_model))
    # after row padding, which changes the kernels of small forwards that exact mode measures
    exact_on, exact_reason = exact_mode.wants_exact(exact, dtype_choice.dtype, spec.quantization is not None)
    spec.exact = exact_mode.make_exact(target, exact_reason) if exact_on else ExactChoice(False, exact_reason)
    if config is not None:
        spec.default_config = config
    return spec
