"""The built-in OpenAI-compatible completions server for in-process HF models."""

from __future__ import annotations

import asyncio
import functools
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
        {"prompt": [1], "temperature": -1},
        {"prompt": [1], "top_p": 0},
        {"prompt": [1], "n": 0},
        {"prompt": [1], "stop": "x"},
        {"prompt": [1], "best_of": 3},
        {"prompt": [1], "max_tokens": 0},
        {"prompt": [1], "max_tokens": True},
        {"prompt": [64]},
        {"prompt": [-1]},
        {"prompt": [1] * 40, "max_tokens": 10},
        {"prompt": [1], "logprobs": 21},
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


# -- rollouts: sampling, text, chat, preemption ------------------------------------------

WORDS = ["<unk>", "<s>", "</s>", "user", "assistant", "system"] + [f"w{i}" for i in range(58)]
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant{% endif %}"
)


def _tokenizer() -> Any:
    """A real (tiny) word-level tokenizer with a real chat template, built offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = TEMPLATE
    return fast


def _run(server: CompletionServer, path: str, body: Any) -> tuple[int, Any]:
    async def scenario() -> tuple[int, Any]:
        async with (
            TestClient(TestServer(server.create_app())) as client,
            client.post(path, data=json.dumps(body)) as resp,
        ):
            return resp.status, await resp.json()

    return asyncio.run(scenario())


def test_sampling_is_seeded_and_greedy_at_temperature_zero() -> None:
    server = CompletionServer(_model())
    greedy = greedy_generate(server.model, [1, 2, 3], 8)
    body = {"prompt": [1, 2, 3], "max_tokens": 8, "temperature": 1.5, "top_p": 0.9, "top_k": 20, "seed": 7, "n": 3}
    _, one = _run(server, "/v1/completions", body)
    _, two = _run(server, "/v1/completions", body)
    samples = [c["token_ids"] for c in one["choices"]]
    assert [c["index"] for c in one["choices"]] == [0, 1, 2]
    assert samples == [c["token_ids"] for c in two["choices"]]  # same seed, same samples
    assert len({tuple(t) for t in samples}) > 1 and any(t != greedy.token_ids for t in samples)
    _, other = _run(server, "/v1/completions", {**body, "seed": 8})
    assert [c["token_ids"] for c in other["choices"]] != samples
    _, zero = _run(server, "/v1/completions", {**body, "temperature": 0, "logprobs": 0})
    for choice in zero["choices"]:  # temperature 0: greedy, bit-exact, whatever else is asked
        assert choice["token_ids"] == greedy.token_ids
        assert choice["logprobs"]["token_logprobs"] == greedy.logprobs
    _, top1 = _run(server, "/v1/completions", {**body, "top_k": 1, "n": 1})
    assert top1["choices"][0]["token_ids"] == greedy.token_ids  # top_k 1 leaves only the argmax


def test_text_prompts_stop_strings_and_chat_use_the_tokenizer() -> None:
    tokenizer = _tokenizer()
    server = CompletionServer(_model(), tokenizer=tokenizer)
    prompt = "w1 w2 w3"
    ids = tokenizer.encode(prompt)
    free = greedy_generate(server.model, ids, 8)
    status, body = _run(server, "/v1/completions", {"prompt": prompt, "max_tokens": 8})
    assert status == 200 and body["choices"][0]["token_ids"] == free.token_ids
    assert body["choices"][0]["text"] == tokenizer.decode(free.token_ids, skip_special_tokens=True)
    words = tokenizer.decode(free.token_ids, skip_special_tokens=True).split()
    stop = words[2]
    _, cut = _run(server, "/v1/completions", {"prompt": prompt, "max_tokens": 8, "stop": [stop]})
    choice = cut["choices"][0]
    assert choice["finish_reason"] == "stop" and stop not in choice["text"]
    assert choice["text"] == tokenizer.decode(free.token_ids, skip_special_tokens=True).split(stop)[0]
    messages = [{"role": "system", "content": "w9"}, {"role": "user", "content": "w4 w5"}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    rendered = list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
    assert rendered[0] == tokenizer.bos_token_id and rendered[-1] == WORDS.index("assistant")
    expected = greedy_generate(server.model, rendered, 5, top_logprobs=2)
    chat = {"messages": messages, "max_tokens": 5, "logprobs": True, "top_logprobs": 2}
    status, answer = _run(server, "/v1/chat/completions", chat)
    assert status == 200 and answer["object"] == "chat.completion"
    reply = answer["choices"][0]
    assert reply["token_ids"] == expected.token_ids
    assert reply["message"] == {
        "role": "assistant",
        "content": tokenizer.decode(expected.token_ids, skip_special_tokens=True),
    }
    assert [e["logprob"] for e in reply["logprobs"]["content"]] == expected.logprobs
    assert all(len(e["top_logprobs"]) == 2 for e in reply["logprobs"]["content"])
    assert _run(CompletionServer(_model()), "/v1/chat/completions", chat)[0] == 404  # no tokenizer

    async def stream() -> str:
        async with (
            TestClient(TestServer(server.create_app())) as client,
            client.post("/v1/chat/completions", data=json.dumps({**chat, "stream": True})) as resp,
        ):
            return (await resp.read()).decode()

    events = [e.removeprefix("data: ") for e in asyncio.run(stream()).split("\n\n") if e]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    deltas = [c["choices"][0]["delta"].get("content", "") for c in chunks]
    assert "".join(deltas) == reply["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"

    full = tokenizer.decode(free.token_ids, skip_special_tokens=True)
    two_words = f"{words[2]} {words[3]}"  # a stop string that ends one token after it starts

    async def stream_cut() -> str:
        body = {"prompt": prompt, "max_tokens": 8, "stop": [two_words], "stream": True}
        async with (
            TestClient(TestServer(server.create_app())) as client,
            client.post("/v1/completions", data=json.dumps(body)) as resp,
        ):
            return (await resp.read()).decode()

    # Streamed with stop strings: text is held back until no stop can start in it, so
    # the pieces add up to the same cut text, never to a shown-then-withdrawn prefix.
    events = [e.removeprefix("data: ") for e in asyncio.run(stream_cut()).split("\n\n") if e]
    pieces = [json.loads(e)["choices"][0] for e in events[:-1]]
    assert "".join(p["text"] for p in pieces) == full.split(two_words)[0]
    assert pieces[-1]["finish_reason"] == "stop"


def test_a_preempted_generation_ends_with_a_clear_signal() -> None:
    import threading

    model = _model()
    server = CompletionServer(model)
    real_forward = model.forward
    calls: list[int] = []
    go = threading.Event()

    @functools.wraps(real_forward)  # keeps the signature the server reads the cache keyword from
    def forward(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 2:
            go.wait(10)  # the second step is under way while an activation preempts
        return real_forward(*args, **kwargs)

    model.forward = forward  # type: ignore[method-assign]

    async def scenario() -> None:
        async with TestClient(TestServer(server.create_app())) as client:
            body = {"prompt": [1, 2], "max_tokens": 20, "stream": True}
            async with client.post("/v1/completions", data=json.dumps(body)) as resp:
                await resp.content.readuntil(b"\n\n")  # the first token arrived
                while len(calls) < 2:  # the second step is under way (and held)
                    await asyncio.sleep(0.01)
                preempting = threading.Thread(target=server.preempt)
                preempting.start()  # waits for the step under way: no token mixes two versions
                await asyncio.sleep(0.05)
                assert preempting.is_alive()
                go.set()
                await asyncio.to_thread(preempting.join, 10)
                raw = (await resp.read()).decode()
            events = [e.removeprefix("data: ") for e in raw.split("\n\n") if e]
            assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "preempted"
            assert len(calls) == 2  # no step ran after the preemption
            # A request without streaming is answered 503, retryable, when preempted.
            calls.clear()
            go.clear()
            task = asyncio.ensure_future(
                client.post("/v1/completions", data=json.dumps({"prompt": [1], "max_tokens": 20}))
            )
            while len(calls) < 2:
                await asyncio.sleep(0.01)
            preempting = threading.Thread(target=server.preempt)
            preempting.start()
            await asyncio.sleep(0.05)
            go.set()
            async with await task as resp:
                assert resp.status == 503 and (await resp.json())["error"]["code"] == "preempted"
            assert len(calls) == 2

    asyncio.run(scenario())
