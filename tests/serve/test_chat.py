"""Chat messages -> prompt text: the GGUF's own template, ChatML without one, clear errors."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFReader, GGUFWriter

from backbone.chat import CHATML, ChatTemplate, Message, parse_messages, template_for
from kvasir_bus.errors import UsageError


def test_the_files_own_template_is_rendered_with_its_special_tokens(models):
    reader = GGUFReader(models("mixtral", "q8_0"))
    text = template_for(reader).render([Message("system", "Be brief."), Message("user", "Hi")])
    assert text == ("<|endoftext|><|system|>\nBe brief.<|endoftext|>\n<|user|>\nHi<|endoftext|>\n"
                    "<|assistant|>\n")


def test_a_file_without_a_template_gets_chatml(tmp_path):
    w = GGUFWriter(str(tmp_path / "bare.gguf"), "llama")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    template = template_for(GGUFReader(tmp_path / "bare.gguf"))
    assert template.source == CHATML
    assert template.render([Message("user", "Hi")]) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert template.render([Message("user", "Hi")], add_generation_prompt=False) == "<|im_start|>user\nHi<|im_end|>\n"


def test_content_parts_are_joined_and_bad_messages_name_the_field():
    assert parse_messages([{"role": "user", "content": [{"type": "text", "text": "a"},
                                                        {"type": "text", "text": "b"}]}]) == [Message("user", "ab")]
    for bad, needle in [([], "non-empty"), ("hi", "non-empty"), ([{"role": "wizard", "content": "x"}], "role"),
                        ([{"role": "user", "content": 3}], "content"),
                        ([{"role": "user", "content": [{"type": "image_url"}]}], "only text")]:
        with pytest.raises(UsageError, match=needle):
            parse_messages(bad)


def test_a_template_that_raises_or_does_not_compile_is_a_usage_error():
    strict = ChatTemplate("{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}ok")
    assert strict.render([Message("user", "x")]) == "ok"
    with pytest.raises(UsageError, match="user first"):
        strict.render([Message("assistant", "x")])
    with pytest.raises(UsageError, match="does not compile"):
        ChatTemplate("{% for %}")


def test_the_sandbox_refuses_unsafe_attribute_access():
    with pytest.raises(UsageError):
        ChatTemplate("{{ messages.__class__.__mro__ }}").render([Message("user", "x")])
