"""The trainer process of the end-to-end test (run as a script, driven over stdin).

It builds a tiny Llama-style causal LM from a config (random init, fixed seed; nothing
is downloaded), and for each ``step`` line on stdin: one AdamW step on FP32 masters,
``Publisher.publish`` of the state dict (served as BF16), then the reference answers:
a separate model loaded directly with this version's BF16 weights runs the same greedy
generation the rollout serves. It prints one JSON line per version::

    {"version": N, "expected": [{"token_ids": [...], "logprobs": [...], "top": [...]}, ...]}

Usage: ``python trainer.py STORE RUN CONFIG_DIR PROMPTS_JSON MAX_TOKENS TOP_LOGPROBS``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: the repository root

from bulletin.engines.hf_server import greedy_generate
from bulletin.publisher import Publisher
from scripts._common import llama, serving

SEED = 1234
LR = 3e-3


def main() -> None:
    store, run, config_dir, prompts_json, max_tokens, top = sys.argv[1:7]
    torch.set_num_threads(1)  # the rollout serves with one thread too: same kernels, same bits
    config = AutoConfig.from_pretrained(config_dir)
    model = llama(config, SEED)
    reference = serving(LlamaForCausalLM(config))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    prompts = json.loads(prompts_json)
    data = torch.Generator().manual_seed(SEED)
    with Publisher(store, run, keyframe_every=3) as publisher:
        for line in sys.stdin:
            command = line.strip()
            if command == "quit":
                break
            if command != "step":
                raise SystemExit(f"unknown command {command!r}")
            if publisher.version is not None:  # version 1 is the initial weights
                batch = torch.randint(0, config.vocab_size, (4, 16), generator=data)
                model(input_ids=batch, labels=batch).loss.backward()
                optimizer.step()
                optimizer.zero_grad()
            version = publisher.publish(model.state_dict())
            reference.load_state_dict({k: v.detach().to(dtype=torch.bfloat16) for k, v in model.state_dict().items()})
            expected = []
            for prompt in prompts:
                out = greedy_generate(reference, prompt, int(max_tokens), top_logprobs=int(top))
                top_named = [{f"token_id:{t}": v for t, v in alts.items()} for alts in out.top_logprobs]
                expected.append({"token_ids": out.token_ids, "logprobs": out.logprobs, "top": top_named})
            print(json.dumps({"version": version, "expected": expected}), flush=True)


if __name__ == "__main__":
    main()
