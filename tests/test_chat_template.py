"""A chat template renders the messages with the variables a request adds (`chat_template_kwargs`), as vLLM passes
them: Qwen3's `enable_thinking`, say."""

import pytest

from cascadia.errors import RequestError
from cascadia.serve.api import ChatRequest
from cascadia.serve.chat import ChatTemplate

TEMPLATE = ("{{ bos_token }}{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% if enable_thinking is defined and not enable_thinking %}"
            "<think></think>{% endif %}{% endif %}{% if reasoning_effort is defined %}[{{ reasoning_effort }}]"
            "{% endif %}")
MESSAGES = [{"role": "user", "content": "hi"}]


def test_a_requests_variables_reach_the_template():
    template = ChatTemplate(TEMPLATE, {"bos_token": "<s>"}, "test")
    assert template.render(MESSAGES) == "<s><user>hi<assistant>"
    assert template.render(MESSAGES, {"enable_thinking": False}) == "<s><user>hi<assistant><think></think>"
    assert template.render(MESSAGES, {"reasoning_effort": "low"}) == "<s><user>hi<assistant>[low]"
    # they may set any variable (as vLLM lets them), the special tokens included ...
    assert template.render(MESSAGES, {"bos_token": ""}) == "<user>hi<assistant>"
    # ... but the messages are the request's own, and the reply's turn is always opened
    assert template.render(MESSAGES, {"messages": [{"role": "x", "content": "y"}], "add_generation_prompt": False}) \
        == "<s><user>hi<assistant>"


def test_a_final_message_left_open_is_continued_as_transformers_renders_it():
    """`continue_final_message` (a prefill): the chat up to the final message's text, with no generation prompt
    and nothing after it; a template that trims the message's end trims the text before the cut too."""
    chat = MESSAGES + [{"role": "assistant", "content": "The answer is "}]
    closing = ChatTemplate(TEMPLATE.replace("{{ m.content }}", "{{ m.content }}</s>"), {"bos_token": "<s>"}, "test")
    assert closing.render(chat, continue_final=True) == "<s><user>hi</s><assistant>The answer is "
    trimming = ChatTemplate(TEMPLATE.replace("{{ m.content }}", "{{ m.content | trim }}</s>"), {}, "test")
    assert trimming.render(chat, continue_final=True) == "<user>hi</s><assistant>The answer is"
    dropping = ChatTemplate("{% for m in messages %}<{{ m.role }}>{{ m.content[:3] }}{% endfor %}", {}, "test")
    with pytest.raises(RequestError, match="leaves out part of the final message"):
        dropping.render(chat, continue_final=True)


def test_a_template_that_refuses_is_a_request_error():
    template = ChatTemplate("{{ raise_exception('no system messages') }}", {}, "test")
    with pytest.raises(RequestError, match="refused these messages: no system messages"):
        template.render(MESSAGES)


@pytest.mark.parametrize("body, variables", [
    ({}, {}),
    ({"reasoning_effort": "low"}, {"reasoning_effort": "low", "enable_thinking": True}),
    ({"reasoning_effort": "none"}, {"reasoning_effort": "none", "enable_thinking": False}),
    ({"reasoning_effort": "high", "chat_template_kwargs": {"enable_thinking": False, "x": 1}},
     {"reasoning_effort": "high", "enable_thinking": False, "x": 1}),
])
def test_a_chat_requests_template_variables_are_vllms(body, variables):
    request = ChatRequest(messages=MESSAGES, **body)
    assert request.template_variables() == variables


def test_a_requests_variables_may_not_replace_the_templates_functions():
    template = ChatTemplate("{% set ns = namespace(n=0) %}{{ ns.n }}", {}, "test")
    with pytest.raises(RequestError, match="^chat_template_kwargs: may not replace the chat template's own namespace"):
        template.render(MESSAGES, {"namespace": 1})  # would call 1(): a TypeError, no fault of the checkpoint
