"""A small OpenAI-compatible completions server for an in-process HF causal LM.

It is the engine the sidecar fronts when weights are patched into a live PyTorch
module (``bulletin serve --engine torch``), and the engine of the end-to-end tests:
a real model, real HTTP, real streaming. It serves the subset of the OpenAI
``/v1/completions`` API that rollouts with token ids use:

- ``prompt``: token ids (a list of ints, or a list of such lists for several choices);
  text prompts need a tokenizer, which this server deliberately does not carry;
- greedy decoding only (``temperature`` absent or 0), ``max_tokens``,
  ``stop_token_ids`` (as vLLM names it), ``logprobs`` (0-20 alternatives per token),
  ``stream`` (server-sent events ending with ``data: [DONE]``);
- each choice carries ``token_ids`` (as vLLM does with ``return_token_ids``) and, in
  ``logprobs``, tokens named ``"token_id:<id>"`` (vLLM's ``return_tokens_as_token_ids``).

Also ``GET /v1/models`` and ``GET /health``. Generation runs in a worker thread (one
at a time by default) with the model's KV cache; logprobs are ``log_softmax`` of the
float32 logits, so two processes running the same bits compute the same numbers.
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

from bulletin.errors import InvalidInput

if TYPE_CHECKING:
    import torch

__all__ = ["Completion", "CompletionServer", "greedy_generate"]

#: The most alternatives ``logprobs`` may ask for (OpenAI's own cap is 5; vLLM allows 20).
MAX_LOGPROBS: Final = 20
MAX_PROMPTS: Final = 64


@dataclass(slots=True)
class Completion:
    """One greedy continuation: token ids, their logprobs, optional alternatives."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str = "length"


def _cache_keyword(model: torch.nn.Module) -> str:
    # transformers 5 renamed the KV-cache argument from `past_key_values` to `cache`.
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def greedy_generate(
    model: torch.nn.Module,
    prompt: Sequence[int],
    max_tokens: int,
    *,
    top_logprobs: int = 0,
    stop_token_ids: Sequence[int] = (),
    on_token: Callable[[int, float, dict[int, float]], bool] | None = None,
) -> Completion:
    """Greedy-decode up to ``max_tokens`` tokens after ``prompt`` with the KV cache.

    Ties in the argmax go to the lowest token id (``torch.argmax``), so the result is a
    function of the model's bits and the prompt only. ``on_token`` sees each token as it
    is produced (streaming) and returns False to stop early (finish reason ``abort``).
    """
    import torch

    keyword = _cache_keyword(model)
    device = next(iter(model.parameters())).device
    result = Completion()
    stops = set(stop_token_ids)
    cache: Any = None
    inputs = torch.tensor([list(prompt)], dtype=torch.long, device=device)
    with torch.inference_mode():
        for _ in range(max_tokens):
            kwargs: dict[str, Any] = {"use_cache": True}
            if cache is not None:
                kwargs[keyword] = cache
            out = model(input_ids=inputs, **kwargs)
            cache = out.get(keyword)
            logprobs = out.logits[0, -1].float().log_softmax(-1)
            token = int(torch.argmax(logprobs).item())
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


@dataclass(frozen=True, slots=True)
class _Request:
    prompts: list[list[int]]
    max_tokens: int
    logprobs: int | None
    stop_token_ids: tuple[int, ...]
    stream: bool
    model: str


def _int_list(value: object, what: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise InvalidInput(f"{what} must be a list of integer token ids")
    return list(value)


class CompletionServer:
    """Serves one model; ``create_app`` gives the aiohttp application.

    ``max_concurrency`` generations run at once (default 1: a CPU model is not faster
    with two, and a fixed order keeps results reproducible).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        model_name: str = "bulletin-model",
        max_tokens_cap: int = 4096,
        max_concurrency: int = 1,
    ) -> None:
        config = getattr(model, "config", None)
        self.model = model
        self.model_name = model_name
        self.vocab_size: int | None = getattr(config, "vocab_size", None)
        self.max_positions: int | None = getattr(config, "max_position_embeddings", None)
        self.max_tokens_cap = max_tokens_cap
        self._slots = asyncio.Semaphore(max_concurrency)

    def create_app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        return app

    # -- handlers ------------------------------------------------------------------------

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _models(self, request: web.Request) -> web.Response:
        card = {"id": self.model_name, "object": "model", "owned_by": "bulletin"}
        return web.json_response({"object": "list", "data": [card]})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error(400, "request body must be JSON")
        try:
            req = self._parse(body)
        except InvalidInput as exc:
            return _error(400, str(exc))
        created = int(time.time())
        ident = f"cmpl-{secrets.token_hex(12)}"
        if req.stream:
            return await self._stream(request, req, ident, created)
        choices = []
        usage = {"prompt_tokens": 0, "completion_tokens": 0}
        async with self._slots:
            for index, prompt in enumerate(req.prompts):
                completion = await asyncio.to_thread(self._generate, req, prompt, None)
                choices.append(_choice(index, completion, req.logprobs))
                usage["prompt_tokens"] += len(prompt)
                usage["completion_tokens"] += len(completion.token_ids)
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        return web.json_response(
            {
                "id": ident,
                "object": "text_completion",
                "created": created,
                "model": req.model,
                "choices": choices,
                "usage": usage,
            }
        )

    async def _stream(self, request: web.Request, req: _Request, ident: str, created: int) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)

        async def send(payload: dict[str, Any]) -> None:
            await response.write(b"data: " + json.dumps(payload).encode() + b"\n\n")

        async with self._slots:
            for index, prompt in enumerate(req.prompts):
                await self._stream_one(req, prompt, index, lambda c: send(_chunk(ident, created, req.model, c)))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def _stream_one(
        self,
        req: _Request,
        prompt: list[int],
        index: int,
        send: Callable[[dict[str, Any]], Awaitable[None]],
    ) -> None:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[int, float, dict[int, float]] | None] = asyncio.Queue()
        closed = threading.Event()

        def on_token(token: int, lp: float, alts: dict[int, float]) -> bool:
            loop.call_soon_threadsafe(queue.put_nowait, (token, lp, alts))
            return not closed.is_set()  # the client went away: stop generating

        task = asyncio.ensure_future(asyncio.to_thread(self._generate, req, prompt, on_token))
        task.add_done_callback(lambda _: loop.call_soon(queue.put_nowait, None))
        try:
            while (item := await queue.get()) is not None:
                token, lp, alts = item
                chunk = _choice(index, Completion([token], [lp], [alts], ""), req.logprobs)
                chunk["finish_reason"] = None
                await send(chunk)
        finally:
            # Keep the slot until the model is free again, even if the client left.
            closed.set()
            completion = await task
        await send(_choice(index, Completion(finish_reason=completion.finish_reason), None))

    # -- helpers -------------------------------------------------------------------------

    def _generate(
        self,
        req: _Request,
        prompt: list[int],
        on_token: Callable[[int, float, dict[int, float]], bool] | None,
    ) -> Completion:
        return greedy_generate(
            self.model,
            prompt,
            req.max_tokens,
            top_logprobs=req.logprobs or 0,
            stop_token_ids=req.stop_token_ids,
            on_token=on_token,
        )

    def _parse(self, body: object) -> _Request:
        if not isinstance(body, dict):
            raise InvalidInput("request body must be a JSON object")
        prompt = body.get("prompt")
        if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt)):
            raise InvalidInput("this server takes token ids as prompt; it has no tokenizer")
        if isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
            prompts = [_int_list(p, "prompt") for p in prompt]
        else:
            prompts = [_int_list(prompt, "prompt")]
        if not 1 <= len(prompts) <= MAX_PROMPTS or any(not p for p in prompts):
            raise InvalidInput(f"give 1 to {MAX_PROMPTS} non-empty prompts")
        max_tokens = body.get("max_tokens", 16)
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool):
            raise InvalidInput("max_tokens must be an integer")
        if not 1 <= max_tokens <= self.max_tokens_cap:
            raise InvalidInput(f"max_tokens must be in [1, {self.max_tokens_cap}]")
        temperature = body.get("temperature", 0)
        if not isinstance(temperature, int | float) or isinstance(temperature, bool) or temperature:
            raise InvalidInput("only greedy decoding is served: temperature must be 0")
        for key, default in (("n", 1), ("best_of", 1), ("echo", False)):
            if body.get(key, default) not in (default, None):
                raise InvalidInput(f"{key} is not supported by this server")
        logprobs = body.get("logprobs")
        if logprobs is not None and (
            not isinstance(logprobs, int) or isinstance(logprobs, bool) or not 0 <= logprobs <= MAX_LOGPROBS
        ):
            raise InvalidInput(f"logprobs must be an integer in [0, {MAX_LOGPROBS}] or null")
        stops = body.get("stop_token_ids") or []
        stop_ids = _int_list(stops, "stop_token_ids")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise InvalidInput("stream must be a boolean")
        model = body.get("model", self.model_name)
        if not isinstance(model, str):
            raise InvalidInput("model must be a string")
        for p in prompts:
            self._check_tokens(p, max_tokens)
        return _Request(prompts, max_tokens, logprobs, tuple(stop_ids), stream, model)

    def _check_tokens(self, prompt: list[int], max_tokens: int) -> None:
        if self.vocab_size is not None and any(not 0 <= t < self.vocab_size for t in prompt):
            raise InvalidInput(f"token ids must be in [0, {self.vocab_size})")
        if self.max_positions is not None and len(prompt) + max_tokens > self.max_positions:
            raise InvalidInput(
                f"prompt ({len(prompt)}) + max_tokens ({max_tokens}) exceeds the model's {self.max_positions} positions"
            )


def _token_name(token: int) -> str:
    return f"token_id:{token}"


def _choice(index: int, completion: Completion, logprobs: int | None) -> dict[str, Any]:
    choice: dict[str, Any] = {
        "index": index,
        "text": "",
        "token_ids": completion.token_ids,
        "logprobs": None,
        "finish_reason": completion.finish_reason,
    }
    if logprobs is not None and completion.token_ids:
        choice["logprobs"] = {
            "tokens": [_token_name(t) for t in completion.token_ids],
            "token_logprobs": completion.logprobs,
            "top_logprobs": [{_token_name(t): v for t, v in alts.items()} for alts in completion.top_logprobs]
            if logprobs
            else None,
            "text_offset": [0] * len(completion.token_ids),
        }
    return choice


def _chunk(ident: str, created: int, model: str, choice: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": ident,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
    }


def _error(status: int, message: str) -> web.Response:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return web.json_response(
        {"error": {"message": message, "type": kind, "param": None, "code": status}}, status=status
    )
