"""Tool calls in Hermes' form (`cascadia.serve.tools`): replies written by hand parsed into calls and content, a
streamed reply's content held back from its first call, and the grammar that forces calls walked by the matcher
over the tiny checkpoint's tokenizer."""

import json

import pytest

from cascadia.grammar import Constraint, vocabulary
from cascadia.serve.tools import ContentStream, forcing_grammar, parse, writes_calls
from cascadia.tokenizer import CHAT_TEMPLATE, load_tokenizer

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
    parsed_content, parsed = parse(reply, NAMES)
    assert parsed_content == content
    assert [(call.name, json.loads(call.arguments)) for call in parsed] == calls
    assert len({call.id for call in parsed}) == len(parsed) and all(c.id.startswith("call_") for c in parsed)


def test_a_streamed_reply_holds_its_calls_back():
    stream = ContentStream()
    pieces = ["Let", " me <", "tool", '_call>{"name": "get_time", ', '"arguments": {}}</tool_call>', " done"]
    assert [stream.push(piece) for piece in pieces] == ["Let", " me ", "", "", "", ""]
    rest, calls = stream.finish(NAMES)
    assert rest == " done" and [call.name for call in calls] == ["get_time"]
    unfinished = ContentStream()
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

    one = forcing_grammar(PARAMETERS, "get_weather", parallel=False)
    assert walk(one, '<tool_call>{"name":"get_weather","arguments":{"city":"Oslo"}}</tool_call>') == eos
    assert walk(one, '<tool_call>{"name":"get_time"') is None  # another function than the one named
    assert walk(one, '<tool_call>{"name":"get_weather","arguments":{"city":"Rome"') is None  # outside its schema
    several = forcing_grammar(PARAMETERS, None, parallel=True)
    call = '<tool_call>{"name":"get_time","arguments":{}}</tool_call>'
    after = walk(several, call)
    assert set(eos) < set(after)  # the end, or another call
    assert walk(several, call + call) is not None and walk(several, "Sure") is None


def test_cascadias_own_chat_template_writes_calls():
    assert writes_calls(CHAT_TEMPLATE) and not writes_calls("{{ messages }}")
