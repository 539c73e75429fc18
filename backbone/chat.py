"""Chat messages -> prompt text, with the model's own chat template.

A GGUF may carry its template as ``tokenizer.chat_template`` (the Jinja2 source from the
model's ``tokenizer_config.json``). It is rendered as transformers and llama.cpp render it: in
a sandbox, with ``trim_blocks`` and ``lstrip_blocks``, given ``messages``,
``add_generation_prompt``, ``bos_token`` and ``eos_token`` (the texts of those tokens), and
``raise_exception`` for templates that reject a conversation. A file without a template gets
ChatML, the format most instruction-tuned models of the last years use.

The rendered text holds the template's control tokens (``<|im_start|>``), so it is tokenized
with special tokens parsed and without an extra BOS (the template writes its own), as
transformers' ``apply_chat_template(tokenize=True)`` does.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from kvasir_bus.errors import UsageError

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

ROLES = ("system", "user", "assistant", "tool", "developer")


@dataclass(frozen=True)
class Message:
    role: str
    content: str


def parse_messages(raw) -> list[Message]:
    """OpenAI ``messages`` (content a string, or a list of ``{"type": "text"}`` parts) ->
    typed messages; anything else is a :class:`UsageError` naming the offending field."""
    if not isinstance(raw, list) or not raw:
        raise UsageError("'messages' must be a non-empty array")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise UsageError(f"messages[{i}] must be an object")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise UsageError(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r}")
        if content is None:
            content = ""
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise UsageError(f"messages[{i}].content[{j}]: only text parts are supported")
                parts.append(part["text"])
            content = "".join(parts)
        if not isinstance(content, str):
            raise UsageError(f"messages[{i}].content must be a string or an array of text parts")
        out.append(Message(role, content))
    return out


def _raise_exception(message: str):
    raise UsageError(f"the chat template rejects these messages: {message}")


class ChatTemplate:
    """``render(messages)`` -> the prompt text, ending with the assistant's turn opened."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = ""):
        self.source, self.bos_token, self.eos_token = source, bos_token, eos_token
        self.template  # compile now: a broken template fails at startup, not per request

    @cached_property
    def template(self):
        try:
            from jinja2 import TemplateError
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError:
            from kvasir_bus.errors import DependencyError

            raise DependencyError("chat templates need jinja2 (pip install 'kvasir-bus[backbone]')") from None
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            return env.from_string(self.source)
        except TemplateError as exc:
            raise UsageError(f"the chat template does not compile: {exc}") from None

    def render(self, messages: list[Message], add_generation_prompt: bool = True) -> str:
        from jinja2 import TemplateError

        try:
            return self.template.render(
                messages=[{"role": m.role, "content": m.content} for m in messages],
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token, eos_token=self.eos_token)
        except UsageError:
            raise
        except TemplateError as exc:
            raise UsageError(f"the chat template failed on these messages: {exc}") from None


def _strftime_now(fmt: str) -> str:  # some templates (llama 3.x) print today's date
    import datetime

    return datetime.datetime.now().strftime(fmt)


def template_for(reader) -> ChatTemplate:
    """The GGUF's own template (``tokenizer.chat_template``), or ChatML when it has none."""
    source = _string(reader, "tokenizer.chat_template")
    return ChatTemplate(source or CHATML, bos_token=_token_text(reader, "tokenizer.ggml.bos_token_id"),
                        eos_token=_token_text(reader, "tokenizer.ggml.eos_token_id"))


def _string(reader, key: str) -> str | None:
    field = reader.fields.get(key)
    if field is None:
        return None
    return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")


def _token_text(reader, key: str) -> str:
    """The spelling of a special token (``<|endoftext|>``), read without decoding the whole list."""
    field, tokens = reader.fields.get(key), reader.fields.get("tokenizer.ggml.tokens")
    if field is None or tokens is None:
        return ""
    token_id = int(field.parts[field.data[0]][0])
    if not 0 <= token_id < len(tokens.data):
        return ""
    return bytes(tokens.parts[tokens.data[token_id]]).decode("utf-8", errors="replace")
