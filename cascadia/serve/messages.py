"""Anthropic's Messages API (`POST /v1/messages` and `POST /v1/messages/count_tokens`), text only, as llama-server
serves it for agents written against Anthropic's SDK.

A message is a chat completion in other clothes: `system` and the `messages` become the chat's messages, so the
tokens are the chat endpoint's for the same prompt; a final assistant message is a prefill, which the reply
continues (the chat endpoint's `continue_final_message`). What comes back is a `message` object with one text block, its
`stop_reason` (`end_turn`, `max_tokens`, or `stop_sequence` naming the one found), or, streamed, Anthropic's named
events: `message_start`, `content_block_start`, a `content_block_delta` per piece of text, `content_block_stop`,
`message_delta` (the stop reason and the output tokens) and `message_stop`; a failure mid-stream is an `error`
event. Errors on these paths have Anthropic's shape (`{"type": "error", "error": {"type", "message"}}`), and the
API key may come as `x-api-key`, as Anthropic's clients send it.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from cascadia.serve.api import MAX_STOP_STRINGS, ChatMessage, ChatRequest, RequestBody, unsupported

PATH = "/v1/messages"
# Fields of the Messages API this server does not serve: why, and the values that ask for what it does anyway.
UNSUPPORTED: dict[str, tuple[str, tuple]] = {
    "tools": ("tool use is not supported", ([],)),
    "tool_choice": ("tool use is not supported", ({"type": "auto"}, {"type": "none"})),
    "thinking": ("extended thinking is not supported", ({"type": "disabled"},)),
    "output_config": ("output formats and effort are not supported", ({},)),
    "container": ("containers are not served", ()),
    "mcp_servers": ("MCP servers are not served", ([],)),
    "context_management": ("context management is not served", ()),
}
# Fields that cannot change the tokens: accepted, and ignored (`cache_control`: every prompt's K/V is computed anew).
IGNORED = ("metadata", "service_tier", "cache_control", "inference_geo", "speed", "diagnostics")
# Anthropic's error types, by status.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def on_path(path: str) -> bool:
    """Whether a request's path is one of this API's, whose errors take its shape."""
    return path == PATH or path.startswith(PATH + "/")


def error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


class TextBlock(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str
    cache_control: dict | None = None  # accepted, ignored: nothing is cached
    citations: list | None = None  # an earlier reply's, sent back as it came


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["user", "assistant"]
    content: str | list[TextBlock]


def _text(content: str | list[TextBlock]) -> str:
    """A message's text: its blocks joined as the chat endpoint joins a message's parts."""
    return content if isinstance(content, str) else "".join(block.text for block in content)


class MessagesPrompt(RequestBody):
    """What a message and its token count share: the model, the system prompt, the messages."""

    UNSERVED: ClassVar[dict] = UNSUPPORTED
    IGNORING: ClassVar[tuple] = IGNORED

    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None

    @classmethod
    def refuse_unserved(cls, body: dict) -> None:
        """A content block that is not text (an image, a tool result, ...), by name and place, before the model's
        own error (every block type it expected) would bury the reason."""
        messages = body.get("messages") if isinstance(body.get("messages"), list) else []
        places = [("system", body.get("system"))]
        places += [(f"messages.{i}.content", m.get("content")) for i, m in enumerate(messages) if isinstance(m, dict)]
        for where, blocks in places:
            for j, block in enumerate(blocks if isinstance(blocks, list) else []):
                kind = block.get("type") if isinstance(block, dict) else None
                if isinstance(kind, str) and kind != "text":
                    raise unsupported(f"{where}.{j}", f"{kind} blocks are not supported by this server (text only)")

    @property
    def prefilled(self) -> bool:
        """Whether the messages end with the assistant's: the start of the reply, which continues it."""
        return self.messages[-1].role == "assistant"

    def chat_messages(self) -> list[ChatMessage]:
        system = [ChatMessage(role="system", content=_text(self.system))] if self.system else []
        return system + [ChatMessage(role=m.role, content=_text(m.content)) for m in self.messages]


class MessagesRequest(MessagesPrompt):
    max_tokens: int = Field(ge=1)
    temperature: float = Field(1.0, ge=0, le=1)  # Anthropic's range
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0, lt=2**31)  # 0: no limit
    stop_sequences: list[str] | None = Field(None, max_length=MAX_STOP_STRINGS)
    stream: bool = False

    def as_chat(self) -> ChatRequest:
        """The chat request that gives this message's tokens."""
        return ChatRequest(model=self.model, messages=self.chat_messages(), max_tokens=self.max_tokens,
                           temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                           stop=self.stop_sequences,
                           continue_final_message=self.prefilled)


class MessageBody:
    """The bodies of one message: whole, or its stream's named events."""

    def __init__(self, message_id: str, model: str, input_tokens: int):
        self.id, self.model, self.input_tokens = message_id, model, input_tokens

    def message(self, text: str | None, stop_reason: str | None, stop_sequence: str | None,
                output_tokens: int) -> dict:
        """The message object; `text` None: as it starts, with no content yet."""
        content = [] if text is None else [self.block(text)]
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": self.usage(output_tokens)}

    @staticmethod
    def block(text: str) -> dict:
        return {"type": "text", "text": text}

    def usage(self, output_tokens: int) -> dict:
        return {"input_tokens": self.input_tokens, "output_tokens": output_tokens,
                "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}

    @staticmethod
    def event(kind: str, **fields: Any) -> dict:
        """A server-sent event of the stream: named by its type (Anthropic's clients skip unnamed ones)."""
        return {"event": kind, "data": json.dumps({"type": kind, **fields})}


def stop_reason(finish_reason: str, stopped_by: str | None) -> str | None:
    """A finished generation's stop reason: a stop sequence's, the end of the turn's, the token limit's; a
    cancelled one has none."""
    if stopped_by is not None:
        return "stop_sequence"
    return {"length": "max_tokens", "stop": "end_turn"}.get(finish_reason)
