"""Render chat messages to a prompt with the model's jinja2 chat template (sandboxed).

The template is compiled once per `ChatTemplate`; rendering is safe to call concurrently.
Template or message errors raise InvalidRequest naming the offending field. Client-given
template variables (`chat_template_kwargs`) may not replace the ones the renderer sets.
"""

from __future__ import annotations

import logging
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tandem.errors import InvalidRequest

logger = logging.getLogger(__name__)

# ChatML: what a model without its own template is served with
DEFAULT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


# variables the renderer sets (and the one global templates call): a client's
# chat_template_kwargs may not replace them; the request field to use instead, if any
RESERVED_VARIABLES = {
    "messages": "messages",
    "add_generation_prompt": "add_generation_prompt",
    "tools": "tools",
    "bos_token": None,
    "eos_token": None,
    "raise_exception": None,
}


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


class ChatTemplate:
    """A compiled chat template plus the special tokens templates commonly reference."""

    def __init__(self, source: str | None, *, bos_token: str = "", eos_token: str = "") -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.globals["raise_exception"] = _raise_exception
        try:
            self._template = env.from_string(source or DEFAULT_TEMPLATE)
        except jinja2.TemplateError as exc:
            raise ValueError(f"chat template does not compile: {exc}") from exc
        # the same globals as a plain dict: jinja keeps a ChainMap, which every render copies
        # key by key in Python (8 of a short chat render's 15 us)
        self._template.globals = dict(self._template.globals)
        self._bos_token = bos_token
        # a template that reads `tools` renders them itself; others get the default tool prompt
        self.takes_tools = source is not None and "tools" in source
        self._eos_token = eos_token

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The prompt text for `messages` (each {"role", "content"} with content a string or a
        list of {"type": "text", "text"} parts), with `template_kwargs` as extra template
        variables. Raises InvalidRequest on bad messages, on a template variable that clashes
        with the renderer's own (`RESERVED_VARIABLES`), or when the template fails (e.g. its
        raise_exception on an unsupported role order)."""
        normalized = [_normalize(i, m) for i, m in enumerate(messages)]
        if not normalized:
            raise InvalidRequest("messages must not be empty", param="messages")
        context: dict[str, Any] = dict(template_kwargs or {})
        for key in context.keys() & RESERVED_VARIABLES.keys():
            field = RESERVED_VARIABLES[key]
            hint = f"; set the request's '{field}' field instead" if field else ""
            raise InvalidRequest(
                f"chat_template_kwargs.{key} is reserved: the chat template's own variable{hint}",
                param=f"chat_template_kwargs.{key}",
            )
        context.update(
            messages=normalized,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            bos_token=self._bos_token,
            eos_token=self._eos_token,
        )
        try:
            return self._template.render(context)
        except jinja2.TemplateError as exc:
            raise InvalidRequest(
                f"chat template rejected the messages: {exc}", param="messages"
            ) from exc
        except Exception as exc:  # request boundary: client data ran through the template
            logger.debug("chat template failed on a request", exc_info=True)
            raise InvalidRequest(
                f"chat template failed on these messages: {type(exc).__name__}: {exc}",
                param="chat_template_kwargs" if template_kwargs else "messages",
            ) from exc


def _normalize(index: int, message: dict[str, Any]) -> dict[str, Any]:
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise InvalidRequest(
            f"messages[{index}].role must be a non-empty string, got {role!r}",
            param=f"messages[{index}].role",
        )
    content = message.get("content")
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    elif isinstance(content, list):
        text = "".join(_part_text(index, j, p) for j, p in enumerate(content))
    else:
        raise InvalidRequest(
            f"messages[{index}].content must be a string or a list of text parts, "
            f"got {type(content).__name__}",
            param=f"messages[{index}].content",
        )
    out = dict(message)
    out["content"] = text
    return out


def _part_text(index: int, j: int, part: Any) -> str:
    param = f"messages[{index}].content[{j}]"
    if not isinstance(part, dict) or part.get("type") != "text":
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        raise InvalidRequest(
            f"{param} has type {kind!r}; expected 'text' or 'image_url'", param=param
        )
    text = part.get("text")
    if not isinstance(text, str):
        raise InvalidRequest(f"{param}.text must be a string, got {text!r}", param=f"{param}.text")
    return text
