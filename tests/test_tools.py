"""Tool calls in Hermes' form and Llama 3.1's JSON (`cascadia.serve.tools`): replies written by hand parsed into
calls and content, a streamed reply's content held back from its calls, the grammar that forces calls walked by the
matcher over the tiny checkpoint's tokenizer, and each format told by the chat template that writes it."""

import json
from pathlib import Path

import pytest

from cascadia.grammar import Constraint, vocabulary
from cascadia.serve.tools import HERMES, LLAMA_JSON, tool_format
from cascadia.tokenizer import CHAT_TEMPLATE, load_tokenizer

LLAMA_TEMPLATE = Path(__file__).parent / "fixtures" / "chat_templates" / "llama3_json.jinja"

NAMES = {"get_weather", "get_time"}
PARAMETERS = {"get_weather": {"type": "object", "properties": {"city": {"enum": ["Oslo", "Lima"]}},
                              "required": ["city"], "additionalProperties": False},
              "get_time": None}


@pytest.mark.parametrize("reply, content, calls", [
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>', None,
     [("get_weather", {"city": "Oslo"})]),
    ('Let me look.\n<tool_call>{"name":"get_weather","arguments":{"city":"Lima"}}</tool_call>\n'
     '<tool_call>{"name":"get_time","arguments":{}}</tool_call>', "Let me look.",
     [("get_weather", {"city": "Lima"}), ("get_time", {})]),
    ("No call here.", "No call here.", []),
    ('<tool_call>{"name": "launch", "arguments": {}}</tool_call>',  # not a tool of the request: text
     '<tool_call>{"name": "launch", "arguments": {}}</tool_call>', []),
    ('<tool_call>{"name": "get_time", "arguments": "now"}</tool_call>',  # arguments not an object
     '<tool_call>{"name": "get_time", "arguments": "now"}</tool_call>', []),
    ('<tool_call>{"name": "get_time", "arguments": {}', '<tool_call>{"name": "get_time", "arguments": {}', []),
])
def test_replies_written_by_hand_give_their_calls_and_content(reply, content, calls):
    parsed_content, parsed = HERMES.parse(reply, NAMES)
    assert parsed_content == content
    assert [(call.name, json.loads(call.arguments)) for call in parsed] == calls
    assert len({call.id for call in parsed}) == len(parsed) and all(c.id.startswith("call_") for c in parsed)


@pytest.mark.parametrize("reply, content, calls", [
    ('{"name": "get_weather", "parameters": {"city": "Oslo"}}', None, [("get_weather", {"city": "Oslo"})]),
    ('<|python_tag|>{"name":"get_time","parameters":{}}; {"name":"get_weather","parameters":{"city":"Lima"}}',
     None, [("get_time", {}), ("get_weather", {"city": "Lima"})]),
    (' {"name": "get_time", "arguments": {}}\n', None, [("get_time", {})]),  # vLLM reads "arguments" too
    ("It is noon.", "It is noon.", []),
    ('Sure: {"name": "get_time", "parameters": {}}', 'Sure: {"name": "get_time", "parameters": {}}', []),  # not first
    ('{"name": "launch", "parameters": {}}', '{"name": "launch", "parameters": {}}', []),  # not a tool of the request
    ('{"name": "get_time", "parameters": {}} and more', '{"name": "get_time", "parameters": {}} and more', []),
    ('{"name": "get_time", "parameters": {', '{"name": "get_time", "parameters": {', []),  # cut short
])
def test_llama_json_replies_are_calls_when_they_are_calls_alone(reply, content, calls):
    parsed_content, parsed = LLAMA_JSON.parse(reply, NAMES)
    assert parsed_content == content
    assert [(call.name, json.loads(call.arguments)) for call in parsed] == calls


def test_a_streamed_llama_reply_goes_out_as_content_unless_it_begins_as_a_call():
    calling = LLAMA_JSON.stream()
    pieces = [" ", "<|python", "_tag|>", '{"name": "get_time", ', '"parameters": {}}']
    assert [calling.push(piece) for piece in pieces] == [""] * 5
    rest, calls = calling.finish(NAMES)
    assert rest == "" and [call.name for call in calls] == ["get_time"]
    talking = LLAMA_JSON.stream()
    assert [talking.push(p) for p in ["\n", "<|py", "x", " more"]] == ["", "", "\n<|pyx", " more"]
    assert talking.finish(NAMES) == ("", [])
    broken = LLAMA_JSON.stream()  # began as a call, but is none: all of it is content, at the end
    assert [broken.push(p) for p in ["{", "oops"]] == ["", ""] and broken.finish(NAMES) == ("{oops", [])


def test_a_streamed_reply_holds_its_calls_back():
    stream = HERMES.stream()
    pieces = ["Let", " me <", "tool", '_call>{"name": "get_time", ', '"arguments": {}}</tool_call>', " done"]
    assert [stream.push(piece) for piece in pieces] == ["Let", " me ", "", "", "", ""]
    rest, calls = stream.finish(NAMES)
    assert rest == " done" and [call.name for call in calls] == ["get_time"]
    unfinished = HERMES.stream()
    assert [unfinished.push(piece) for piece in ["a <", "b"]] == ["a ", "<b"]  # no call after all
    assert unfinished.finish(NAMES) == ("", [])


def test_the_forcing_grammar_takes_calls_of_the_given_functions_alone(spec, checkpoint):
    tokens = vocabulary(checkpoint, spec.model.config.output_vocab_size, spec.model.config.eos_ids)
    tokenizer = load_tokenizer(checkpoint)
    eos = sorted(spec.model.config.eos_ids)

    def walk(grammar: str, text: str) -> list[int] | None:
        """The tokens the grammar allows after `text`, or None where it leaves the grammar."""
        allowed = Constraint(tokens, grammar).allowed(tokenizer.encode(text, add_special_tokens=False).ids)
        return None if allowed is None else [i for i, ok in enumerate(allowed) if ok]

    one = HERMES.grammar(PARAMETERS, "get_weather", parallel=False)
    assert walk(one, '<tool_call>{"name":"get_weather","arguments":{"city":"Oslo"}}</tool_call>') == eos
    assert walk(one, '<tool_call>{"name":"get_time"') is None  # another function than the one named
    assert walk(one, '<tool_call>{"name":"get_weather","arguments":{"city":"Rome"') is None  # outside its schema
    several = HERMES.grammar(PARAMETERS, None, parallel=True)
    call = '<tool_call>{"name":"get_time","arguments":{}}</tool_call>'
    after = walk(several, call)
    assert set(eos) < set(after)  # the end, or another call
    assert walk(several, call + call) is not None and walk(several, "Sure") is None
    one = LLAMA_JSON.grammar(PARAMETERS, "get_weather", parallel=False)
    assert walk(one, '{"name":"get_weather","parameters":{"city":"Lima"}}') == eos
    assert walk(one, '{"name":"get_weather","arguments"') is None  # Llama's key is "parameters"
    assert walk(one, '{"name":"get_weather","parameters":{"city":"Rome"') is None
    several = LLAMA_JSON.grammar(PARAMETERS, None, parallel=True)
    call = '{"name":"get_time","parameters":{}}'
    assert set(eos) < set(walk(several, call)) and walk(several, f"{call}; {call}") is not None
    assert walk(several, f"<tool_call>{call}") is None


def test_each_format_is_told_by_the_chat_template_that_writes_it():
    assert tool_format(CHAT_TEMPLATE) is HERMES and tool_format(LLAMA_TEMPLATE.read_text()) is LLAMA_JSON
    assert tool_format("{{ messages }}") is None
