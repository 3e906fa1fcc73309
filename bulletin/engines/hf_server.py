"""A small OpenAI-compatible server for an in-process HF causal LM, fit for rollouts.

It is the engine the sidecar fronts when weights are patched into a live PyTorch
module (``bulletin serve --engine torch``), and the engine of the end-to-end tests:
a real model, real HTTP, real streaming. It serves:

- ``POST /v1/completions``: ``prompt`` as token ids (a list, or a list of lists) or, with
  a tokenizer, as text (a string or a list of strings);
- ``POST /v1/chat/completions`` (with a tokenizer): ``messages`` rendered by the
  tokenizer's chat template (``add_generation_prompt``);
- sampling as OpenAI and vLLM define it: ``temperature`` (0, the default, is greedy and
  bit-exact to :func:`greedy_generate`), ``top_p``, ``top_k`` (vLLM's; -1 or 0: off),
  ``seed`` (a ``torch.Generator`` per request: the same seed, the same samples), ``n``
  choices per prompt (choice ``index`` = prompt * n + sample), ``max_tokens``,
  ``stop`` (strings, matched on the decoded text, which is cut before them) and
  ``stop_token_ids``; ``logprobs`` (completions: 0-20 alternatives; chat: ``logprobs``
  and ``top_logprobs``), the model's own log-softmax (vLLM's default, raw logprobs);
  ``stream`` (server-sent events ending with ``data: [DONE]``);
- each choice carries ``token_ids`` (as vLLM does with ``return_token_ids``); without a
  tokenizer, tokens in ``logprobs`` are named ``"token_id:<id>"`` (vLLM's
  ``return_tokens_as_token_ids``);
- ``GET /v1/models`` and ``GET /health``.

Generation runs in worker threads (one at a time by default) with the model's KV cache,
one forward step at a time under a lock. :meth:`CompletionServer.preempt` (called when an
activation stops waiting for requests in flight) waits for the step under way, then ends
every generation admitted before it at its next step: streams with a final event
``{"error": {"code": "preempted"}}`` (finish reason ``abort``) before ``[DONE]``, other
requests with HTTP 503 ``preempted``. No token is computed while weights change, nor
with a mix of two versions' bits.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import secrets
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from aiohttp import web

from bulletin.engines.detokenize import IncrementalText
from bulletin.errors import InvalidInput

if TYPE_CHECKING:
    import torch

__all__ = ["Completion", "CompletionServer", "Sampling", "generate", "greedy_generate"]

#: The most alternatives ``logprobs`` may ask for (OpenAI's own cap is 5; vLLM allows 20).
MAX_LOGPROBS: Final = 20
MAX_PROMPTS: Final = 64
MAX_CHOICES: Final = 64
MAX_STOPS: Final = 16

#: Called with each token, its logprob and alternatives; False stops the generation.
OnToken = Callable[[int, float, dict[int, float]], bool]


@dataclass(slots=True)
class Completion:
    """One continuation: token ids, their logprobs, optional alternatives."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str = "length"


@dataclass(frozen=True, slots=True)
class Sampling:
    """How the next token is drawn. ``temperature`` 0 is greedy (the others are unused)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None


def _cache_keyword(model: torch.nn.Module) -> str:
    # transformers 5 renamed the KV-cache argument from `past_key_values` to `cache`.
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _sample(logprobs: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> int:
    import torch

    logits = logprobs / sampling.temperature
    if 0 < sampling.top_k < logits.numel():
        kth = torch.topk(logits, sampling.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, -1)
    if sampling.top_p < 1.0:
        ordered, order = torch.sort(probs, descending=True)
        # Keep the smallest set whose mass reaches top_p (the first token always).
        drop = torch.cumsum(ordered, -1) - ordered >= sampling.top_p
        probs = probs.scatter(0, order[drop], 0.0)
    return int(torch.multinomial(probs, 1, generator=generator).item())


def generate(
    model: torch.nn.Module,
    prompt: Sequence[int],
    max_tokens: int,
    *,
    sampling: Sampling | None = None,
    generator: torch.Generator | None = None,
    top_logprobs: int = 0,
    stop_token_ids: Sequence[int] = (),
    on_token: OnToken | None = None,
    step: Callable[[], Any] | None = None,
) -> Completion:
    """Decode up to ``max_tokens`` tokens after ``prompt`` with the KV cache.

    Greedy unless ``sampling`` has a temperature; ties in the argmax go to the lowest
    token id (``torch.argmax``), so a greedy result is a function of the model's bits and
    the prompt only. ``on_token`` sees each token as it is produced (streaming) and
    returns False to stop early (finish reason ``abort``). ``step`` returns a context
    manager held around each forward pass (the server's step lock).
    """
    import contextlib

    import torch

    keyword = _cache_keyword(model)
    device = next(iter(model.parameters())).device
    greedy = sampling is None or sampling.temperature == 0
    result = Completion()
    stops = set(stop_token_ids)
    cache: Any = None
    inputs = torch.tensor([list(prompt)], dtype=torch.long, device=device)
    with torch.inference_mode():
        for _ in range(max_tokens):
            kwargs: dict[str, Any] = {"use_cache": True}
            if cache is not None:
                kwargs[keyword] = cache
            with step() if step is not None else contextlib.nullcontext():
                out = model(input_ids=inputs, **kwargs)
            cache = out.get(keyword)
            logprobs = out.logits[0, -1].float().log_softmax(-1)
            if greedy or sampling is None:
                token = int(torch.argmax(logprobs).item())
            else:
                token = _sample(logprobs, sampling, generator)
            value = float(logprobs[token].item())
            alternatives: dict[int, float] = {}
            if top_logprobs:
                values, indices = torch.topk(logprobs, top_logprobs)
                alternatives = {int(i): float(v) for i, v in zip(indices.tolist(), values.tolist(), strict=True)}
            result.token_ids.append(token)
            result.logprobs.append(value)
            result.top_logprobs.append(alternatives)
            if on_token is not None and not on_token(token, value, alternatives):
                result.finish_reason = "abort"
                break
            if token in stops:
                result.finish_reason = "stop"
                break
            inputs = torch.tensor([[token]], dtype=torch.long, device=device)
    return result


def greedy_generate(
    model: torch.nn.Module,
    prompt: Sequence[int],
    max_tokens: int,
    *,
    top_logprobs: int = 0,
    stop_token_ids: Sequence[int] = (),
    on_token: OnToken | None = None,
) -> Completion:
    """Greedy :func:`generate`: what the server answers with ``temperature`` 0."""
    return generate(
        model, prompt, max_tokens, top_logprobs=top_logprobs, stop_token_ids=stop_token_ids, on_token=on_token
    )


class Preempted(Exception):
    """The weights are changing: a generation admitted before must end now."""


@dataclass(frozen=True, slots=True)
class _Request:
    prompts: list[list[int]]
    max_tokens: int
    logprobs: int | None
    stop_token_ids: tuple[int, ...]
    stop: tuple[str, ...]
    stream: bool
    model: str
    sampling: Sampling
    n: int
    chat: bool = False


def _int_list(value: object, what: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise InvalidInput(f"{what} must be a list of integer token ids")
    return list(value)


def _bounded(body: dict[str, Any], key: str, default: float, low: float, high: float, *, integer: bool) -> Any:
    """``body[key]`` (``default`` if absent or null), a number (an integer if ``integer``)
    in ``[low, high]``."""
    value = body.get(key, default)
    if value is None:
        return default
    kinds = int if integer else int | float
    if not isinstance(value, kinds) or isinstance(value, bool) or not low <= value <= high:
        raise InvalidInput(f"{key} must be {'an integer' if integer else 'a number'} in [{low}, {high}]")
    return value


def _number(body: dict[str, Any], key: str, default: float, low: float, high: float) -> float:
    return float(_bounded(body, key, default, low, high, integer=False))


def _integer(body: dict[str, Any], key: str, default: int, low: int, high: int) -> int:
    return int(_bounded(body, key, default, low, high, integer=True))


class CompletionServer:
    """Serves one model; ``create_app`` gives the aiohttp application.

    ``tokenizer`` (a ``transformers`` tokenizer) enables text prompts, ``stop`` strings,
    decoded ``text`` and ``/v1/chat/completions`` (its ``chat_template``).
    ``max_concurrency`` generations run at once (default 1: a CPU model is not faster
    with two, and a fixed order keeps results reproducible).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        tokenizer: Any = None,
        model_name: str = "bulletin-model",
        max_tokens_cap: int = 4096,
        max_concurrency: int = 1,
    ) -> None:
        config = getattr(model, "config", None)
        self.model = model
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.vocab_size: int | None = getattr(config, "vocab_size", None)
        self.max_positions: int | None = getattr(config, "max_position_embeddings", None)
        self.max_tokens_cap = max_tokens_cap
        self._slots = asyncio.Semaphore(max_concurrency)
        # Each forward pass holds the step lock; preempt() bumps the epoch under it.
        self._step_lock = threading.Lock()
        self._epoch = 0
        #: Preemptions waiting for the step lock: no new step starts meanwhile (the lock is
        #: not fair, so a generation could otherwise take it again and again).
        self._pending = 0
        self._pending_lock = threading.Lock()
        self.preemptions = 0

    def create_app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        return app

    def preempt(self) -> None:
        """End every generation admitted so far at its next step, and return once no
        forward pass is running: the caller may change the weights now (from any thread)."""
        with self._pending_lock:
            self._pending += 1
        try:
            with self._step_lock:
                self._epoch += 1
                self.preemptions += 1
        finally:
            with self._pending_lock:
                self._pending -= 1

    # -- handlers ------------------------------------------------------------------------

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _models(self, request: web.Request) -> web.Response:
        card = {"id": self.model_name, "object": "model", "owned_by": "bulletin"}
        return web.json_response({"object": "list", "data": [card]})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        if self.tokenizer is None:
            return _error(404, "this server has no tokenizer: /v1/chat/completions is not served")
        return await self._serve(request, chat=True)

    async def _serve(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        epoch = self._epoch  # what was admitted before a preemption is ended by it
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error(400, "request body must be JSON")
        try:
            req = self._parse(body, chat=chat)
        except InvalidInput as exc:
            return _error(400, str(exc))
        created = int(time.time())
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{secrets.token_hex(12)}"
        if req.stream:
            return await self._stream(request, req, ident, created, epoch)
        choices = []
        usage = {"prompt_tokens": 0, "completion_tokens": 0}
        try:
            async with self._slots:
                generator = self._generator(req)
                for p, prompt in enumerate(req.prompts):
                    for j in range(req.n):
                        completion = await asyncio.to_thread(self._generate, req, prompt, generator, epoch, None)
                        choices.append(self._choice(req, p * req.n + j, completion))
                        usage["prompt_tokens"] += len(prompt) if j == 0 else 0
                        usage["completion_tokens"] += len(completion.token_ids)
        except Preempted:
            return _error(
                503, "the weights changed during generation (a version was activated); retry", code="preempted"
            )
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        kind = "chat.completion" if chat else "text_completion"
        return web.json_response(
            {"id": ident, "object": kind, "created": created, "model": req.model, "choices": choices, "usage": usage}
        )

    async def _stream(
        self, request: web.Request, req: _Request, ident: str, created: int, epoch: int
    ) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        kind = "chat.completion.chunk" if req.chat else "text_completion"

        async def send(payload: dict[str, Any]) -> None:
            chunk = {"id": ident, "object": kind, "created": created, "model": req.model, **payload}
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")

        async with self._slots:
            generator = self._generator(req)
            try:
                for p, prompt in enumerate(req.prompts):
                    for j in range(req.n):
                        await self._stream_one(req, prompt, p * req.n + j, generator, epoch, send)
            except Preempted:
                await send(
                    {
                        "choices": [],
                        "error": {
                            "message": "the weights changed during generation (a version was activated)",
                            "type": "server_error",
                            "code": "preempted",
                        },
                    }
                )
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def _stream_one(
        self,
        req: _Request,
        prompt: list[int],
        index: int,
        generator: torch.Generator | None,
        epoch: int,
        send: Callable[[dict[str, Any]], Awaitable[None]],
    ) -> None:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[int, float, dict[int, float]] | None] = asyncio.Queue()
        closed = threading.Event()

        def on_token(token: int, lp: float, alts: dict[int, float]) -> bool:
            loop.call_soon_threadsafe(queue.put_nowait, (token, lp, alts))
            return not closed.is_set()  # the client went away: stop generating

        task = asyncio.ensure_future(asyncio.to_thread(self._generate, req, prompt, generator, epoch, on_token))
        task.add_done_callback(lambda _: loop.call_soon(queue.put_nowait, None))
        text = self._incremental(req)
        try:
            while (item := await queue.get()) is not None:
                token, lp, alts = item
                piece = text.add(token) if text is not None else ""
                if text is not None and text.stopped:
                    closed.set()
                delta = Completion([token], [lp], [alts], "")
                await send({"choices": [self._chunk_choice(req, index, delta, piece)]})
                if text is not None and text.stopped:
                    break
        finally:
            # Keep the slot until the model is free again, even if the client left.
            closed.set()
            completion = await task
        stopped = text is not None and text.stopped
        final = Completion(finish_reason="stop" if stopped else completion.finish_reason)
        rest = text.finish() if text is not None else ""  # what was held back for stop strings
        await send({"choices": [self._chunk_choice(req, index, final, rest)]})

    # -- generation ----------------------------------------------------------------------

    def _generator(self, req: _Request) -> torch.Generator | None:
        if req.sampling.seed is None:
            return None
        import torch

        device = next(iter(self.model.parameters())).device
        return torch.Generator(device=device).manual_seed(req.sampling.seed)

    def _generate(
        self,
        req: _Request,
        prompt: list[int],
        generator: torch.Generator | None,
        epoch: int,
        on_token: OnToken | None,
    ) -> Completion:
        text = self._incremental(req) if req.stop else None

        def step() -> Any:
            return _Step(self, epoch)

        def watch(token: int, lp: float, alts: dict[int, float]) -> bool:
            if on_token is not None and not on_token(token, lp, alts):
                return False
            if text is None:
                return True
            text.add(token)
            return not text.stopped

        completion = generate(
            self.model,
            prompt,
            req.max_tokens,
            sampling=req.sampling,
            generator=generator,
            top_logprobs=req.logprobs or 0,
            stop_token_ids=req.stop_token_ids,
            on_token=watch,
            step=step,
        )
        if text is not None and text.stopped:
            completion.finish_reason = "stop"
        return completion

    def _incremental(self, req: _Request) -> IncrementalText | None:
        """A decoder of one generation's text as it grows (linear time; None without a tokenizer)."""
        return None if self.tokenizer is None else IncrementalText(self.tokenizer, req.stop)

    def _text(self, req: _Request, tokens: list[int]) -> tuple[str, bool]:
        """The decoded text of ``tokens``, cut before the first stop string, and whether
        one was found."""
        if self.tokenizer is None:
            return "", False
        text: str = self.tokenizer.decode(tokens, skip_special_tokens=True)
        cuts = [i for i in (text.find(s) for s in req.stop) if i >= 0]
        return (text[: min(cuts)], True) if cuts else (text, False)

    # -- responses -----------------------------------------------------------------------

    def _token_name(self, token: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token}"
        name: str = self.tokenizer.decode([token])
        return name

    def _choice(self, req: _Request, index: int, completion: Completion) -> dict[str, Any]:
        text, _ = self._text(req, completion.token_ids)
        choice: dict[str, Any] = {
            "index": index,
            "token_ids": completion.token_ids,
            "logprobs": None,
            "finish_reason": completion.finish_reason,
        }
        if req.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        if req.logprobs is not None and completion.token_ids:
            choice["logprobs"] = self._logprobs(req, completion)
        return choice

    def _chunk_choice(self, req: _Request, index: int, completion: Completion, text: str) -> dict[str, Any]:
        choice: dict[str, Any] = {
            "index": index,
            "token_ids": completion.token_ids,
            "logprobs": None,
            "finish_reason": completion.finish_reason or None,
        }
        if req.chat:
            choice["delta"] = {"content": text} if completion.token_ids or text else {}
        else:
            choice["text"] = text
        if req.logprobs is not None and completion.token_ids:
            choice["logprobs"] = self._logprobs(req, completion)
        return choice

    def _logprobs(self, req: _Request, completion: Completion) -> dict[str, Any]:
        names = [self._token_name(t) for t in completion.token_ids]
        if req.chat:
            return {
                "content": [
                    {
                        "token": name,
                        "logprob": lp,
                        "top_logprobs": [{"token": self._token_name(t), "logprob": v} for t, v in alts.items()],
                    }
                    for name, lp, alts in zip(names, completion.logprobs, completion.top_logprobs, strict=True)
                ]
            }
        return {
            "tokens": names,
            "token_logprobs": completion.logprobs,
            "top_logprobs": [{self._token_name(t): v for t, v in alts.items()} for alts in completion.top_logprobs]
            if req.logprobs
            else None,
            "text_offset": [0] * len(names),
        }

    # -- parsing -------------------------------------------------------------------------

    def _parse(self, body: object, *, chat: bool) -> _Request:
        if not isinstance(body, dict):
            raise InvalidInput("request body must be a JSON object")
        prompts = self._chat_prompt(body) if chat else self._prompts(body.get("prompt"))
        max_tokens = body.get("max_tokens", body.get("max_completion_tokens", 16) if chat else 16)
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool):
            raise InvalidInput("max_tokens must be an integer")
        if not 1 <= max_tokens <= self.max_tokens_cap:
            raise InvalidInput(f"max_tokens must be in [1, {self.max_tokens_cap}]")
        sampling = Sampling(
            temperature=_number(body, "temperature", 0.0, 0.0, 100.0),
            top_p=_number(body, "top_p", 1.0, 1e-9, 1.0),
            top_k=max(0, _integer(body, "top_k", 0, -1, 1 << 30)),
            seed=None if body.get("seed") is None else _integer(body, "seed", 0, -(1 << 63), (1 << 63) - 1),
        )
        n = _integer(body, "n", 1, 1, MAX_CHOICES)
        if body.get("best_of") not in (None, n) or body.get("echo"):
            raise InvalidInput("best_of (other than n) and echo are not supported by this server")
        logprobs = self._logprobs_asked(body, chat)
        stop = body.get("stop") or []
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or len(stop) > MAX_STOPS or not all(isinstance(s, str) and s for s in stop):
            raise InvalidInput(f"stop must be a string or a list of at most {MAX_STOPS} non-empty strings")
        if stop and self.tokenizer is None:
            raise InvalidInput("stop strings need a tokenizer, which this server does not have; use stop_token_ids")
        stop_ids = _int_list(body.get("stop_token_ids") or [], "stop_token_ids")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise InvalidInput("stream must be a boolean")
        model = body.get("model", self.model_name)
        if not isinstance(model, str):
            raise InvalidInput("model must be a string")
        if len(prompts) * n > MAX_PROMPTS * 4:
            raise InvalidInput(f"at most {MAX_PROMPTS * 4} choices per request")
        for p in prompts:
            self._check_tokens(p, max_tokens)
        return _Request(prompts, max_tokens, logprobs, tuple(stop_ids), tuple(stop), stream, model, sampling, n, chat)

    def _logprobs_asked(self, body: dict[str, Any], chat: bool) -> int | None:
        if chat:
            wanted = body.get("logprobs", False)
            if not isinstance(wanted, bool):
                raise InvalidInput("logprobs must be a boolean")
            top = _integer(body, "top_logprobs", 0, 0, MAX_LOGPROBS)
            return top if wanted else None
        logprobs = body.get("logprobs")
        if logprobs is not None and (
            not isinstance(logprobs, int) or isinstance(logprobs, bool) or not 0 <= logprobs <= MAX_LOGPROBS
        ):
            raise InvalidInput(f"logprobs must be an integer in [0, {MAX_LOGPROBS}] or null")
        return logprobs

    def _prompts(self, prompt: object) -> list[list[int]]:
        texts = [prompt] if isinstance(prompt, str) else prompt
        if isinstance(texts, list) and texts and all(isinstance(p, str) for p in texts):
            if self.tokenizer is None:
                raise InvalidInput("text prompts need a tokenizer, which this server does not have; send token ids")
            prompts = [list(self.tokenizer.encode(t, add_special_tokens=True)) for t in texts]
        elif isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
            prompts = [_int_list(p, "prompt") for p in prompt]
        else:
            prompts = [_int_list(prompt, "prompt")]
        if not 1 <= len(prompts) <= MAX_PROMPTS or any(not p for p in prompts):
            raise InvalidInput(f"give 1 to {MAX_PROMPTS} non-empty prompts")
        return prompts

    def _chat_prompt(self, body: dict[str, Any]) -> list[list[int]]:
        messages = body.get("messages")
        if (
            not isinstance(messages, list)
            or not messages
            or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages
            )
        ):
            raise InvalidInput("messages must be a non-empty list of {role, content} with text content")
        try:
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except (ValueError, TypeError) as exc:  # no template, or one that refuses the messages
            raise InvalidInput(f"cannot apply the chat template: {exc}") from None
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # transformers 5 may answer a BatchEncoding
            ids = ids["input_ids"]
        prompt = _int_list(list(ids), "rendered chat")
        if not prompt:
            raise InvalidInput("the chat template rendered an empty prompt")
        return [prompt]

    def _check_tokens(self, prompt: list[int], max_tokens: int) -> None:
        if self.vocab_size is not None and any(not 0 <= t < self.vocab_size for t in prompt):
            raise InvalidInput(f"token ids must be in [0, {self.vocab_size})")
        if self.max_positions is not None and len(prompt) + max_tokens > self.max_positions:
            raise InvalidInput(
                f"prompt ({len(prompt)}) + max_tokens ({max_tokens}) exceeds the model's {self.max_positions} positions"
            )


class _Step:
    """One forward pass: under the server's step lock, refused once preempted."""

    __slots__ = ("epoch", "server")

    def __init__(self, server: CompletionServer, epoch: int) -> None:
        self.server, self.epoch = server, epoch

    def __enter__(self) -> None:
        if self.server._pending:  # a preemption is waiting for the step under way
            raise Preempted
        self.server._step_lock.acquire()
        if self.server._epoch != self.epoch or self.server._pending:
            self.server._step_lock.release()
            raise Preempted

    def __exit__(self, *exc: object) -> None:
        self.server._step_lock.release()


def _error(status: int, message: str, *, code: str | int | None = None) -> web.Response:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return web.json_response(
        {"error": {"message": message, "type": kind, "param": None, "code": status if code is None else code}},
        status=status,
    )
