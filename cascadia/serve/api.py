"""The OpenAI API's requests and responses, as `cascadia serve` speaks them: pydantic models that check every field (an
unknown one is an error, not ignored), the response and stream-chunk bodies, and OpenAI-style error bodies.

Supported: chat and text completions, streamed (server-sent events) or not; `max_tokens` (chat also
`max_completion_tokens`), `temperature`, `top_p`, `top_k` and `min_p` (as vLLM takes them), `seed`, `stop` (up to 4
strings), log-probabilities (chat's `logprobs` and `top_logprobs`, completions' `logprobs: N` and `echo`),
`presence_penalty`, `frequency_penalty`, `repetition_penalty`, `logit_bias` and `min_tokens` (vLLM's),
`response_format` (JSON, a JSON schema), `stream_options.include_usage` and, as vLLM does,
`stream_options.continuous_usage_stats` (usage on every chunk), `ignore_eos` (keep going past the end-of-sequence
token) and, for chat, `tools`, `tool_choice` and `parallel_tool_calls`, `chat_template_kwargs` (more variables for
the chat template), `reasoning_effort` (one more), `add_generation_prompt` and `continue_final_message` (a prefill).
A completion's prompt is text or a list of token ids. Fields that cannot change the tokens are accepted and ignored
(`user`, `metadata`, `store`, `service_tier`, `cache_prompt`). A field this server does not serve (`UNSUPPORTED`:
legacy `functions`, `best_of`, `suffix`, ...) is accepted when its value asks for the default behaviour
(`functions: []`, `best_of: 1`; null too), as clients send on every request, and refused by name with any other value
(docs/openai-fields.md has the whole table). Text anywhere in a request, keys included, must be
Unicode that UTF-8 can carry: a lone UTF-16 surrogate (`"\\ud800"`, which JSON allows and badly decoded text produces)
is refused, naming where it is, before any field is read.
"""

from __future__ import annotations

import json
import time
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from cascadia.grammar import GrammarError, json_grammar
from cascadia.serve.tools import ToolFormat
from cascadia.sampling import MAX_LOGPROBS, LogitAdjustments

MAX_STOP_STRINGS = 4
# Fields of the OpenAI API (and of vLLM and llama-server) this server does not serve: why, and the values that ask
# for what it does anyway, accepted (null always is). Any other unknown field is refused as an unknown parameter.
UNSUPPORTED: dict[str, tuple[str, tuple]] = {
    "tools": ("tool calls are served on chat alone", ([],)),
    "tool_choice": ("tool calls are served on chat alone", ("none", "auto")),  # with no tools, neither calls one
    "parallel_tool_calls": ("tool calls are served on chat alone", (True, False)),  # nothing to call in parallel
    "functions": ("function calls are not supported", ([],)),
    "function_call": ("function calls are not supported", ("none", "auto")),
    "best_of": ("best_of is not supported", (1,)),
    "echo": ("echo is not supported", (False,)),
    "suffix": ("suffix is not supported", ("",)),
    "skip_special_tokens": ("special tokens are always left out of the text", (True,)),
    "modalities": ("only text is supported", (["text"],)),
    "audio": ("only text is supported", ()),
    "prediction": ("predicted outputs are not supported", ()),
}
# Fields that cannot change the tokens: accepted, and ignored.
IGNORED = ("metadata", "store", "service_tier", "cache_prompt")


def _asks_for_default(value: object, defaults: tuple) -> bool:
    """Whether `value` is one of `defaults`, of the same kind: 0 and 0.0 alike, but false is not 0."""
    def same(a: object, b: object) -> bool:
        numbers = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (a, b))
        return a == b and (numbers or type(a) is type(b))

    return value is None or any(same(value, default) for default in defaults)


def lone_surrogate(body: object) -> tuple[str | None, str] | None:
    """The first text of a JSON body (a value, or a key) that holds a lone UTF-16 surrogate: the parameter it is
    (None for a key) and a message naming where and which; None when there is none. No UTF-8 can carry a lone
    surrogate: neither the tokenizer nor a reply could."""
    pending = [(None, "", body)]  # a walk of its own, not recursion: a body may nest deeper than Python recurses
    while pending:
        param, where, value = pending.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as e:
                return param, f"{where}: a lone UTF-16 surrogate (U+{ord(value[e.start]):04X} at character " \
                              f"{e.start}) is not text"
        elif isinstance(value, (dict, list)):
            items = list(value.items() if isinstance(value, dict) else enumerate(value))
            for key, item in reversed(items):  # in the body's order
                inner = f"{param}.{key}" if param else str(key)
                pending.append((inner, inner, item))
                if isinstance(key, str):
                    pending.append((None, f"a key of {param or 'the body'}", key))
    return None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage on every chunk


class RequestBody(BaseModel):
    """What every request body shares: no unknown field; text that is Unicode (`lone_surrogate`); the fields of its
    API this server does not serve (`UNSERVED`), accepted when they ask for the default and refused by name
    otherwise; the fields that cannot change the tokens (`IGNORING`), dropped; null for a field with a default,
    that default."""

    model_config = ConfigDict(extra="forbid")
    UNSERVED: ClassVar[dict[str, tuple[str, tuple]]] = {}
    IGNORING: ClassVar[tuple[str, ...]] = ()
    model: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _what_clients_send(cls, body):
        if (found := lone_surrogate(body)) is not None:
            param, message = found
            raise PydanticCustomError("lone_surrogate", "{message}", {"message": message, "param": param})
        if not isinstance(body, dict):
            return body
        for name, (why, defaults) in cls.UNSERVED.items():
            if name in body and not _asks_for_default(body[name], defaults):
                raise unsupported(name, f"{why} by this server")
        cls.refuse_unserved(body)
        fields = cls.model_fields
        return {key: value for key, value in body.items() if key not in cls.UNSERVED and key not in cls.IGNORING
                and not (value is None and key in fields and not fields[key].is_required())}  # null: the default

    @classmethod
    def refuse_unserved(cls, body: dict) -> None:
        """More of the body this server does not serve, refused by name (`unsupported`) before the fields are
        read: none here; an API whose refusals hide inside its fields says which."""


def invalid(param: str, why: str) -> PydanticCustomError:
    """The error of a field whose value the rest of the request rules out: a 400 naming `param`."""
    return PydanticCustomError("invalid_param", "{message}", {"message": f"{param}: {why}", "param": param})


def unsupported(param: str, why: str) -> PydanticCustomError:
    """The error of a request asking for what this server does not serve: a 400 naming `param`."""
    return PydanticCustomError("unsupported", "{message}", {"message": f"{param}: {why}", "param": param})


class _Generation(RequestBody):
    """What chat and text completions share."""

    UNSERVED: ClassVar[dict[str, tuple[str, tuple]]] = UNSUPPORTED
    IGNORING: ClassVar[tuple[str, ...]] = IGNORED

    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1, lt=2**31, description="-1 or 0: no limit (vLLM's)")
    min_p: float = Field(0.0, ge=0, le=1)
    seed: int | None = Field(None, ge=0, lt=2**63)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0, le=10)
    logit_bias: dict[int, float] | None = Field(None, description="token id -> a bias in -100..100")
    min_tokens: int = Field(0, ge=0)
    _grammar: str | None = PrivateAttr(None)  # what holds the reply to `response_format`
    response_format: ResponseFormat | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, description="choices of the prompt, computed once (at most the server's max_streams); "
                                        "with a seed, choice i draws as a request with seed + i does")
    user: str | None = None
    ignore_eos: bool = False

    @field_validator("logit_bias")
    @classmethod
    def _biases(cls, value):
        for token, bias in (value or {}).items():
            if token < 0 or not -100 <= bias <= 100:
                raise ValueError(f"token ids are integers >= 0 and biases lie in -100..100, got {token}: {bias}")
        return value

    @model_validator(mode="after")
    def _min_tokens_within_max(self):
        if (wanted := self.wanted_tokens()) is not None and self.min_tokens > wanted:
            raise invalid("min_tokens", f"{self.min_tokens} is more than the {wanted} tokens asked for at most")
        return self

    @model_validator(mode="after")
    def _a_grammar_that_compiles(self):
        try:
            if self.response_format is not None:
                self._grammar = self.response_format.grammar()
        except GrammarError as e:
            raise invalid("response_format", f"the schema cannot hold a reply: {e}") from None
        return self

    def adjustments(self, prompt_tokens: int, stop_ids: tuple[int, ...]) -> LogitAdjustments | None:
        """How the request's logits change before each token (None: they do not)."""
        return LogitAdjustments.of(prompt_tokens, min_tokens=self.min_tokens, stop_ids=stop_ids,
                                   logit_bias=sorted((self.logit_bias or {}).items()),
                                   repetition_penalty=self.repetition_penalty, frequency_penalty=self.frequency_penalty,
                                   presence_penalty=self.presence_penalty, grammar=self._grammar)

    @field_validator("stop")
    @classmethod
    def _few_stop_strings(cls, value):
        if isinstance(value, list) and len(value) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        return value

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def usage_on_every_chunk(self) -> bool:
        """vLLM's `continuous_usage_stats`, which it serves only beside `include_usage`."""
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)

    def wanted_tokens(self) -> int | None:
        return self.max_tokens

    def reported_logprobs(self) -> int:
        """How many of the likeliest tokens' log-probabilities each token's come with; -1: none are asked for."""
        return -1

    def prompt_logprobs(self) -> bool:
        """Whether the prompt's tokens' log-probabilities are reported too."""
        return False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = Field(max_length=64)
    description: str | None = None
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None  # a reply always follows the schema: llguidance holds every token to it


def chat_request(renamed: dict[str, str] | None = None, **fields: Any) -> ChatRequest:
    """The chat request another API's request stands for, made inside that request's validation: the chat's first
    problem raised as the other request's, its field named as `renamed` says (by default as the chat's)."""
    try:
        return ChatRequest(**fields)
    except ValidationError as e:
        problem = e.errors()[0]
        param = problem.get("ctx", {}).get("param") or ".".join(map(str, problem["loc"])) or "messages"
        why = problem["msg"].removeprefix(f"{param}: ")
        param = (renamed or {}).get(param, param)
        raise (unsupported if problem["type"] == "unsupported" else invalid)(param, why) from None


class ResponseFormat(BaseModel):
    """`response_format`: text (the default), any JSON object, or JSON following a schema (`cascadia.grammar`)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is given with type json_schema, and only then")
        return self

    def grammar(self) -> str | None:
        """The grammar that holds a reply to this format (None: text); GrammarError for a schema that cannot."""
        if self.type == "text":
            return None
        return json_grammar(None if self.json_schema is None else self.json_schema.json_schema)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    arguments: str  # a JSON object, as text

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, value):
        try:
            parsed = json.loads(value)
        except ValueError:
            raise ValueError("is not JSON") from None
        if not isinstance(parsed, dict):
            raise ValueError("is not a JSON object")
        return value


class AssistantToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[AssistantToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # the call a tool message answers

    @model_validator(mode="after")
    def _what_its_role_holds(self):
        if self.role == "tool" and (self.tool_call_id is None or self.content is None):
            raise ValueError("a tool message gives the tool_call_id it answers and its content")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only an assistant's message holds tool_calls")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is missing")
        return self

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)

    def for_template(self) -> dict:
        """The message as a chat template reads it (transformers' form: a call's arguments as an object)."""
        message: dict[str, Any] = {"role": self.role, "content": self.text}
        if self.tool_calls:
            message["tool_calls"] = [{"id": call.id, "type": "function", "function": {
                "name": call.function.name, "arguments": json.loads(call.function.arguments)}}
                for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments
    strict: bool | None = None  # calls always follow it where tool_choice forces them


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: NamedFunction


class ChatRequest(_Generation):
    UNSERVED: ClassVar[dict[str, tuple[str, tuple]]] = {
        name: why for name, why in UNSUPPORTED.items() if name not in ("tools", "tool_choice", "parallel_tool_calls")}

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    # More variables for the chat template, as vLLM takes them (Qwen3's `enable_thinking`, say).
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: the chat without the assistant's opening, or with its final message left open for the reply to
    # continue (a prefill; it needs no generation prompt, so it needs no add_generation_prompt: false either)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    reasoning_effort: str | None = None  # one more variable, for templates that read it
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @field_validator("chat_template_kwargs")
    @classmethod
    def _not_the_messages(cls, value):
        if value is not None and "messages" in value:
            raise ValueError("may not replace the messages")
        return value

    @model_validator(mode="after")
    def _tools_that_exist(self):
        names = self.tool_names
        if len(names) != len(self.tools or ()):
            raise invalid("tools", "two functions share a name")
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise invalid("tool_choice", f"no tool named {choice.function.name!r} is given")
        if choice == "required" and not names:
            raise invalid("tool_choice", "required needs tools")
        if self.forced_call is not None and self.response_format is not None and self.response_format.type != "text":
            raise invalid("tool_choice", "a call is forced: no response_format besides")
        asked = {call.id for message in self.messages for call in message.tool_calls or ()}
        for i, message in enumerate(self.messages):
            if message.role == "tool" and message.tool_call_id not in asked:
                raise invalid(f"messages.{i}.tool_call_id", f"{message.tool_call_id!r} answers no call of an "
                                                            "assistant's message")
        return self

    def force_calls(self, fmt: ToolFormat) -> None:
        """Hold the reply to calls in `fmt` where `tool_choice` forces them (GrammarError: the functions'
        parameters cannot hold one)."""
        if self.forced_call is not None:
            self._grammar = fmt.grammar({tool.function.name: tool.function.parameters for tool in self.tools},
                                        self.forced_call or None, self.parallel_tool_calls)

    @property
    def tool_names(self) -> set[str]:
        return {tool.function.name for tool in self.tools or ()}

    @property
    def calls_tools(self) -> bool:
        """Whether the reply's calls are parsed out of it: tools are given, and tool_choice is not none."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def forced_call(self) -> str | None:
        """The function a call is forced of ("": any of the tools, `required`); None where none is forced."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.function.name
        return "" if self.tool_choice == "required" else None

    def template_tools(self) -> list[dict] | None:
        """The tools as the chat template reads them (transformers' `tools`)."""
        return [tool.model_dump(exclude_none=True) for tool in self.tools] if self.tools else None

    @model_validator(mode="after")
    def _top_logprobs_with_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise invalid("top_logprobs", "needs logprobs: true")
        return self

    def reported_logprobs(self) -> int:
        return (self.top_logprobs or 0) if self.logprobs else -1

    def template_variables(self) -> dict[str, Any]:
        """The chat template's variables from the request, as vLLM makes them: `chat_template_kwargs`, and
        `reasoning_effort` with `enable_thinking` unless "none" (the kwargs' own `enable_thinking` wins)."""
        variables = dict(self.chat_template_kwargs or {})
        if self.tools:
            variables["tools"] = self.template_tools()
        if self.reasoning_effort is not None:
            variables["reasoning_effort"] = self.reasoning_effort
            variables.setdefault("enable_thinking", self.reasoning_effort != "none")
        return variables

    def wanted_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Generation):
    UNSERVED: ClassVar[dict[str, tuple[str, tuple]]] = {name: why for name, why in UNSUPPORTED.items()
                                                        if name != "echo"} | {
        "top_logprobs": ("is chat's field: completions take logprobs (a number)", (0,))}

    prompt: str | list[int] = Field(description="text, or token ids")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="the likeliest tokens reported")
    echo: bool = False  # the prompt before the reply (and its tokens' log-probabilities, with logprobs)

    @field_validator("logprobs", mode="before")
    @classmethod
    def _a_number(cls, value):
        if value is True:
            raise ValueError("give how many of the likeliest tokens to report (0 for the chosen token's alone)")
        return None if value is False else value  # false: none, as chat's

    def reported_logprobs(self) -> int:
        return -1 if self.logprobs is None else self.logprobs

    def prompt_logprobs(self) -> bool:
        return self.echo and self.logprobs is not None

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, value):
        if not value:
            raise ValueError("the prompt is empty")
        if isinstance(value, list) and min(value) < 0:
            raise ValueError("token ids are integers >= 0")
        return value


class TokenizeRequest(RequestBody):
    """`POST /tokenize`: text as vLLM (`prompt`) or llama-server (`content`) sends it, or a chat's `messages` (as
    the chat template renders them). Special tokens are added only when asked (`add_special_tokens`, llama-server's
    `add_special`): by default the ids are those the completion endpoints feed the model."""

    prompt: str | None = None
    content: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = False
    add_special: bool | None = None
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_input(self):
        given = [name for name in ("prompt", "content", "messages") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(f"give one of prompt, content or messages, not {' and '.join(given) or 'none'}")
        return self

    @property
    def adds_special_tokens(self) -> bool:
        return self.add_special_tokens if self.add_special is None else self.add_special


class DetokenizeRequest(RequestBody):
    """`POST /detokenize`: token ids back to text, special tokens kept."""

    tokens: list[int]

    @field_validator("tokens")
    @classmethod
    def _ids(cls, value):
        if value and min(value) < 0:
            raise ValueError("token ids are integers >= 0")
        return value


# ---- responses ---------------------------------------------------------------------------------------------------
def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class Reply:
    """The bodies of one completion's response: whole, or its stream's chunks."""

    def __init__(self, chat: bool, completion_id: str, model: str):
        self.chat, self.id, self.model = chat, completion_id, model
        self.created = int(time.time())
        self._object = "chat.completion" if chat else "text_completion"

    def _head(self, suffix: str = "") -> dict:
        return {"id": self.id, "object": self._object + suffix, "created": self.created, "model": self.model}

    def choice(self, index: int, text: str | None, finish_reason: str, logprobs: dict | None = None,
               tool_calls: list[dict] | None = None) -> dict:
        """One choice of the whole response; `logprobs`: its own, when asked for (`cascadia.serve.logprobs`);
        `tool_calls`: a chat reply's calls (`cascadia.serve.tools`), its finish reason then `tool_calls`."""
        if self.chat:
            message = {"role": "assistant", "content": text} | ({"tool_calls": tool_calls} if tool_calls else {})
            return {"index": index, "message": message, "logprobs": logprobs,
                    "finish_reason": "tool_calls" if tool_calls else finish_reason}
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    def whole(self, choices: list[dict], prompt_tokens: int, completion_tokens: int) -> dict:
        """The whole response: its choices (`choice`), and the tokens of them all."""
        return self._head() | {"choices": choices, "usage": usage(prompt_tokens, completion_tokens)}

    def chunk(self, text: str | None, finish_reason: str | None = None, first: bool = False,
              usage_so_far: dict | None = None, logprobs: dict | None = None, tool_call: dict | None = None,
              index: int = 0) -> dict:
        """A stream chunk of choice `index`: a piece of text (None: none, as in the last chunk, which names the
        finish reason), with its token's log-probabilities when asked for, and the usage so far when asked for on
        every chunk (`continuous_usage_stats`); or a chat reply's call (`tool_call`: its delta, index included)."""
        extra = {} if usage_so_far is None else {"usage": usage_so_far}
        if self.chat:
            delta = {"role": "assistant", "content": text or ""} if first else \
                ({} if text is None else {"content": text})
            if tool_call is not None:
                delta = {"tool_calls": [tool_call]}
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
            return self._head(".chunk") | {"choices": [choice]} | extra
        choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
        return self._head() | {"choices": [choice]} | extra

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict:
        return self._head(".chunk" if self.chat else "") | {"choices": [],
                                                            "usage": usage(prompt_tokens, completion_tokens)}
