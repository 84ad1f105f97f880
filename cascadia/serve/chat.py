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

CONTINUE_MARK = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' mark of where the final message's text ends


class ChatTemplate:
    def __init__(self, template: str, special_tokens: dict[str, str], where: str):
        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        environment.globals["raise_exception"] = _raise
        environment.filters["tojson"] = _tojson  # transformers' (Jinja's own escapes <, > and & as in HTML)
        try:
            self._template = environment.from_string(template)
        except jinja2.TemplateError as e:
            raise CheckpointError(f"{where}: chat_template: not a valid Jinja2 template ({e})") from None
        self.source = template
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
               add_generation_prompt: bool = True, continue_final: bool = False) -> str:
        """The prompt text of a chat, ready for the assistant's reply (unless `add_generation_prompt` is false), or
        with its final message left open for the reply to continue (`continue_final`: a prefill), as transformers'
        `continue_final_message` renders it: the message's end marked, the chat rendered without a generation
        prompt and cut at the mark. `variables`: more for the template (a request's `chat_template_kwargs`), which
        may set any but `messages` and `add_generation_prompt` (as vLLM), and not the template's own functions
        (`range`, `namespace`, ...)."""
        if not continue_final:
            return self._render(messages, variables, add_generation_prompt)
        final = messages[-1]
        text = self._render([*messages[:-1], {**final, "content": final["content"] + CONTINUE_MARK}], variables, False)
        at = text.rfind(CONTINUE_MARK.strip())
        if at == -1:
            raise RequestError(f"the chat template ({self.where}) leaves out part of the final message, which so "
                               "cannot be continued")
        # a template that trims the message's end trims the mark's space too: trim what precedes the mark likewise
        return text[:at] if text.startswith(CONTINUE_MARK, at) else text[:at].rstrip()

    def _render(self, messages: Sequence[dict[str, str]], variables: Mapping[str, Any] | None,
                add_generation_prompt: bool) -> str:
        if taken := sorted(self._own_names.intersection(variables or {})):
            raise RequestError(f"chat_template_kwargs: may not replace the chat template's own {', '.join(taken)}")
        try:
            return self._template.render({**self._special_tokens, **(variables or {}),
                                          "add_generation_prompt": add_generation_prompt, "messages": list(messages)})
        except jinja2.TemplateError as e:  # the template's own raise_exception, or a sandbox refusal
            raise RequestError(f"the chat template ({self.where}) refused these messages: {e}") from None


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(message: str):
    raise jinja2.TemplateError(message)
