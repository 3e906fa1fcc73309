"""Incremental detokenization: the same text as one full decode, in linear time."""

from __future__ import annotations

import random
from typing import Any

import pytest

from bulletin.engines.detokenize import IncrementalText

CORPUS = [
    "Grüße aus Köln, naïve café crème brûlée",
    "日本語のテキストも少し混ぜる 😀 🚀 emoji bytes",
    "plain ascii words for the merges to learn, words and more words",
]


def _byte_level() -> Any:
    """A real byte-level BPE (GPT-2 style) trained offline: multi-byte characters span tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS * 4, trainers.BpeTrainer(vocab_size=300, special_tokens=["</s>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>")


def _metaspace() -> Any:
    """A SentencePiece-like BPE (Llama style): the decoder strips the first leading space."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(CORPUS * 4, trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "</s>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>")


class _Counting:
    """A real tokenizer that counts how many tokens it was asked to decode."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.decoded = 0

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        self.decoded += len(ids)
        text: str = self.tokenizer.decode(ids, **kwargs)
        return text


@pytest.fixture(params=["byte_level", "metaspace"])
def tokenizer(request: pytest.FixtureRequest) -> Any:
    return _byte_level() if request.param == "byte_level" else _metaspace()


def _ids(tokenizer: Any) -> list[int]:
    ids: list[int] = []
    for line in CORPUS:
        ids += tokenizer.encode(line, add_special_tokens=False)
        ids.append(tokenizer.eos_token_id)  # a special token in the middle: skipped
    return ids


def test_pieces_add_up_to_one_full_decode(tokenizer: Any) -> None:
    ids = _ids(tokenizer)
    text = IncrementalText(tokenizer)
    pieces = [text.add(t) for t in ids] + [text.finish()]
    full = tokenizer.decode(ids, skip_special_tokens=True)
    assert "".join(pieces) == text.text == full
    assert not any("\ufffd" in p for p in pieces)  # half a UTF-8 sequence is never shown


def test_stop_strings_cut_where_a_full_decode_would(tokenizer: Any) -> None:
    ids = _ids(tokenizer)
    full = tokenizer.decode(ids, skip_special_tokens=True)
    rng = random.Random(0)
    for _ in range(20):
        start = rng.randrange(1, len(full) - 4)
        stop = full[start : start + rng.randrange(1, 4)]
        text = IncrementalText(tokenizer, [stop, "never there"])
        pieces = []
        for t in ids:
            pieces.append(text.add(t))
            if text.stopped:
                break
        pieces.append(text.finish())
        expected = full[: full.find(stop)]
        assert text.stopped and text.text == expected == "".join(pieces), stop


def test_no_stop_found_keeps_everything(tokenizer: Any) -> None:
    ids = _ids(tokenizer)
    text = IncrementalText(tokenizer, ["never there"])
    shown = "".join(text.add(t) for t in ids)
    full = tokenizer.decode(ids, skip_special_tokens=True)
    assert len(full) - len(shown) == len("never there") - 1  # held back until the end
    assert not text.stopped and text.text == shown + text.finish() == full


def test_work_is_linear_in_the_tokens(tokenizer: Any) -> None:
    ids = _ids(tokenizer) * 8
    counting = _Counting(tokenizer)
    text = IncrementalText(counting, ["never there"])
    for t in ids:
        text.add(t)
    # A full decode per token would decode n^2 / 2 tokens; the window keeps it to a few per token.
    assert counting.decoded < 8 * len(ids) < len(ids) ** 2 / 2
