"""Tool calls: the reply's calls parsed out of its text, its content streamed without them, and the grammar that
forces calls where `tool_choice` asks for them, in the format the checkpoint's chat template writes
(`tool_format`). The functions offered are rendered by the template (its `tools` variable, as transformers passes
them), and so are calls and tools' answers sent back.

Two formats, as the models were trained to write them:
- Hermes' (Qwen3's, and the chat template of Cascadia's own checkpoints): each call is
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, anywhere in the reply.
- Llama 3.1's JSON calls (Llama 3.1, 3.2 and 3.3): the whole reply is `{"name": ..., "parameters": {...}}`, maybe
  after `<|python_tag|>`, several joined by `;` (as vLLM's `llama3_json` parser reads them); a reply that is not
  wholly calls is content.
A checkpoint whose template writes neither has no format Cascadia reads: tools are refused for it, by name.
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Protocol

import attrs
from llguidance import LLMatcher

from cascadia.grammar import COMPACT, GrammarError

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_CALL = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE), re.DOTALL)


@attrs.frozen
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text (OpenAI's `function.arguments`)
    id: str = attrs.field(factory=lambda: f"call_{secrets.token_hex(12)}")

    def as_dict(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class ContentStream(Protocol):
    def push(self, piece: str) -> str:
        """The content that may go out now."""

    def finish(self, names: set[str]) -> tuple[str, list[ToolCall]]:
        """The content held back, and the reply's calls."""


class ToolFormat(Protocol):
    """How a model writes its calls."""

    name: str

    def parse(self, text: str, names: set[str]) -> tuple[str | None, list[ToolCall]]:
        """A reply's content outside its calls (None where there is none) and its calls of `names`, in order."""

    def grammar(self, tools: dict[str, dict | None], name: str | None, parallel: bool) -> str:
        """The grammar of a reply made of calls alone: of `name`, or of any of `tools` (name: its parameters'
        schema, None for any object); one call, or several where `parallel`. Compact JSON, as structured
        outputs'."""

    def stream(self) -> ContentStream:
        """What holds a streamed reply's calls back from its content."""


class Hermes:
    name = "hermes"

    def parse(self, text: str, names: set[str]) -> tuple[str | None, list[ToolCall]]:
        """A block that is not a call of one of `names` with a JSON object for arguments stays in the content, as
        does a block left open."""
        content, calls = _split(text, names)
        return (content.strip() or None) if calls else (text or None), calls

    def grammar(self, tools: dict[str, dict | None], name: str | None, parallel: bool) -> str:
        call = f'"{CALL_OPEN}" %json{json.dumps(_call_schema(tools, name, "arguments"))} "{CALL_CLOSE}"'
        return _compiled(f'start: call{"+" if parallel else ""}\ncall: {call}\n')

    def stream(self) -> HermesStream:
        return HermesStream()


class LlamaJson:
    name = "llama3_json"

    def parse(self, text: str, names: set[str]) -> tuple[str | None, list[ToolCall]]:
        """Calls of `names` with an object of parameters (or of arguments), the whole reply; else all content."""
        rest = text.strip().removeprefix(PYTHON_TAG).lstrip()
        calls = []
        while rest.startswith("{"):
            try:
                value, end = json.JSONDecoder().raw_decode(rest)
            except ValueError:
                break
            if not isinstance(value, dict) or value.get("name") not in names:
                break
            arguments = value.get("parameters", value.get("arguments"))
            if not isinstance(arguments, dict):
                break
            calls.append(ToolCall(value["name"], json.dumps(arguments)))
            rest = rest[end:].lstrip()
            if not rest:
                return None, calls
            rest = rest.removeprefix(";").lstrip()
        return text or None, []

    def grammar(self, tools: dict[str, dict | None], name: str | None, parallel: bool) -> str:
        more = ' ("; " call)*' if parallel else ""
        return _compiled(f"start: call{more}\ncall: %json{json.dumps(_call_schema(tools, name, 'parameters'))}\n")

    def stream(self) -> LeadingCallStream:
        return LeadingCallStream(self)


HERMES, LLAMA_JSON = Hermes(), LlamaJson()


def tool_format(template_source: str) -> ToolFormat | None:
    """The format a chat template writes its calls in (None: none Cascadia reads)."""
    if CALL_OPEN in template_source:
        return HERMES
    if '"parameters": ' in template_source:  # Llama 3.1's: '{"name": ..., "parameters": ...}'
        return LLAMA_JSON
    return None


def _split(text: str, names: set[str]) -> tuple[str, list[ToolCall]]:
    """The text outside Hermes' calls, as it is, and the calls."""
    calls, content, at = [], [], 0
    for match in _CALL.finditer(text):
        if (call := _hermes_call(match.group(1), names)) is not None:
            content.append(text[at:match.start()])
            calls.append(call)
            at = match.end()
    return "".join(content) + text[at:], calls


def _hermes_call(body: str, names: set[str]) -> ToolCall | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not (isinstance(value, dict) and value.get("name") in names and isinstance(value.get("arguments"), dict)):
        return None
    return ToolCall(value["name"], json.dumps(value["arguments"]))


def _call_schema(tools: dict[str, dict | None], name: str | None, arguments: str) -> dict:
    """The JSON schema of a call of `name` (None: of any of `tools`), its arguments under the key `arguments`."""
    chosen = [name] if name is not None else sorted(tools)
    schemas = [{"type": "object", "properties": {"name": {"const": tool}, arguments: tools[tool] or {"type": "object"}},
                "required": ["name", arguments], "additionalProperties": False} for tool in chosen]
    return (schemas[0] if len(schemas) == 1 else {"anyOf": schemas}) | {"x-guidance": COMPACT}


def _compiled(lark: str) -> str:
    try:
        grammar = LLMatcher.grammar_from_lark(lark)
    except ValueError as e:
        raise GrammarError(str(e)) from None
    if (error := LLMatcher.validate_grammar(grammar)) and not error.startswith("WARNING"):
        raise GrammarError(error)
    return grammar


class HermesStream:
    """A streamed reply's content without its calls: text goes out as it comes until a call may begin (`<tool_call>`
    or the start of it at the end, held back), and nothing after the first call begins; the calls come parsed at
    the end."""

    def __init__(self):
        self._text = ""
        self._sent = 0
        self._calling = False

    def push(self, piece: str) -> str:
        self._text += piece
        if self._calling:
            return ""
        end = self._text.find(CALL_OPEN, max(0, self._sent - len(CALL_OPEN)))
        if end != -1:
            self._calling = True
        else:
            end = len(self._text) - next((n for n in range(len(CALL_OPEN) - 1, 0, -1)
                                          if self._text.endswith(CALL_OPEN[:n])), 0)
        out, self._sent = self._text[self._sent:end], max(self._sent, end)
        return out

    def finish(self, names: set[str]) -> tuple[str, list[ToolCall]]:
        content, calls = _split(self._text, names)
        return content[self._sent:], calls


class LeadingCallStream:
    """A streamed reply whose calls can only be the whole of it (`LlamaJson`): held back until its first characters
    say whether it begins as a call (`{` or `<|python_tag|>`, after any whitespace); content then goes out as it
    comes, and calls (or, if they do not parse, the whole reply as content) at the end."""

    def __init__(self, fmt: LlamaJson):
        self._format, self._text = fmt, ""
        self._content: bool | None = None  # None: not yet known

    def push(self, piece: str) -> str:
        self._text += piece
        if self._content is None:
            head = self._text.lstrip()
            if not head or (PYTHON_TAG.startswith(head) and head != PYTHON_TAG):
                return ""
            self._content = not head.startswith(("{", PYTHON_TAG))
            return self._text if self._content else ""
        return piece if self._content else ""

    def finish(self, names: set[str]) -> tuple[str, list[ToolCall]]:
        if self._content:
            return "", []
        content, calls = self._format.parse(self._text, names)
        return ("" if calls else self._text), calls
