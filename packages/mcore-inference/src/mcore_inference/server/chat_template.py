"""Chat messages to a prompt: the model directory's Jinja ``chat_template``, else a default one."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""The template used when the model directory has none: ChatML (``<|im_start|>role\\ncontent
<|im_end|>`` per message, then ``<|im_start|>assistant\\n``), written as plain text (a tokenizer
without those special tokens encodes them as ordinary text)."""


class ChatTemplateError(ValueError):
    """The messages cannot be rendered with the template (it raised, or it is not valid Jinja)."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


class ChatTemplate:
    """A Jinja chat template, rendered in a sandbox as Hugging Face ``apply_chat_template`` does
    (``messages``, ``add_generation_prompt``, ``bos_token``, ``eos_token``, ``raise_exception``)."""

    def __init__(self, source: str = DEFAULT_CHAT_TEMPLATE, *, bos_token: str = "", eos_token: str = ""):
        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        environment.globals["raise_exception"] = _raise_exception
        try:
            self._template = environment.from_string(source)
        except TemplateError as error:
            raise ChatTemplateError(f"the chat template is not valid Jinja: {error}") from None
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token

    def render(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """The prompt text of ``messages``; ``ChatTemplateError`` if the template refuses them."""
        try:
            return self._template.render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except ChatTemplateError:
            raise
        except TemplateError as error:
            raise ChatTemplateError(f"the chat template failed: {error}") from None


def _token_text(value: Any) -> str:
    """A ``tokenizer_config.json`` special token: a string, or a map with ``content``."""
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return value if isinstance(value, str) else ""


def load_chat_template(model_dir: str | os.PathLike | None) -> ChatTemplate:
    """The ``chat_template`` of ``model_dir``'s ``tokenizer_config.json`` (with its
    ``bos_token``/``eos_token``), else ``DEFAULT_CHAT_TEMPLATE``. A template given as a list of
    named templates uses the one named ``default``."""
    config_path = None if model_dir is None else Path(model_dir) / "tokenizer_config.json"
    if config_path is None or not config_path.is_file():
        return ChatTemplate()
    config = json.loads(config_path.read_text())
    source = config.get("chat_template")
    if isinstance(source, list):
        source = next((t.get("template") for t in source if t.get("name") == "default"), None)
    if not isinstance(source, str):
        return ChatTemplate()
    return ChatTemplate(
        source, bos_token=_token_text(config.get("bos_token")), eos_token=_token_text(config.get("eos_token"))
    )
