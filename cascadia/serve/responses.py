"""The OpenAI Responses API (`POST /v1/responses`), text only, as the Agents SDK and Codex call it by default.

A response is a chat completion in other clothes: `instructions` and the `input` (text, or message items) become the
chat's messages, `max_output_tokens` its `max_completion_tokens`, so the tokens are the chat endpoint's for the same
prompt. What comes back is a `response` object with one output message, or, streamed, its typed events: created,
in progress, the output item and its text part added, a `response.output_text.delta` per piece of text, their
`done` events, and `response.completed` (`response.incomplete` at `max_output_tokens`); a failure mid-stream is an
`error` event. Nothing is stored: `previous_response_id` and background responses are refused by name.
"""

from __future__ import annotations

import json
import secrets
import time
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from cascadia.serve.api import (ChatMessage, ChatRequest, JsonSchemaFormat, RequestBody, ResponseFormat, chat_request,
                                invalid)

# Fields of the Responses API this server does not serve: why, and the values that ask for what it does anyway.
UNSUPPORTED: dict[str, tuple[str, tuple]] = {
    "tools": ("tool calls are not supported", ([],)),
    "tool_choice": ("tool calls are not supported", ("none", "auto")),
    "parallel_tool_calls": ("tool calls are not supported", (True, False)),
    "max_tool_calls": ("tool calls are not supported", ()),
    "reasoning": ("reasoning settings are not served", ()),
    "include": ("no extra output is served", ([],)),
    "top_logprobs": ("log-probabilities are not supported", (0,)),
    "truncation": ("the context is never truncated", ("disabled",)),
    "previous_response_id": ("responses are not stored", ()),
    "conversation": ("conversations are not stored", ()),
    "background": ("background responses are not served", (False,)),
    "prompt": ("stored prompt templates are not served", ()),
}
# Fields that cannot change the tokens: accepted, and ignored (`store`: nothing is stored either way).
IGNORED = ("metadata", "store", "service_tier", "user", "prompt_cache_key", "safety_identifier", "stream_options")


class InputText(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["input_text", "output_text"]  # an earlier reply's text, sent back as input, is output_text
    text: str
    annotations: list | None = None


class InputMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[InputText]
    id: str | None = None  # an earlier output item, sent back as it came
    status: str | None = None


class TextFormat(BaseModel):
    """`text.format`: chat's `response_format`, its schema's fields beside its type."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str = Field("response", max_length=64)
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    def response_format(self) -> ResponseFormat:
        if self.type != "json_schema":
            return ResponseFormat(type=self.type)
        if self.json_schema is None:
            raise invalid("text", "format json_schema needs its schema")
        return ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(
            name=self.name, description=self.description, json_schema=self.json_schema, strict=self.strict))


class ResponseText(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: TextFormat = TextFormat(type="text")


class ResponsesRequest(RequestBody):
    UNSERVED: ClassVar[dict] = UNSUPPORTED
    IGNORING: ClassVar[tuple] = IGNORED

    input: str | list[InputMessage]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int | None = Field(None, ge=0, lt=2**63)  # as vLLM takes it
    text: ResponseText | None = None
    stream: bool = False

    _chat: ChatRequest | None = PrivateAttr(None)

    @field_validator("input")
    @classmethod
    def _some_input(cls, value):
        if isinstance(value, list) and not value:
            raise ValueError("give at least one message")
        return value

    @model_validator(mode="after")
    def _a_chat_request(self):
        """The chat request that gives this response's tokens, made (and its format compiled) once: a format that
        cannot hold a reply is refused at `text`."""
        items = [InputMessage(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        messages = [ChatMessage(role="system", content=self.instructions)] if self.instructions else []
        messages += [ChatMessage(role=item.role, content=item.content if isinstance(item.content, str)
                                 else "".join(part.text for part in item.content)) for item in items]
        self._chat = chat_request(
            {"response_format": "text"}, model=self.model, messages=messages,
            max_completion_tokens=self.max_output_tokens, temperature=self.temperature, top_p=self.top_p,
            seed=self.seed, response_format=None if self.text is None else self.text.format.response_format())
        return self

    def as_chat(self) -> ChatRequest:
        """The chat request that gives this response's tokens."""
        return self._chat


class ResponseBody:
    """The bodies of one response: the `response` object at each stage, and its stream's events, numbered."""

    def __init__(self, request: ResponsesRequest, response_id: str, model: str):
        self.request, self.id, self.model = request, response_id, model
        self.message_id = f"msg_{secrets.token_hex(12)}"
        self.created_at = int(time.time())
        self._sequence = 0

    def response(self, status: str, text: str | None = None, usage: dict | None = None) -> dict:
        """The response object: `status` in_progress (no output yet), completed, incomplete or cancelled."""
        output = [] if text is None else [self.message("completed", text)]
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "model": self.model, "output": output, "instructions": self.request.instructions,
                "max_output_tokens": self.request.max_output_tokens, "temperature": self.request.temperature,
                "top_p": self.request.top_p, "parallel_tool_calls": False, "tool_choice": "none", "tools": [],
                "text": {"format": self._format()}, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "usage": usage}

    def _format(self) -> dict:
        """The response's `text.format`: the request's, as the Responses API states it."""
        text = self.request.text
        return {"type": "text"} if text is None else text.format.model_dump(by_alias=True, exclude_none=True)

    def message(self, status: str, text: str | None) -> dict:
        content = [] if text is None else [self.part(text)]
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant", "content": content}

    @staticmethod
    def part(text: str) -> dict:
        return {"type": "output_text", "text": text, "annotations": []}

    def event(self, kind: str, **fields: Any) -> dict:
        """A server-sent event of the stream: its name is its type, its data the typed body."""
        self._sequence += 1
        return {"event": kind, "data": json.dumps({"type": kind, "sequence_number": self._sequence, **fields})}

    def text_event(self, kind: str, **fields: Any) -> dict:
        return self.event(kind, item_id=self.message_id, output_index=0, content_index=0, **fields)


def response_status(finish_reason: str) -> str:
    """A finished generation's response status: at the token limit it is incomplete."""
    return {"length": "incomplete", "cancelled": "cancelled"}.get(finish_reason, "completed")


def response_usage(prompt_tokens: int, output_tokens: int) -> dict:
    return {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + output_tokens}
