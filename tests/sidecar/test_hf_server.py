"""The built-in OpenAI-compatible completions server for in-process HF models."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
import torch
from aiohttp.test_utils import TestClient, TestServer
from transformers import LlamaForCausalLM

from bulletin.engines.hf_server import CompletionServer, greedy_generate
from scripts._common import llama, llama_config

CONFIG = llama_config(vocab=64, hidden=32, intermediate=64, max_positions=48, tied=False)


def _model(dtype: torch.dtype = torch.bfloat16) -> LlamaForCausalLM:
    return llama(CONFIG, 0, dtype=dtype)


async def _post(client: TestClient[Any, Any], body: Any) -> tuple[int, Any]:
    async with client.post("/v1/completions", data=json.dumps(body)) as resp:
        return resp.status, await resp.json()


def test_completion_equals_greedy_generate() -> None:
    model = _model()
    expected = greedy_generate(model, [1, 2, 3], 6, top_logprobs=2)

    async def scenario() -> None:
        async with TestClient(TestServer(CompletionServer(model, model_name="m").create_app())) as client:
            status, body = await _post(client, {"prompt": [1, 2, 3], "max_tokens": 6, "logprobs": 2})
            assert status == 200
            choice = body["choices"][0]
            assert choice["token_ids"] == expected.token_ids
            assert choice["logprobs"]["token_logprobs"] == expected.logprobs
            assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in expected.token_ids]
            assert all(len(alts) == 2 for alts in choice["logprobs"]["top_logprobs"])
            assert choice["finish_reason"] == "length" and body["model"] == "m"
            assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9}
            status, body = await _post(client, {"prompt": [[1, 2, 3], [4]], "max_tokens": 2})
            assert status == 200 and [c["index"] for c in body["choices"]] == [0, 1]
            assert body["choices"][0]["token_ids"] == expected.token_ids[:2]
            assert body["choices"][0]["logprobs"] is None
            async with client.get("/v1/models") as resp:
                assert (await resp.json())["data"][0]["id"] == "m"
            async with client.get("/health") as resp:
                assert resp.status == 200

    asyncio.run(scenario())


def test_stream_sends_each_token_then_done() -> None:
    model = _model()
    expected = greedy_generate(model, [5, 6], 5, top_logprobs=0)

    async def scenario() -> None:
        async with TestClient(TestServer(CompletionServer(model).create_app())) as client:
            body = {"prompt": [5, 6], "max_tokens": 5, "stream": True, "logprobs": 0}
            async with client.post("/v1/completions", data=json.dumps(body)) as resp:
                assert resp.headers["Content-Type"].startswith("text/event-stream")
                raw = (await resp.read()).decode()
            events = [e.removeprefix("data: ") for e in raw.split("\n\n") if e]
            assert events[-1] == "[DONE]"
            chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
            tokens = [t for c in chunks for t in c["token_ids"]]
            assert tokens == expected.token_ids
            assert [c["logprobs"]["token_logprobs"][0] for c in chunks[:-1]] == expected.logprobs
            assert chunks[-1]["finish_reason"] == "length"
            assert all(c["finish_reason"] is None for c in chunks[:-1])

    asyncio.run(scenario())


def test_stop_token_ids_end_the_completion() -> None:
    model = _model()
    free = greedy_generate(model, [1], 6)
    stop = free.token_ids[2]
    stopped = greedy_generate(model, [1], 6, stop_token_ids=[stop])
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free.token_ids[: free.token_ids.index(stop) + 1]


def test_kv_cache_matches_recomputing_the_whole_sequence() -> None:
    model = _model(torch.float32)
    cached = greedy_generate(model, [3, 1, 4], 8)
    tokens = [3, 1, 4]
    logprobs = []
    with torch.inference_mode():
        for _ in range(8):
            lp = model(input_ids=torch.tensor([tokens])).logits[0, -1].float().log_softmax(-1)
            tokens.append(int(lp.argmax()))
            logprobs.append(float(lp[tokens[-1]]))
    assert cached.token_ids == tokens[3:]
    assert cached.logprobs == pytest.approx(logprobs, abs=1e-4)


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": "hello"},
        {"prompt": ["hello", "world"]},
        {"prompt": []},
        {"prompt": [1, "2"]},
        {"prompt": [1], "temperature": 0.7},
        {"prompt": [1], "max_tokens": 0},
        {"prompt": [1], "max_tokens": True},
        {"prompt": [64]},
        {"prompt": [-1]},
        {"prompt": [1] * 40, "max_tokens": 10},
        {"prompt": [1], "logprobs": 21},
        {"prompt": [1], "n": 2},
        {"prompt": [1], "echo": True},
        {"prompt": [1], "stream": "yes"},
        {"prompt": [1], "stop_token_ids": [1.5]},
        [1, 2],
    ],
)
def test_bad_requests_are_400_with_an_openai_error(body: Any) -> None:
    async def scenario() -> None:
        async with TestClient(TestServer(CompletionServer(_model()).create_app())) as client:
            status, answer = await _post(client, body)
            assert status == 400
            assert answer["error"]["type"] == "invalid_request_error" and answer["error"]["message"]

    asyncio.run(scenario())


def test_body_that_is_not_json_is_400() -> None:
    async def scenario() -> None:
        server = TestServer(CompletionServer(_model()).create_app())
        async with TestClient(server) as client, client.post("/v1/completions", data=b"{nope") as resp:
            assert resp.status == 400

    asyncio.run(scenario())
