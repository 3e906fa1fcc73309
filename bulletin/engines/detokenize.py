"""Incremental detokenization with stop strings, in time linear in the tokens produced.

Decoding the whole output again after every token (what a naive server does) costs
O(n^2) for n tokens. :class:`IncrementalText` follows vLLM's slow-tokenizer path
(``detokenize_incrementally`` in ``vllm/transformers_utils/detokenizer_utils.py`` at
commit ``4ba787ec9``): it decodes only a window that starts at the last few tokens
already emitted (the *prefix*, decoded again so that tokenizers whose decoders look at
neighbours, e.g. SentencePiece's leading space, give the same characters), and emits
what the window adds after that prefix. A window that ends in U+FFFD (an incomplete
UTF-8 sequence of byte-level BPE) emits nothing until a later token completes it.

Stop strings are searched only where a new one can start: the new characters and the
``max(len(stop)) - 1`` before them. The text kept is cut before the first stop found,
and, as vLLM's ``stop_buffer_length`` does (``vllm/v1/engine/detokenizer.py``), that many
characters are held back from what is shown until no stop string can start in them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["IncrementalText"]

_INCOMPLETE = "\ufffd"


class IncrementalText:
    """The decoded text of a growing token list, cut before the first stop string.

    ``tokenizer`` is a ``transformers`` tokenizer (anything with ``decode(ids,
    skip_special_tokens=...)``).
    """

    def __init__(self, tokenizer: Any, stop: Sequence[str] = ()) -> None:
        self._tokenizer = tokenizer
        self._stop = tuple(s for s in stop if s)
        self._reach = max((len(s) for s in self._stop), default=1) - 1
        self._tokens: list[int] = []
        self._prefix = 0  # first token of the decoding window
        self._read = 0  # tokens whose characters are already in ``text``
        self._shown = 0  # characters of ``text`` already returned
        self.text = ""
        self.stopped = False

    def _decode(self, tokens: list[int]) -> str:
        text: str = self._tokenizer.decode(tokens, skip_special_tokens=True)
        return text

    def add(self, token: int) -> str:
        """Take the next token; return the characters that may be shown now.

        While stop strings are set, the last ``max(len(stop)) - 1`` characters are held
        back (a stop string may start in them and end in a later token, and what was
        shown cannot be taken back); :meth:`finish` returns them.
        """
        if self.stopped:
            return ""
        self._tokens.append(token)
        prefix = self._decode(self._tokens[self._prefix : self._read])
        window = self._decode(self._tokens[self._prefix :])
        if len(window) > len(prefix) and not window.endswith(_INCOMPLETE):
            new = window[len(prefix) :]
            self._prefix, self._read = self._read, len(self._tokens)
            start = max(0, len(self.text) - self._reach)
            self.text += new
            cuts = [i for i in (self.text.find(s, start) for s in self._stop) if i >= 0]
            if cuts:
                self.text = self.text[: min(cuts)]
                self.stopped = True
        return self._show(len(self.text) if self.stopped else len(self.text) - self._reach)

    def finish(self) -> str:
        """The characters still held back, once no token will follow."""
        return self._show(len(self.text))

    def _show(self, end: int) -> str:
        piece = self.text[self._shown : max(end, self._shown)]
        self._shown += len(piece)
        return piece
