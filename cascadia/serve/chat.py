"""Chat messages as a prompt: the checkpoint's `tokenizer_config.json` `chat_template`, as Hugging Face renders it
(Jinja2 over `messages`, `add_generation_prompt` and the special tokens), in a sandbox: a template may read its
variables but call no Python it was not given."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from cascadia.errors import CheckpointError, RequestError
from cascadia.tokenizer import TOKENIZER_CONFIG_FILE


class ChatTemplate:
    def __init__(self, template: str, special_tokens: dict[str, str], where: str):
        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        environment.globals["raise_exception"] = _raise
        try:
            self._template = environment.from_string(template)
        except jinja2.TemplateError as e:
            raise CheckpointError(f"{where}: chat_template: not a valid Jinja2 template ({e})") from None
        self._special_tokens = special_tokens
        self._own_names = frozenset(environment.globals)  # range, namespace, raise_exception, ...
        self.where = where

    @classmethod
    def of_checkpoint(cls, checkpoint: Path) -> ChatTemplate | None:
        """The checkpoint's template, or None when its tokenizer_config.json (or the template in it) is missing."""
        path = Path(checkpoint) / TOKENIZER_CONFIG_FILE
        if not path.is_file():
            return None
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{path}: cannot read ({e})") from None
        if not isinstance(config, dict) or not isinstance(config.get("chat_template"), str):
            return None
        specials = {key: value for key, value in config.items()
                    if key.endswith("_token") and isinstance(value, str)}
        return cls(config["chat_template"], specials, str(path))

    def render(self, messages: Sequence[dict[str, str]], variables: Mapping[str, Any] | None = None,
               add_generation_prompt: bool = True) -> str:
        """The prompt text of a chat, ready for the assistant's reply (unless `add_generation_prompt` is false);
        `variables`: more for the template (a request's `chat_template_kwargs`), which may set any but `messages`
        and `add_generation_prompt` (as vLLM), and not the template's own functions (`range`, `namespace`, ...)."""
        if taken := sorted(self._own_names.intersection(variables or {})):
            raise RequestError(f"chat_template_kwargs: may not replace the chat template's own {', '.join(taken)}")
        try:
            return self._template.render({**self._special_tokens, **(variables or {}),
                                          "add_generation_prompt": add_generation_prompt, "messages": list(messages)})
        except jinja2.TemplateError as e:  # the template's own raise_exception, or a sandbox refusal
            raise RequestError(f"the chat template ({self.where}) refused these messages: {e}") from None


def _raise(message: str):
    raise jinja2.TemplateError(message)
