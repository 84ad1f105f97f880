"""Tool calls: the reply's calls parsed out of its text, its content streamed without them, and the grammar that
forces calls where `tool_choice` asks for them.

One format for now, Hermes' (Qwen3's, and the chat template of Cascadia's own checkpoints): each call is
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` in the reply's text, the functions offered being
rendered by the checkpoint's chat template (its `tools` variable, as transformers passes them). A checkpoint whose
template writes no `<tool_call>` has no format Cascadia reads: tools are refused for it, by name.
"""

from __future__ import annotations

import json
import re
import secrets

import attrs
from llguidance import LLMatcher

from cascadia.grammar import COMPACT, GrammarError

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE), re.DOTALL)


def writes_calls(template_source: str) -> bool:
    """Whether a chat template writes calls in the format Cascadia reads."""
    return CALL_OPEN in template_source


@attrs.frozen
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text (OpenAI's `function.arguments`)
    id: str = attrs.field(factory=lambda: f"call_{secrets.token_hex(12)}")

    def as_dict(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def parse(text: str, names: set[str]) -> tuple[str | None, list[ToolCall]]:
    """A reply's content outside its calls (None where there is none) and its calls, in order. A block that is not a
    call of one of `names` with a JSON object for arguments stays in the content, as does a block left open."""
    content, calls = _split(text, names)
    return (content.strip() or None) if calls else (text or None), calls


def _split(text: str, names: set[str]) -> tuple[str, list[ToolCall]]:
    """The text outside the calls, as it is, and the calls."""
    calls, content, at = [], [], 0
    for match in _CALL.finditer(text):
        if (call := _call(match.group(1), names)) is not None:
            content.append(text[at:match.start()])
            calls.append(call)
            at = match.end()
    return "".join(content) + text[at:], calls


def _call(body: str, names: set[str]) -> ToolCall | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not (isinstance(value, dict) and value.get("name") in names and isinstance(value.get("arguments"), dict)):
        return None
    return ToolCall(value["name"], json.dumps(value["arguments"]))


def forcing_grammar(tools: dict[str, dict | None], name: str | None, parallel: bool) -> str:
    """The grammar of a reply made of calls alone: of `name`, or of any of `tools` (name: its parameters' schema,
    None for any object); one call, or several where `parallel`. Compact JSON, as structured outputs'."""
    chosen = [name] if name is not None else sorted(tools)
    schemas = [{"type": "object", "properties": {"name": {"const": tool},
                                                 "arguments": tools[tool] or {"type": "object"}},
                "required": ["name", "arguments"], "additionalProperties": False} for tool in chosen]
    schema = (schemas[0] if len(schemas) == 1 else {"anyOf": schemas}) | {"x-guidance": COMPACT}
    lark = f'start: call{"+" if parallel else ""}\ncall: "{CALL_OPEN}" %json{json.dumps(schema)} "{CALL_CLOSE}"\n'
    try:
        grammar = LLMatcher.grammar_from_lark(lark)
    except ValueError as e:
        raise GrammarError(str(e)) from None
    if (error := LLMatcher.validate_grammar(grammar)) and not error.startswith("WARNING"):
        raise GrammarError(error)
    return grammar


class ContentStream:
    """A streamed reply's content without its calls: text goes out as it comes until a call may begin (`<tool_call>`
    or the start of it at the end, held back), and nothing after the first call begins; the calls come parsed at
    the end."""

    def __init__(self):
        self._text = ""
        self._sent = 0
        self._calling = False

    def push(self, piece: str) -> str:
        """The content that may go out now."""
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
        """The content held back, and the reply's calls."""
        content, calls = _split(self._text, names)
        return content[self._sent:], calls
