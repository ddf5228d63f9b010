from __future__ import annotations

import pytest

from tandem.errors import InvalidRequest
from tandem.tokens.chat_template import ChatTemplate
from tandem.tokens.tokenizer import ModelTokenizer


def test_smollm2_template_renders_like_transformers(smollm2: ModelTokenizer) -> None:
    template = ChatTemplate(smollm2.chat_template)
    text = template.render([{"role": "user", "content": "Hi there"}])
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    )
    without = template.render([{"role": "user", "content": "x"}], add_generation_prompt=False)
    assert not without.endswith("<|im_start|>assistant\n")


def test_list_of_text_parts_is_joined() -> None:
    template = ChatTemplate(None)
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert "user\nab<|im_end|>" in template.render([{"role": "user", "content": parts}])


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([], "messages"),
        ([{"content": "x"}], "messages[0].role"),
        ([{"role": "user", "content": 3}], "messages[0].content"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "messages[0].content[0]"),
        (
            [{"role": "user", "content": [{"type": "text", "text": 1}]}],
            "messages[0].content[0].text",
        ),
    ],
)
def test_bad_messages_name_the_field(messages, param: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        ChatTemplate(None).render(messages)
    assert info.value.param == param


def test_template_raise_exception_becomes_invalid_request() -> None:
    template = ChatTemplate(
        "{% if messages[0]['role'] != 'user' %}"
        "{{ raise_exception('first must be user') }}{% endif %}"
    )
    with pytest.raises(InvalidRequest, match="first must be user"):
        template.render([{"role": "assistant", "content": "x"}])


def test_sandbox_blocks_attribute_escape() -> None:
    template = ChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(InvalidRequest):
        template.render([{"role": "user", "content": "x"}])


@pytest.mark.parametrize(
    "key",
    ["messages", "add_generation_prompt", "tools", "bos_token", "eos_token", "raise_exception"],
)
def test_template_kwargs_may_not_replace_the_renderers_variables(key: str) -> None:
    with pytest.raises(InvalidRequest, match=f"chat_template_kwargs.{key} is reserved") as info:
        ChatTemplate(None).render([{"role": "user", "content": "x"}], template_kwargs={key: 1})
    assert info.value.param == f"chat_template_kwargs.{key}"


def test_template_kwargs_reach_the_template_and_its_runtime_errors_are_400s() -> None:
    template = ChatTemplate("{{ greeting }} {{ messages[0]['content'] }}{{ 1 + extra }}")
    message = [{"role": "user", "content": "x"}]
    assert template.render(message, template_kwargs={"greeting": "hi", "extra": 1}) == "hi x2"
    with pytest.raises(InvalidRequest, match="TypeError") as info:  # 1 + "a" inside jinja
        template.render(message, template_kwargs={"greeting": "hi", "extra": "a"})
    assert info.value.param == "chat_template_kwargs"
