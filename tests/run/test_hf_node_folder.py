"""A node folder is a Hugging Face model folder: ``bulletin publish`` of a real
``save_pretrained`` folder, ``bulletin sync --to DIR``, and ``transformers`` (and the
in-process server) start from ``DIR/current`` as from the original."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from aiohttp.test_utils import TestClient, TestServer

from bulletin.cli import main
from bulletin.engines.hf_server import CompletionServer, greedy_generate
from scripts._common import llama, llama_config, serving

TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


def _tokenizer(folder: Path) -> Any:
    """A real BPE tokenizer trained here (nothing downloaded), saved as transformers saves one."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    corpus = [f"the policy takes step {i} and the rollout node follows it" for i in range(200)]
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(folder)
    return fast


def _cli(*args: str) -> dict[str, Any]:
    from click.testing import CliRunner

    from bulletin.cli import cli

    result = CliRunner().invoke(cli, [*args, "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    answer: dict[str, Any] = json.loads(result.stdout)
    return answer


def test_transformers_and_the_server_start_from_the_node_folder(tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    checkpoint = tmp_path / "checkpoint"
    model = llama(llama_config(vocab=200, tied=False), 0)  # FP32, as a trainer holds it
    model.generation_config.max_new_tokens = 7
    model.save_pretrained(checkpoint)
    tokenizer = _tokenizer(checkpoint)
    (checkpoint / "training_args.bin").write_bytes(b"\x80\x04pickle")  # a trainer's pickle: left out
    store, node = str(tmp_path / "bucket"), tmp_path / "node"
    common = ["--store", store, "--run", "llama"]

    published = _cli("publish", str(checkpoint), *common)
    assert published["dtype"] == "bf16" and published["keyframe"]
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= set(
        published["files"]
    )
    assert "pickled" in published["files_skipped"]["training_args.bin"]
    assert published["notes"] == ["config.json: dtype float32 -> bfloat16"]  # transformers 5 writes "dtype"
    synced = _cli("sync", *common, "--to", str(node))
    assert synced["version"] == 1 and synced["files_downloaded"] == len(published["files"])
    current = node / "current"

    config = AutoConfig.from_pretrained(current)
    assert config.vocab_size == 200 and str(config.dtype) in ("bfloat16", "torch.bfloat16")
    served = AutoModelForCausalLM.from_pretrained(current)
    assert served.dtype == torch.bfloat16  # what config.json says, and what the folder holds
    reference = serving(llama(llama_config(vocab=200, tied=False), 0))  # the trainer's model, cast to BF16
    for name, tensor in reference.state_dict().items():
        assert torch.equal(served.state_dict()[name], tensor), name
    loaded_tokenizer = AutoTokenizer.from_pretrained(current)
    prompt = "the policy takes step 7"
    assert loaded_tokenizer(prompt)["input_ids"] == tokenizer(prompt)["input_ids"]
    assert loaded_tokenizer.chat_template == TEMPLATE

    # The in-process server started from the folder serves text prompts, greedy exact.
    server = CompletionServer(serving(served), tokenizer=loaded_tokenizer)
    ids = loaded_tokenizer(prompt)["input_ids"]
    expected = greedy_generate(served, ids, 5)

    async def ask() -> dict[str, Any]:
        async with (
            TestClient(TestServer(server.create_app())) as client,
            client.post("/v1/completions", data=json.dumps({"prompt": prompt, "max_tokens": 5})) as resp,
        ):
            assert resp.status == 200
            answer: dict[str, Any] = await resp.json()
            return answer

    body = asyncio.run(ask())
    assert body["choices"][0]["token_ids"] == expected.token_ids
    assert body["choices"][0]["text"] == loaded_tokenizer.decode(expected.token_ids)

    # A trainer step later: patched in place, the files stay (nothing fetched again).
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.mul_(1.01)
    model.save_pretrained(checkpoint)
    again = _cli("publish", str(checkpoint), *common)
    assert not again["keyframe"] and again["files_uploaded"] == 0
    step = _cli("sync", *common, "--to", str(node))
    assert step["version"] == 2 and step["transitions"] == 1 and step["files_downloaded"] == 0
    reloaded = AutoModelForCausalLM.from_pretrained(current)
    cast = model.model.layers[0].mlp.up_proj.weight.to(torch.bfloat16)
    assert torch.equal(reloaded.model.layers[0].mlp.up_proj.weight, cast)
    assert AutoTokenizer.from_pretrained(current)(prompt)["input_ids"] == ids


@pytest.mark.parametrize(("dtype", "served"), [("fp16", "F16"), ("fp32", "F32"), ("keep", "F32")])
def test_publish_dtype_option(tmp_path: Path, dtype: str, served: str) -> None:
    from bulletin.checkpoint import Checkpoint

    checkpoint = tmp_path / "checkpoint"
    llama(llama_config(vocab=64, hidden=32, intermediate=64, layers=1), 0).save_pretrained(checkpoint)
    answer = _cli("publish", str(checkpoint), "--store", str(tmp_path / "b"), "--run", "r", "--dtype", dtype)
    names = {"F16": "float16", "F32": "float32"}
    assert answer["notes"] == ([f"config.json: dtype float32 -> {names[served]}"] if served != "F32" else [])
    assert main(["sync", "--store", str(tmp_path / "b"), "--run", "r", "--to", str(tmp_path / "n")]) == 0
    with Checkpoint(tmp_path / "n" / "current") as ckpt:
        assert {spec.dtype for spec in ckpt.specs.values()} == {served}
    assert json.loads((tmp_path / "n" / "current" / "config.json").read_text())["dtype"] == names[served]


def test_a_half_precision_checkpoint_is_served_as_torch_casts_it(tmp_path: Path) -> None:
    # F16 -> BF16 goes through torch's own cast, reading the checkpoint's read-only maps.
    from bulletin.checkpoint import Checkpoint

    checkpoint = tmp_path / "checkpoint"
    model = llama(llama_config(vocab=64, hidden=32, intermediate=64, layers=1), 0).half()
    model.save_pretrained(checkpoint)
    answer = _cli("publish", str(checkpoint), "--store", str(tmp_path / "b"), "--run", "r", "--dtype", "bf16")
    assert answer["notes"] == ["config.json: dtype float16 -> bfloat16"]
    assert main(["sync", "--store", str(tmp_path / "b"), "--run", "r", "--to", str(tmp_path / "n")]) == 0
    state = model.state_dict()
    with Checkpoint(tmp_path / "n" / "current") as ckpt:
        assert set(ckpt.specs) == set(state) - {"lm_head.weight"}  # tied to the embedding: once
        for name in ckpt.specs:
            assert (ckpt.bits(name) == state[name].to(torch.bfloat16).view(torch.uint16).numpy()).all(), name
