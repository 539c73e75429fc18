"""Text <-> token ids through llama.cpp's own vocabulary (``vocab_only``: no weights loaded)."""

from __future__ import annotations

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

    def decode(self, ids: list[int]) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")


class StreamDecoder:
    """Turns a growing token list into text pieces without splitting UTF-8 characters."""

    def __init__(self, tokenizer: Tokenizer):
        self.tok, self.ids, self.emitted = tokenizer, [], 0

    def push(self, token: int) -> str:
        self.ids.append(token)
        data = self.tok.decode_bytes(self.ids)
        text = data.decode("utf-8", errors="ignore")
        piece, self.emitted = text[self.emitted:], len(text)
        return piece
