"""Text <-> token ids through llama.cpp's own vocabulary (``vocab_only``: no weights loaded)."""

from __future__ import annotations

import codecs
import os

from kvasir_bus.errors import DependencyError, ModelFileError


class Tokenizer:
    def __init__(self, model_path: str | os.PathLike):
        try:
            import llama_cpp
        except ImportError:
            raise DependencyError("text prompts need llama-cpp-python (pip install 'kvasir-bus[backbone]')") from None
        from backbone.reference import quiet_llama

        try:
            self._llm = quiet_llama(llama_cpp, os.fspath(model_path), vocab_only=True)
        except Exception as exc:
            raise ModelFileError(f"{model_path}: llama.cpp cannot load the vocabulary ({exc})") from None

    def encode(self, text: str, add_bos: bool = True, special: bool = False) -> list[int]:
        """``special``: spell control tokens (``<|im_start|>``) as those tokens (chat prompts)."""
        return self._llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=special)

    def decode_bytes(self, ids: list[int]) -> bytes:
        return self._llm.detokenize(ids)

    @property
    def bos_id(self) -> int:
        return self._llm.token_bos()

    def piece_bytes(self, token: int) -> bytes:
        """One token's bytes as ``decode_bytes`` joins them (memoised: a vocabulary is bounded)."""
        cache = self.__dict__.setdefault("_pieces", {})
        piece = cache.get(token)
        if piece is None:
            piece = cache[token] = self._llm.detokenize([token]) if token != self.bos_id else \
                self._bos_piece()
        return piece

    def _bos_piece(self) -> bytes:
        # detokenize() strips a leading space after a leading BOS; the raw piece is what a list joins
        return self._llm._model.token_to_piece(token=self.bos_id).rstrip(b"\0")

    def decode(self, ids: list[int]) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")


class StreamDecoder:
    """Turns tokens into text pieces, one token's bytes at a time (no re-decoding of the whole list).

    An incomplete multi-byte UTF-8 sequence is held back until the next token completes it;
    bytes that are not valid UTF-8 become U+FFFD, never dropped, so the joined pieces plus
    ``flush()`` equal ``tokenizer.decode(ids)`` exactly (the incremental decoder replaces
    exactly what a one-shot ``bytes.decode(errors="replace")`` does)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tok, self.count = tokenizer, 0
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._strip = False  # the list began with BOS: its first byte is dropped if it is a space

    def push(self, token: int) -> str:
        data = self.tok.piece_bytes(token)
        if self.count == 0:
            self._strip = token == self.tok.bos_id
        self.count += 1
        if self._strip and data:
            self._strip = False
            if data[:1] == b" ":
                data = data[1:]
        return self._utf8.decode(data)

    def flush(self) -> str:
        """The end of the stream: bytes still held back (a truncated character) become U+FFFD."""
        return self._utf8.decode(b"", final=True)
