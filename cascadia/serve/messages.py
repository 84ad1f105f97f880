"""Anthropic's Messages API (`POST /v1/messages` and `POST /v1/messages/count_tokens`), text and tool use, as
llama-server serves it for agents written against Anthropic's SDK.

A message is a chat completion in other clothes: `system` and the `messages` become the chat's messages (an
assistant's `tool_use` blocks its tool calls, a user's `tool_result` blocks tool messages), `tools` and
`tool_choice` the chat's, so the tokens are the chat endpoint's for the same prompt; a final assistant message is a
prefill, which the reply continues (the chat endpoint's `continue_final_message`). What comes back is a `message`
object with a text block and a `tool_use` block per call, its `stop_reason` (`end_turn`, `max_tokens`, `tool_use`,
or `stop_sequence` naming the one found), or, streamed, Anthropic's named events: `message_start`,
`content_block_start`, a `content_block_delta` per piece of text, `content_block_stop`, then for each call a
`tool_use` block whose input comes as one `input_json_delta`, `message_delta` (the stop reason and the output
tokens) and `message_stop`; a failure mid-stream is an `error` event. Errors on these paths have Anthropic's shape
(`{"type": "error", "error": {"type", "message"}}`), and the API key may come as `x-api-key`, as Anthropic's clients
send it.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from cascadia.serve.api import (MAX_STOP_STRINGS, AssistantToolCall, ChatMessage, ChatRequest, FunctionCall,
                                FunctionSpec, NamedToolChoice, RequestBody, Tool, chat_request, invalid, unsupported)
from cascadia.serve.tools import ToolCall

PATH = "/v1/messages"
# Fields of the Messages API this server does not serve: why, and the values that ask for what it does anyway.
UNSUPPORTED: dict[str, tuple[str, tuple]] = {
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


class ToolUseBlock(BaseModel):
    """An assistant's call, sent back."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict | None = None


class ToolResultBlock(BaseModel):
    """A tool's answer to a call, in a user's message."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False
    cache_control: dict | None = None


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]
# the blocks served, and where each may be
BLOCKS = {"text": ("system", "user", "assistant"), "tool_use": ("assistant",), "tool_result": ("user",)}


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["user", "assistant"]
    content: str | list[Block]

    def blocks(self, kind: str) -> list:
        return [block for block in self.content if block.type == kind] if isinstance(self.content, list) else []


class AnthropicTool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: dict | None = None


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # of the tool `type: tool` calls
    disable_parallel_tool_use: bool = False


def _text(content: str | list) -> str:
    """A message's text: its text blocks joined as the chat endpoint joins a message's parts."""
    return content if isinstance(content, str) else "".join(block.text for block in content if block.type == "text")


class MessagesPrompt(RequestBody):
    """What a message and its token count share: the model, the system prompt, the messages."""

    UNSERVED: ClassVar[dict] = UNSUPPORTED
    IGNORING: ClassVar[tuple] = IGNORED

    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None

    @classmethod
    def refuse_unserved(cls, body: dict) -> None:
        """A content block that is neither text nor tool use (an image, a document, ...), by name and place, before
        the model's own error (every block type it expected) would bury the reason; a tool block where its role does
        not send one."""
        messages = body.get("messages") if isinstance(body.get("messages"), list) else []
        places = [("system", "system", body.get("system"))]
        places += [(f"messages.{i}.content", m.get("role"), m.get("content")) for i, m in enumerate(messages)
                   if isinstance(m, dict)]
        for where, role, blocks in places:
            for j, block in enumerate(blocks if isinstance(blocks, list) else []):
                kind = block.get("type") if isinstance(block, dict) else None
                if not isinstance(kind, str):
                    continue  # the model's own error names it
                if kind not in BLOCKS:
                    raise unsupported(f"{where}.{j}", f"{kind} blocks are not supported by this server (text and "
                                                      "tool use only)")
                if role not in BLOCKS[kind]:
                    raise invalid(f"{where}.{j}", f"a {role} message holds no {kind} blocks")

    @property
    def prefilled(self) -> bool:
        """Whether the messages end with the assistant's: the start of the reply, which continues it."""
        return self.messages[-1].role == "assistant"

    def chat_messages(self) -> list[ChatMessage]:
        """The chat's messages: a user's tool results as tool messages before its text, an assistant's calls as its
        tool calls."""
        chat = [ChatMessage(role="system", content=_text(self.system))] if self.system else []
        for message in self.messages:
            chat += [ChatMessage(role="tool", tool_call_id=result.tool_use_id, content=_text(result.content))
                     for result in message.blocks("tool_result")]
            calls = [AssistantToolCall(id=use.id, function=FunctionCall(name=use.name, arguments=json.dumps(use.input)))
                     for use in message.blocks("tool_use")]
            text = _text(message.content)
            if text or calls or not message.blocks("tool_result"):
                chat.append(ChatMessage(role=message.role, content=text if text or not calls else None,
                                        tool_calls=calls or None))
        return chat


class MessagesRequest(MessagesPrompt):
    max_tokens: int = Field(ge=1)
    temperature: float = Field(1.0, ge=0, le=1)  # Anthropic's range
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0, lt=2**31)  # 0: no limit
    stop_sequences: list[str] | None = Field(None, max_length=MAX_STOP_STRINGS)
    stream: bool = False
    tools: list[AnthropicTool] | None = None
    tool_choice: ToolChoice | None = None
    _chat: ChatRequest | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _a_chat_request(self):
        """The chat request that gives this message's tokens, checked here: a tool result answering no call, or a
        tool choice naming no tool, is refused where Anthropic's request says it."""
        asked: set[str] = set()
        for i, message in enumerate(self.messages):
            for j, block in enumerate(message.content if isinstance(message.content, list) else []):
                if block.type == "tool_result" and block.tool_use_id not in asked:
                    raise invalid(f"messages.{i}.content.{j}.tool_use_id",
                                  f"{block.tool_use_id!r} answers no tool_use block of an earlier message")
                asked |= {block.id} if block.type == "tool_use" else set()
        names = {tool.name for tool in self.tools or ()}
        choice = self.tool_choice
        if choice is not None and choice.type == "tool" and choice.name not in names:
            raise invalid("tool_choice", f"no tool named {choice.name!r} is given")
        if choice is not None and choice.type == "any" and not names:
            raise invalid("tool_choice", "any needs tools")
        self._chat = chat_request(
            model=self.model, messages=self.chat_messages(), max_tokens=self.max_tokens,
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, stop=self.stop_sequences,
            continue_final_message=self.prefilled,
            tools=[Tool(type="function", function=FunctionSpec(name=tool.name, description=tool.description,
                                                               parameters=tool.input_schema))
                   for tool in self.tools] if self.tools else None,
            tool_choice=_chat_tool_choice(choice),
            parallel_tool_calls=not (choice is not None and choice.disable_parallel_tool_use))
        return self

    def as_chat(self) -> ChatRequest:
        """The chat request that gives this message's tokens."""
        return self._chat


def _chat_tool_choice(choice: ToolChoice | None) -> str | NamedToolChoice | None:
    """Anthropic's tool choice as the chat endpoint's: `any` is `required`, `tool` names a function."""
    if choice is None or choice.type == "tool":
        return None if choice is None else NamedToolChoice(type="function", function={"name": choice.name})
    return {"auto": "auto", "none": "none", "any": "required"}[choice.type]


class MessageBody:
    """The bodies of one message: whole, or its stream's named events."""

    def __init__(self, message_id: str, model: str, input_tokens: int):
        self.id, self.model, self.input_tokens = message_id, model, input_tokens

    def message(self, text: str | None, stop_reason: str | None, stop_sequence: str | None,
                output_tokens: int, calls: list[ToolCall] = ()) -> dict:
        """The message object: its text block (none for `text` None: as it starts, or a reply of calls alone) and a
        `tool_use` block per call."""
        content = ([] if text is None else [self.block(text)]) + [self.tool_use(call) for call in calls]
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": self.usage(output_tokens)}

    @staticmethod
    def block(text: str) -> dict:
        return {"type": "text", "text": text}

    @staticmethod
    def tool_use(call: ToolCall, with_input: bool = True) -> dict:
        """A call's block (with `with_input` false: as a stream starts it, its input to come in a delta)."""
        return {"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"), "name": call.name,
                "input": json.loads(call.arguments) if with_input else {}}

    def usage(self, output_tokens: int) -> dict:
        return {"input_tokens": self.input_tokens, "output_tokens": output_tokens,
                "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}

    @staticmethod
    def event(kind: str, **fields: Any) -> dict:
        """A server-sent event of the stream: named by its type (Anthropic's clients skip unnamed ones)."""
        return {"event": kind, "data": json.dumps({"type": kind, **fields})}


def stop_reason(finish_reason: str, stopped_by: str | None, calls: bool = False) -> str | None:
    """A finished generation's stop reason: a stop sequence's, its calls', the end of the turn's, the token limit's;
    a cancelled one has none."""
    if stopped_by is not None:
        return "stop_sequence"
    if calls:
        return "tool_use"
    return {"length": "max_tokens", "stop": "end_turn"}.get(finish_reason)
