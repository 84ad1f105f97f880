"""`cascadia serve` on the tiny model's three local nodes, driven by the real `openai` client and by raw HTTP: the
API's answers, exact against the single-process engine; many clients at once; cancellation; every bad input's
status and message; Prometheus metrics; a clean shutdown on SIGTERM."""

from __future__ import annotations

import asyncio
import codecs
import json
import os
import signal
import time
from pathlib import Path

import anthropic
import httpx
import jsonschema
import numpy as np
import openai
import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from serving import Served, alive, scored_log_softmax

from cascadia.cli import cli
from cascadia.engine.checkpoint import Checkpoint
from cascadia.engine.engine import Engine
from cascadia.engine.generate import generate
from cascadia.pipeline.transport import free_port
from cascadia.sampling import LogitAdjustments, Sampling
from cascadia.serve.chat import ChatTemplate
from cascadia.serve.logprobs import TokenText
from cascadia.tokenizer import load_tokenizer
from tests.test_tiny_chat import words_share

SPEC = Path(__file__).parent.parent / "specs" / "tiny-local.yaml"
TRAINED = SPEC.parent / "tiny-chat"  # the quick start's checkpoint
KEY = "sk-test-cascadia"


@pytest.fixture(scope="module")
def server(tmp_path_factory, checkpoint):
    folder = tmp_path_factory.mktemp("serve")
    (folder / "key").write_text(KEY + "\n")
    served = Served(folder, SPEC, checkpoint, "--api-key-file", str(folder / "key"), "--max-body", "64KiB")
    nodes = served.children()
    yield served
    assert len(nodes) == 3 and served.stop() == 0
    assert not any(alive(pid) for pid in nodes), "node processes left behind"


@pytest.fixture(scope="module")
def one_slot(tmp_path_factory, checkpoint):
    """A server whose pipeline holds one stream, and lets one more request wait."""
    folder = tmp_path_factory.mktemp("serve-one")
    spec = folder / "one.yaml"
    spec.write_text(f"include: {SPEC}\nruntime: {{max_streams: 1}}\nworkload: {{concurrency: [1]}}\n")
    served = Served(folder, spec, checkpoint, "--max-waiting", "1")
    yield served
    assert served.stop() == 0


@pytest.fixture(scope="module")
def quick_start(tmp_path_factory):
    """The README's server (specs/tiny-serve.yaml, the trained tiny model): its streams hold the model's whole
    context, 1,024 positions, as the prompts of clients and serving benchmarks need; it says so as it starts."""
    served = Served(tmp_path_factory.mktemp("serve-quick-start"), SPEC.parent / "tiny-serve.yaml", TRAINED)
    assert ("serving tiny: 1,024 positions a stream (runtime.context_budget; the model's whole context), 16 streams "
            "at once") in served.log.read_text()
    yield served
    assert served.stop() == 0


def test_the_quick_starts_first_chat_is_answered_in_words(quick_start):
    """The README's first request, to the trained model: a reply in words (the random tiny model's is noise)."""
    client = openai.OpenAI(base_url=f"{quick_start.url}/v1", api_key="none", max_retries=0, timeout=60)
    reply = client.chat.completions.create(model="tiny", messages=[
        {"role": "user", "content": "What is a generator?"}], max_tokens=32, temperature=0)
    text = reply.choices[0].message.content
    assert len(text.split()) >= 5 and words_share(text) >= 0.7, text


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference(spec, checkpoint):
    """Greedy text and tokens as `cascadia generate` makes them, on the single-process engine."""
    engine = Engine(Checkpoint.open(checkpoint), spec.runtime, formats=spec.model.formats, threads=1)
    tokenizer = load_tokenizer(checkpoint)
    chat = ChatTemplate.of_checkpoint(checkpoint)

    def greedy(prompt_ids, n: int, stop: bool = True) -> tuple[str, list[int]]:
        stop_ids = spec.model.config.eos_ids if stop else ()
        ids = list(generate(engine, prompt_ids, n, Sampling(), stop_ids=stop_ids).ids)
        return tokenizer.decode(ids, skip_special_tokens=True), ids

    def chat_ids(messages) -> list[int]:
        return tokenizer.encode(chat.render(messages), add_special_tokens=False).ids

    return greedy, chat_ids, tokenizer


@pytest.fixture(scope="module")
def single(spec, checkpoint):
    """The single-process engine, for `cascadia score`'s logits and `cascadia generate`'s draws."""
    return Engine(Checkpoint.open(checkpoint), spec.runtime, formats=spec.model.formats, threads=1)


def log_softmax(engine: Engine, prompt_ids, output_ids) -> np.ndarray:
    """The score's distribution at each output token's position (`scored_log_softmax`)."""
    return scored_log_softmax(engine, prompt_ids, output_ids)[len(prompt_ids) - 1:]


def likeliest(row: np.ndarray, k: int) -> list[int]:
    return np.lexsort((np.arange(len(row)), -row))[:k].tolist()  # equal values: the lower id first


MESSAGES = [{"role": "system", "content": "You are a small random model."}, {"role": "user", "content": "Hello!"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"enum": ["Oslo", "Lima"]},
                                               "days": {"type": "integer", "minimum": 1, "maximum": 3}},
                                               "required": ["city", "days"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {},
                                                                           "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]



# ---- the API's answers ----------------------------------------------------------------------------------------------
def test_models_lists_the_spec_model(client):
    assert [model.id for model in client.models.list()] == ["tiny"]


def test_greedy_chat_is_the_single_process_engine_text(client, reference):
    greedy, chat_ids, _ = reference
    reply = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, temperature=0)
    text, ids = greedy(chat_ids(MESSAGES), 12)
    assert reply.choices[0].message.content == text and reply.choices[0].message.role == "assistant"
    assert reply.choices[0].finish_reason == ("stop" if len(ids) < 12 else "length")
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(chat_ids(MESSAGES)), len(ids))


def test_streamed_chat_pieces_add_up_to_the_whole_reply(client, reference):
    greedy, chat_ids, _ = reference
    chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == greedy(chat_ids(MESSAGES), 12)[0]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(greedy(chat_ids(MESSAGES), 12)[1])


def test_completions_take_text_or_token_ids(client, reference):
    greedy, _, tokenizer = reference
    prompt = "A fleet of ordinary computers"
    ids = tokenizer.encode(prompt, add_special_tokens=False).ids
    text = client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0).choices[0].text
    assert text == greedy(ids, 10)[0]
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=10, temperature=0)
    assert by_ids.choices[0].text == text
    streamed = list(client.completions.create(model="tiny", prompt=ids, max_tokens=10, temperature=0, stream=True,
                                              extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in streamed) == greedy(ids, 10, stop=False)[0]
    # one chunk per token, then the finish: what `cascadia run --url` times each token by
    assert [c.choices[0].finish_reason for c in streamed] == [None] * 10 + ["length"]


def test_a_stop_string_ends_the_text_before_it(client, reference):
    greedy, _, tokenizer = reference
    ids = tokenizer.encode("Measure first, then predict.", add_special_tokens=False).ids
    text, _ = greedy(ids, 16)
    stop = text[len(text) // 2:len(text) // 2 + 2]
    reply = client.completions.create(model="tiny", prompt=ids, max_tokens=16, temperature=0, stop=[stop, "\x00"])
    assert reply.choices[0].text == text[:text.find(stop)] and reply.choices[0].finish_reason == "stop"


def test_sampled_replies_depend_on_the_seed(client):
    def draw(seed):
        return client.completions.create(model="tiny", prompt=[5, 9, 3], max_tokens=8, temperature=1.0, top_p=0.9,
                                         seed=seed, extra_body={"ignore_eos": True}).choices[0].text
    assert draw(3) == draw(3) and draw(3) != draw(4)


@pytest.mark.parametrize("stream", [False, True])
def test_n_choices_are_the_replies_of_n_requests_seeded_one_after_another(client, stream):
    """Three choices of one prompt, computed once (the nodes fork its state for the second and third), each the
    reply of a request of its own with seed 7, 8 or 9; streamed, each chunk names its choice. Greedy choices are
    the same reply, and the usage counts every choice's tokens."""
    ask = {"model": "tiny", "prompt": [5, 9, 3, 17, 2, 11], "max_tokens": 10, "temperature": 1.0,
           "extra_body": {"ignore_eos": True}}
    alone = [client.completions.create(**ask, seed=seed).choices[0].text for seed in (7, 8, 9)]
    assert len(set(alone)) == 3
    if stream:
        texts, finished = ["", "", ""], [None] * 3
        for chunk in client.completions.create(**ask, seed=7, n=3, stream=True,
                                               stream_options={"include_usage": True}):
            for choice in chunk.choices:
                texts[choice.index] += choice.text
                finished[choice.index] = choice.finish_reason or finished[choice.index]
            usage = chunk.usage
        assert texts == alone and finished == ["length"] * 3 and usage.completion_tokens == 30
    else:
        reply = client.completions.create(**ask, seed=7, n=3)
        assert [c.index for c in reply.choices] == [0, 1, 2]
        assert [c.text for c in reply.choices] == alone and reply.usage.completion_tokens == 30
    greedy = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6, temperature=0, n=2,
                                            stream=stream)
    if stream:
        contents = ["", ""]
        for chunk in greedy:
            for choice in chunk.choices:
                contents[choice.index] += choice.delta.content or ""
    else:
        contents = [choice.message.content for choice in greedy.choices]
    assert contents[0] == contents[1] == client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=6, temperature=0).choices[0].message.content


def test_n_choices_each_echo_the_prompt_with_its_log_probabilities(client):
    """The prompt is computed by the first choice alone, yet every choice echoes it with its log-probabilities."""
    reply = client.completions.create(model="tiny", prompt=[5, 9, 3, 17], max_tokens=3, temperature=1.0, seed=4,
                                      n=2, echo=True, logprobs=2, extra_body={"ignore_eos": True})
    alone = client.completions.create(model="tiny", prompt=[5, 9, 3, 17], max_tokens=3, temperature=1.0, seed=5,
                                      echo=True, logprobs=2, extra_body={"ignore_eos": True}).choices[0]
    first, second = reply.choices
    assert first.logprobs.token_logprobs[:4] == second.logprobs.token_logprobs[:4] == alone.logprobs.token_logprobs[:4]
    assert first.logprobs.token_logprobs[0] is None and None not in first.logprobs.token_logprobs[1:]
    assert second.text == alone.text and second.logprobs.top_logprobs == alone.logprobs.top_logprobs


@pytest.mark.parametrize("limit", [{"top_k": 1}, {"min_p": 1.0}])
def test_a_draw_limited_to_the_likeliest_token_is_greedy(client, limit):
    """top_k 1, or min_p 1 (only tokens as likely as the likeliest), leave the draw one token: the greedy one."""
    def reply(temperature, **extra):
        return client.completions.create(model="tiny", prompt=[5, 9, 3], max_tokens=8, temperature=temperature,
                                         seed=3, extra_body={"ignore_eos": True, **extra}).choices[0].text
    assert reply(1.5, **limit) == reply(0) != reply(1.5)


def test_chat_logprobs_are_the_models_distribution(client, reference, single):
    """Each token's log-probability and its five likeliest alternatives', as the score of the prompt and reply
    gives them (within 1e-5), with each token's exact bytes: together, the reply's text."""
    greedy, chat_ids, tokenizer = reference
    text_of = TokenText(tokenizer)
    reply = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10, temperature=0,
                                           logprobs=True, top_logprobs=5, extra_body={"ignore_eos": True})
    content = reply.choices[0].logprobs.content
    prompt, output = chat_ids(MESSAGES), greedy(chat_ids(MESSAGES), 10, stop=False)[1]
    assert [bytes(entry.bytes) for entry in content] == [text_of.bytes(token) for token in output]
    for entry, row, token in zip(content, log_softmax(single, prompt, output), output, strict=True):
        assert entry.logprob == pytest.approx(row[token], abs=1e-5)
        top = likeliest(row, 5)
        assert top[0] == token  # greedy: the likeliest
        assert [bytes(alternative.bytes) for alternative in entry.top_logprobs] == [text_of.bytes(i) for i in top]
        assert [alternative.logprob for alternative in entry.top_logprobs] == pytest.approx(row[top], abs=1e-5)
    special = set(tokenizer.get_added_tokens_decoder())
    text = b"".join(text_of.bytes(token) for token in output if token not in special)
    assert text.decode(errors="replace") == reply.choices[0].message.content  # random: bytes that split characters


def test_sampled_completion_logprobs_are_the_models_before_temperature(client, reference, single):
    """A sampled completion's `logprobs: 3`, streamed (a token's in its chunk) or not: the model's distribution
    before temperature, at the tokens `cascadia generate` draws with the same seed, and where each token's text
    starts."""
    _, _, tokenizer = reference
    text_of = TokenText(tokenizer)
    prompt, sampling = [5, 9, 3], Sampling(temperature=1.5, seed=11)
    output = list(generate(single, prompt, 8, sampling).ids)
    ask = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 1.5, "seed": 11, "logprobs": 3,
           "extra_body": {"ignore_eos": True}}
    whole = client.completions.create(**ask).choices[0].logprobs
    rows = log_softmax(single, prompt, output)
    assert whole.tokens == [text_of.text(token) for token in output]
    assert whole.token_logprobs == pytest.approx([row[token] for row, token in zip(rows, output)], abs=1e-5)
    for alternatives, row in zip(whole.top_logprobs, rows, strict=True):
        assert list(alternatives) == list(dict.fromkeys(text_of.text(i) for i in likeliest(row, 3)))
        assert list(alternatives.values())[0] == pytest.approx(row.max(), abs=1e-5)
    special = set(tokenizer.get_added_tokens_decoder())
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")  # holding back a character's first bytes
    text = [decoder.decode(b"" if token in special else text_of.bytes(token)) for token in output]
    assert whole.text_offset == [len("".join(text[:i])) for i in range(8)]
    chunks = list(client.completions.create(**ask, stream=True))
    assert [chunk.choices[0].logprobs.tokens for chunk in chunks[:-1]] == [[token] for token in whole.tokens]
    assert [value for chunk in chunks[:-1] for value in chunk.choices[0].logprobs.token_logprobs] == \
        whole.token_logprobs
    assert chunks[-1].choices[0].logprobs is None and chunks[-1].choices[0].finish_reason == "length"


def test_echo_puts_the_prompt_and_its_log_probabilities_before_the_reply(client, reference, single):
    """`echo` with `logprobs`, as evaluation harnesses score a text: the prompt's text before the reply, and its
    tokens' log-probabilities (the first token's none) as the score gives them, within 1e-5; streamed, the prompt
    comes first, in a chunk of its own."""
    greedy, _, tokenizer = reference
    text_of = TokenText(tokenizer)
    prompt = "A fleet of ordinary computers can hold a model"
    ids = tokenizer.encode(prompt, add_special_tokens=False).ids
    output = greedy(ids, 3, stop=False)[1]
    ask = {"model": "tiny", "prompt": prompt, "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 2,
           "extra_body": {"ignore_eos": True}}
    choice = client.completions.create(**ask).choices[0]
    assert choice.text == prompt + tokenizer.decode(output, skip_special_tokens=True)
    logprobs = choice.logprobs
    assert logprobs.tokens == [text_of.text(token) for token in ids + output]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    rows = scored_log_softmax(single, ids, output)
    following = ids[1:] + output
    assert logprobs.token_logprobs[1:] == pytest.approx([row[t] for row, t in zip(rows, following)], abs=1e-5)
    assert [list(top)[:1] for top in logprobs.top_logprobs[1:]] == [[text_of.text(likeliest(row, 1)[0])]
                                                                   for row in rows]
    assert logprobs.text_offset[:len(ids)] == [len(tokenizer.decode(ids[:i])) for i in range(len(ids))]
    assert logprobs.text_offset[len(ids)] == len(prompt)
    chunks = list(client.completions.create(**ask, stream=True))
    assert chunks[0].choices[0].text == prompt and chunks[0].choices[0].logprobs.tokens == logprobs.tokens[:len(ids)]
    assert "".join(chunk.choices[0].text for chunk in chunks) == choice.text
    assert [value for chunk in chunks[:-1] for value in chunk.choices[0].logprobs.token_logprobs] == \
        logprobs.token_logprobs
    plain = client.completions.create(model="tiny", prompt=ids, max_tokens=3, temperature=0, echo=True,
                                      extra_body={"ignore_eos": True}).choices[0]
    assert plain.text == choice.text and plain.logprobs is None  # token ids echoed as their text


@pytest.mark.parametrize("path, body, param, message", [
    ("chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "less than or equal to 20"),
    ("chat/completions", {"top_logprobs": 2}, "top_logprobs", "top_logprobs: needs logprobs: true"),
    ("completions", {"logprobs": 21}, "logprobs", "less than or equal to 20"),
    ("completions", {"logprobs": True}, "logprobs", "how many of the likeliest tokens"),
    ("completions", {"top_logprobs": 2}, "top_logprobs", "is chat's field: completions take logprobs"),
    ("chat/completions", {"echo": True}, "echo", "echo is not supported by this server"),
    ("chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {
        "type": "bogus"}}}}, "response_format", "the schema cannot hold a reply: "),
    ("chat/completions", {"response_format": {"type": "json_schema"}}, "response_format",
     "json_schema is given with type json_schema"),
])
def test_impossible_log_probability_requests_are_refused(server, path, body, param, message):
    request = {"messages": MESSAGES} if path.startswith("chat") else {"prompt": [5, 9, 3]}
    response = httpx.post(f"{server.url}/v1/{path}", json=request | body, headers={"Authorization": f"Bearer {KEY}"},
                          timeout=30)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param and message in response.json()["error"]["message"]


def test_penalties_bias_and_min_tokens_change_the_reply_as_generate_does(spec, client, reference, single):
    """presence, frequency and repetition penalties, a logit bias and min_tokens (vLLM's fields), greedy and
    sampled, streamed or not: the reply `cascadia generate` makes with the same adjustments."""
    _, _, tokenizer = reference
    prompt = [5, 9, 3, 5, 9, 3, 5, 9]
    eos = tuple(sorted(spec.model.config.eos_ids))
    adjust = LogitAdjustments(len(prompt), 6, eos, ((9, 4.0), (17, -100.0)), 1.3, 0.7, 0.5)
    replies = []
    for sampling in (Sampling(adjust=adjust), Sampling(temperature=0.9, seed=5, adjust=adjust)):
        ids = generate(single, prompt, 12, sampling, stop_ids=eos).ids
        assert len(ids) >= 6 and 17 not in ids
        ask = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": sampling.temperature,
               "seed": sampling.seed, "presence_penalty": 0.5, "frequency_penalty": 0.7,
               "logit_bias": {"9": 4.0, "17": -100}, "extra_body": {"repetition_penalty": 1.3, "min_tokens": 6}}
        replies.append(reply := client.completions.create(**ask))
        assert reply.choices[0].text == tokenizer.decode(list(ids), skip_special_tokens=True)
        assert reply.usage.completion_tokens == len(ids)
        streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(**ask, stream=True))
        assert streamed == reply.choices[0].text
    plain = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
    assert plain.choices[0].text != replies[0].choices[0].text  # greedy: the adjustments changed it


@pytest.mark.parametrize("body, param, message", [
    ({"logit_bias": {"512": 1}}, "logit_bias", "beyond the vocabulary"),
    ({"logit_bias": {"5": 101}}, "logit_bias", "biases lie in -100..100"),
    ({"min_tokens": 9, "max_tokens": 8}, "min_tokens", "more than the 8 tokens asked for at most"),
    ({"presence_penalty": 2.5}, "presence_penalty", "less than or equal to 2"),
    ({"repetition_penalty": 0}, "repetition_penalty", "greater than 0"),
])
def test_impossible_adjustments_are_refused(server, body, param, message):
    response = httpx.post(f"{server.url}/v1/completions", json={"prompt": [5, 9, 3]} | body,
                          headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param and message in response.json()["error"]["message"]


ANSWER = {"type": "object", "properties": {"ok": {"type": "boolean"}, "size": {"enum": ["S", "M", "L"]},
                                          "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}},
          "required": ["ok", "size", "tags"], "additionalProperties": False}


def test_a_json_schema_holds_the_reply_streamed_or_not(client):
    """`response_format` with a JSON schema (strict), greedy and sampled, streamed or not: JSON that the schema
    validates (the jsonschema library's check), the same either way; on chat too; with `json_object`, a JSON
    object."""
    def json_schema(schema: dict) -> dict:
        return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}

    for temperature in (0, 1.0):
        ask = {"model": "tiny", "prompt": [5, 9, 3], "max_tokens": 48, "temperature": temperature, "seed": 3,
               "extra_body": {"response_format": json_schema(ANSWER)}}
        choice = client.completions.create(**ask).choices[0]
        assert choice.finish_reason == "stop", choice.text
        jsonschema.validate(json.loads(choice.text), ANSWER)
        assert "".join(c.choices[0].text for c in client.completions.create(**ask, stream=True)) == choice.text
    ok = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Well?"}],
                                          max_tokens=12, temperature=0, response_format=json_schema(ok))
    assert json.loads(chat.choices[0].message.content) in ({"ok": True}, {"ok": False})
    reply = client.completions.create(model="tiny", prompt="A fleet", max_tokens=56, temperature=0.7, seed=1,
                                      extra_body={"response_format": {"type": "json_object"}}).choices[0]
    if reply.finish_reason == "stop":
        assert isinstance(json.loads(reply.text), dict)
    else:  # cut by max_tokens: an object's beginning, and the finish says so
        assert reply.finish_reason == "length" and reply.text.startswith("{")


@st.composite
def schemas(draw, depth: int = 0):
    """Object schemas whose every reply is short: booleans, small enums, bounded integers, short strings, short
    arrays and (once) an object within."""
    kinds = [st.just({"type": "boolean"}), st.just({"type": "null"}),
             st.lists(st.sampled_from(["a", "b", 7, True]), min_size=1, max_size=3, unique=True).map(
                 lambda values: {"enum": values}),
             st.integers(-50, 50).map(lambda low: {"type": "integer", "minimum": low, "maximum": low + 9}),
             st.integers(0, 4).map(lambda most: {"type": "string", "maxLength": most, "pattern": "^[a-z]*$"}),
             st.integers(1, 2).map(lambda most: {"type": "array", "items": {"type": "boolean"}, "maxItems": most})]
    if depth == 0:
        kinds.append(schemas(depth=1))
    names = draw(st.lists(st.sampled_from(["a", "b", "c", "key"]), min_size=1, max_size=3, unique=True))
    properties = {name: draw(st.one_of(kinds)) for name in names}
    return {"type": "object", "properties": properties, "required": names, "additionalProperties": False}


@settings(max_examples=12, deadline=None)
@given(schema=schemas(), seed=st.integers(0, 2**31 - 1))
def test_every_finished_reply_validates_against_its_schema(client, schema, seed):
    """A property over generated schemas: a reply that finishes parses, and its schema validates it; one cut by
    max_tokens says `length`."""
    choice = client.completions.create(model="tiny", prompt="Answer:", max_tokens=56, temperature=1.0,
                                       seed=seed, extra_body={"response_format": {
                                           "type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}
                                       ).choices[0]
    if choice.finish_reason == "stop":
        jsonschema.validate(json.loads(choice.text), schema)
    else:
        assert choice.finish_reason == "length"


def test_thirty_two_streaming_clients_all_complete(server, reference):
    greedy, _, _ = reference

    async def one(client, i):
        prompt = [1 + i % 7, 2 + i % 5, 3 + i % 3]
        stream = await client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0,
                                                 stream=True)
        return prompt, "".join([c.choices[0].text async for c in stream if c.choices])

    async def all_of_them():
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)
        return await asyncio.gather(*(one(client, i) for i in range(32)))

    results = asyncio.run(all_of_them())
    assert len(results) == 32 and all(text == greedy(prompt, 8)[0] for prompt, text in results)


# ---- cancellation -------------------------------------------------------------------------------------------------
def stream_open(url: str, max_tokens: int, headers=None):
    """A raw streaming request: the response, open."""
    client = httpx.Client(timeout=60)
    body = {"prompt": [1, 2, 3], "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True}
    response = client.send(client.build_request("POST", f"{url}/v1/completions", headers=headers, json=body),
                           stream=True)
    return client, response


def status(url: str) -> dict:
    return httpx.get(f"{url}/status", timeout=10).json()


def wait_for(condition, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_client_that_goes_away_frees_its_slot_for_the_next(one_slot):
    first_client, first = stream_open(one_slot.url, 55)
    lines = first.iter_lines()
    assert next(line for line in lines if line.startswith("data:"))  # streaming: it holds the one slot
    second_client, second = stream_open(one_slot.url, 4)
    wait_for(lambda: status(one_slot.url)["waiting"] == 1)
    third = httpx.post(f"{one_slot.url}/v1/completions", json={"prompt": [1], "max_tokens": 2}, timeout=10)
    assert third.status_code == 429 and third.headers["retry-after"] == "1"
    assert third.json()["error"]["code"] == "rate_limit_exceeded"
    first.close()
    first_client.close()  # the client goes away mid-stream
    texts = [line for line in second.iter_lines() if line.startswith("data:")]
    assert texts[-1] == "data: [DONE]" and json.loads(texts[-2][5:])["choices"][0]["finish_reason"] == "length"
    second_client.close()
    wait_for(lambda: status(one_slot.url)["running"] == 0)


def test_cancel_by_id_ends_a_stream_with_its_reason(one_slot):
    client, response = stream_open(one_slot.url, 55)
    chunks = (json.loads(line[5:]) for line in response.iter_lines() if line.startswith("data: {"))
    completion_id = next(chunks)["id"]
    assert httpx.post(f"{one_slot.url}/v1/cancel/{completion_id}", timeout=10).json()["cancelled"]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "cancelled"
    client.close()
    assert httpx.post(f"{one_slot.url}/v1/cancel/{completion_id}", timeout=10).status_code == 404


# ---- bad input ----------------------------------------------------------------------------------------------------
BAD = [
    ({"content": b"{not json"}, 400, "not valid JSON"),
    ({"json": {"messages": MESSAGES, "bogus": 1}}, 400, "unknown parameter 'bogus'"),
    ({"json": {"messages": MESSAGES, "n": 17}}, 400, "n: 17 choices need as many stream slots at once, more than "
                                                      "this server's 16"),
    ({"json": {"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "f g"}}]}}, 400,
     "tools.0.function.name: String should match pattern"),
    ({"json": {"messages": MESSAGES, "temperature": 5}}, 400, "temperature"),
    ({"json": {"messages": []}}, 400, "messages"),
    ({"json": {"messages": MESSAGES, "max_tokens": 500}}, 400, "exceeds the context length of 64 positions"),
    ({"json": {"messages": MESSAGES, "model": "gpt-4"}}, 404, "no model named 'gpt-4'"),
    ({"json": {"messages": MESSAGES, "stop": ["a", "b", "c", "d", "e"]}}, 400, "at most 4 stop strings"),
    ({"content": b"{" + b" " * 70000 + b"}"}, 413, "over the limit of 65536 bytes"),
    ({"content": iter([b"{", b" " * 70000, b"}"])}, 413, "over the limit of 65536 bytes"),  # chunked, no length
]
# Lone UTF-16 surrogates, as json.dumps writes badly decoded text: in every text field, and in a key.
SURROGATE = "messages.0.content: a lone UTF-16 surrogate (U+D800 at character 0) is not text"
BAD += [({"content": json.dumps(body).encode()}, 400, message) for body, message in [
    ({"messages": [{"role": "user", "content": "\ud800"}]}, SURROGATE),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "ok \udfff"}]}]},
     "messages.0.content.0.text: a lone UTF-16 surrogate (U+DFFF at character 3) is not text"),
    ({"messages": [{"role": "user", "content": "hi", "name": "a\udc80"}]}, "messages.0.name: a lone UTF-16"),
    ({"messages": MESSAGES, "stop": ["fine", "\ud83d"]}, "stop.1: a lone UTF-16 surrogate (U+D83D at character 0)"),
    ({"messages": MESSAGES, "stop": "\ud83d"}, "stop: a lone UTF-16 surrogate"),
    ({"messages": MESSAGES, "model": "tiny\ud800"}, "model: a lone UTF-16 surrogate (U+D800 at character 4)"),
    ({"messages": MESSAGES, "user": "\ud800"}, "user: a lone UTF-16 surrogate"),
    ({"messages": MESSAGES, "\ud800": 1}, "a key of the body: a lone UTF-16 surrogate"),
]]


@pytest.mark.parametrize("request_kwargs, code, message", BAD)
def test_bad_requests_get_an_openai_error_and_a_4xx(server, request_kwargs, code, message):
    response = httpx.post(f"{server.url}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}",
                                                                        "Content-Type": "application/json"},
                          timeout=30, **request_kwargs)
    assert response.status_code == code, response.text
    error = response.json()["error"]
    assert message in error["message"] and error["type"]


def test_a_lone_surrogate_in_a_prompt_is_a_400_counted_as_rejected(server):
    def rejected() -> float:
        families = text_string_to_metric_families(httpx.get(f"{server.url}/metrics", timeout=10).text)
        samples = next(f for f in families if f.name == "cascadia_requests_rejected").samples
        return sum(s.value for s in samples if s.labels["reason"] == "invalid_request" and s.name.endswith("_total"))

    before = rejected()
    response = httpx.post(f"{server.url}/v1/completions", content=json.dumps({"prompt": "caf\udce9"}).encode(),
                          headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}, timeout=30)
    assert response.status_code == 400
    assert response.json()["error"] == {"message": "prompt: a lone UTF-16 surrogate (U+DCE9 at character 3) is not "
                                        "text", "type": "invalid_request_error", "param": "prompt", "code": None}
    assert rejected() == before + 1


# What chat front ends and SDK wrappers send on every request: defaults of fields this server does not serve, and
# fields that cannot change the tokens. Each is accepted, and the reply is the one without them.
AS_DEFAULTS = {"presence_penalty": 0, "frequency_penalty": 0.0, "logprobs": False, "top_logprobs": 0,
               "logit_bias": {}, "tools": [], "tool_choice": "none", "parallel_tool_calls": True,
               "response_format": {"type": "text"}, "n": 1, "top_k": -1, "min_p": 0, "repetition_penalty": 1.0,
               "min_tokens": 0, "skip_special_tokens": True, "metadata": {"run": "a"}, "store": False,
               "service_tier": "auto", "cache_prompt": True, "user": "someone", "seed": None, "modalities": ["text"],
               "chat_template_kwargs": {"enable_thinking": False}, "reasoning_effort": "low"}


def test_defaults_and_fields_without_effect_are_accepted(server, reference):
    greedy, chat_ids, _ = reference
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"messages": MESSAGES, "max_tokens": 8, "temperature": 0}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body | AS_DEFAULTS, headers=headers, timeout=30)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == greedy(chat_ids(MESSAGES), 8)[0]
    nulls = {"temperature": None, "top_p": None, "n": None, "stream": None, "stop": None, "ignore_eos": None}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body | AS_DEFAULTS | nulls | {"temperature": 0},
                          headers=headers, timeout=30)
    assert response.status_code == 200, response.text
    sampled = [httpx.post(f"{server.url}/v1/chat/completions", json=body | nulls | given, headers=headers,
                          timeout=30).json()["choices"][0]["message"]["content"]
               for given in ({"seed": 7}, {"seed": 7, "temperature": 1, "top_p": 1})]
    assert sampled[0] == sampled[1]  # null temperature and top_p: their defaults
    completion = {"prompt": [4, 5, 6], "max_tokens": 4, "temperature": 0, "echo": False, "best_of": 1, "suffix": None,
                  "logprobs": False}
    response = httpx.post(f"{server.url}/v1/completions", json=completion, headers=headers, timeout=30)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == greedy([4, 5, 6], 4)[0]
    assert response.json()["choices"][0]["logprobs"] is None


@pytest.mark.parametrize("path, field, value", [("chat/completions", "skip_special_tokens", False),
                                                ("completions", "tools", [WEATHER]),
                                                ("completions", "tool_choice", "required")])
def test_what_this_server_does_not_serve_is_refused_by_name(server, path, field, value):
    body = {"messages": MESSAGES} if path.startswith("chat") else {"prompt": [5, 9, 3]}
    response = httpx.post(f"{server.url}/v1/{path}", json=body | {field: value},
                          headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == field and error["message"].startswith(f"{field}: ") and "by this server" in \
        error["message"]


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(client, reference):
    greedy, _, _ = reference
    chunks = list(client.completions.create(model="tiny", prompt=[7, 8, 9], max_tokens=6, temperature=0, stream=True,
                                            stream_options={"include_usage": True, "continuous_usage_stats": True},
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == greedy([7, 8, 9], 6, stop=False)[0]
    counted = [(c.usage.prompt_tokens, c.usage.completion_tokens, c.usage.total_tokens) for c in chunks]
    assert counted[:6] == [(3, n, 3 + n) for n in range(1, 7)]  # one chunk a token, each counting it
    assert counted[6:] == [(3, 6, 9)] * 2  # the finish, and the usage chunk of include_usage (no choices)
    assert chunks[-1].choices == []
    alone = list(client.completions.create(model="tiny", prompt=[7, 8, 9], max_tokens=2, temperature=0, stream=True,
                                           stream_options={"continuous_usage_stats": True}))
    assert alone and all(c.usage is None for c in alone)  # as vLLM: only beside include_usage


CLIENT_REQUESTS = sorted((Path(__file__).parent / "fixtures" / "client_requests").glob("*.json"))


@pytest.mark.parametrize("recorded", CLIENT_REQUESTS, ids=lambda path: path.stem)
def test_the_bodies_real_clients_send_are_answered_in_shapes_they_parse(quick_start, recorded):
    """openai, LangChain, guidellm and aiperf, as recorded (tests/fixtures/client_requests/README.md): a 200, and a
    reply in the types of the openai client (strictly, but for the completion chunks' null finish reason, which
    OpenAI's own streams send too and its client reads without validating)."""
    body = json.loads(recorded.read_text())
    chat = "messages" in body
    response = httpx.post(f"{quick_start.url}/v1/{'chat/completions' if chat else 'completions'}", json=body,
                          timeout=60)
    assert response.status_code == 200, response.text
    if not body.get("stream"):
        reply = (openai.types.chat.ChatCompletion if chat else openai.types.Completion).model_validate(response.json())
        assert reply.choices[0].finish_reason in ("stop", "length") and reply.usage.completion_tokens > 0
        return
    events = [line[5:].strip() for line in response.text.splitlines() if line.startswith("data:")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    if chat:
        chunks = [openai.types.chat.ChatCompletionChunk.model_validate(c).model_dump() for c in chunks]
    assert all(c["object"] == ("chat.completion.chunk" if chat else "text_completion") for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] in ("stop", "length")
    if body.get("stream_options", {}).get("include_usage"):
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0
    if body.get("stream_options", {}).get("continuous_usage_stats"):  # guidellm's: usage on every chunk
        assert all(c["usage"] is not None for c in chunks)


def test_the_api_is_described_at_openapi_json_and_docs(server):
    described = httpx.get(f"{server.url}/openapi.json", timeout=10).json()
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/tokenize", "/detokenize"} <= \
        set(described["paths"])
    assert "messages" in described["components"]["schemas"]["ChatRequest"]["properties"]
    page = httpx.get(f"{server.url}/docs", timeout=10)
    assert page.status_code == 200 and "swagger" in page.text.lower()


def test_tokenize_and_detokenize_as_vllm_and_llama_server_serve_them(server, reference):
    _, chat_ids, tokenizer = reference
    text = "A fleet of ordinary computers"
    ids = tokenizer.encode(text, add_special_tokens=False).ids  # what /v1/completions feeds the model

    def post(path: str, body: dict) -> httpx.Response:
        return httpx.post(f"{server.url}{path}", json=body, timeout=10)

    assert post("/tokenize", {"model": "tiny", "prompt": text}).json() == {"count": len(ids), "max_model_len": 64,
                                                                          "tokens": ids}
    assert post("/tokenize", {"content": text}).json()["tokens"] == ids  # llama-server's field
    assert post("/tokenize", {"messages": MESSAGES}).json()["tokens"] == chat_ids(MESSAGES)
    assert post("/detokenize", {"tokens": ids}).json() == {"prompt": text, "content": text}
    for path, body, code, message in [("/tokenize", {}, 400, "give one of prompt, content or messages, not none"),
                                      ("/tokenize", {"prompt": "a", "content": "b"}, 400, "not prompt and content"),
                                      ("/tokenize", {"prompt": "a", "model": "x"}, 404, "no model named 'x'"),
                                      ("/detokenize", {"tokens": [10**6]}, 400, "token id 1000000 is beyond"),
                                      ("/detokenize", {"tokens": [-1]}, 400, "token ids are integers >= 0")]:
        response = post(path, body)
        assert response.status_code == code and message in response.json()["error"]["message"], response.text


def test_the_responses_api_gives_the_chat_endpoints_tokens(client, reference):
    """`client.responses.create`, whole and streamed: the instructions and input are the chat's messages."""
    greedy, chat_ids, _ = reference
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]
    expected = greedy(chat_ids(messages), 6)[0]
    whole = client.responses.create(model="tiny", instructions="Be brief.", input="Hello!", max_output_tokens=6,
                                    temperature=0, store=False)
    assert whole.output_text == expected and whole.id.startswith("resp_")
    assert whole.status in ("completed", "incomplete") and whole.usage.input_tokens == len(chat_ids(messages))
    assert (whole.status == "incomplete") == (whole.usage.output_tokens == 6)
    items = [{"role": "system", "content": "Be brief."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hello!"}]}]
    events = list(client.responses.create(model="tiny", input=items, max_output_tokens=6, temperature=0,
                                          stream=True))
    kinds = [event.type for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[-1] == ("response.incomplete" if whole.status == "incomplete" else "response.completed")
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    assert "".join(deltas) == expected == events[-1].response.output_text
    assert [event.sequence_number for event in events] == list(range(1, len(events) + 1))
    with client.responses.stream(model="tiny", input="Hello!", instructions="Be brief.", max_output_tokens=6,
                                 temperature=0) as stream:  # the SDK's helper, which rebuilds the response as it goes
        helped = [event for event in stream]
    assert "".join(e.delta for e in helped if e.type == "response.output_text.delta") == expected
    assert [e.type for e in helped] == kinds


def test_the_responses_api_holds_its_text_to_a_json_schema(client):
    """`text.format` json_schema: the response's text is JSON the schema validates, and the response says so."""
    ok = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}
    response = client.responses.create(model="tiny", input="Well?", max_output_tokens=12, temperature=0,
                                       text={"format": {"type": "json_schema", "name": "answer", "schema": ok,
                                                        "strict": True}})
    jsonschema.validate(json.loads(response.output_text), ok)
    assert response.text.format.type == "json_schema" and response.text.format.name == "answer"
    bad = httpx.post(f"{client.base_url}responses", json={"input": "hi", "text": {"format": {
        "type": "json_schema", "name": "a", "schema": {"type": "bogus"}}}}, headers={"Authorization": f"Bearer {KEY}"},
        timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "text"


def test_the_responses_api_refuses_what_it_does_not_serve_by_name(server):
    for body, message in [({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id: responses are "
                                                                               "not stored by this server"),
                          ({"input": "hi", "tools": [{"type": "function", "name": "f"}]}, "tools: tool calls"),
                          ({"input": [{"role": "tool", "content": "x"}]}, "input"),
                          ({"input": "hi", "max_output_tokens": 500}, "exceeds the context length of 64")]:
        response = httpx.post(f"{server.url}/v1/responses", json=body, headers={"Authorization": f"Bearer {KEY}"},
                              timeout=30)
        assert response.status_code == 400 and message in response.json()["error"]["message"], response.text


def streamed_calls(chunks) -> tuple[list[dict], str | None]:
    """The calls a stream's tool-call deltas make up (by index, as the openai client joins them), and its finish."""
    calls: dict[int, dict] = {}
    for chunk in chunks:
        for delta in chunk.choices[0].delta.tool_calls or () if chunk.choices else ():
            call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
            call["name"] += delta.function.name or ""
            call["arguments"] += delta.function.arguments or ""
    finish = [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1]
    return [calls[i] for i in sorted(calls)], finish


@pytest.fixture(scope="module")
def llama_calls(tmp_path_factory):
    """The quick start's server over its checkpoint with a chat template that writes Llama 3.1's JSON calls
    (tests/fixtures/chat_templates/llama3_json.jinja)."""
    folder = tmp_path_factory.mktemp("serve-llama-calls")
    copied = folder / "checkpoint"
    copied.mkdir()
    for path in TRAINED.iterdir():
        if path.name != "tokenizer_config.json":
            (copied / path.name).symlink_to(path)
    config = json.loads((TRAINED / "tokenizer_config.json").read_text())
    config["chat_template"] = (Path(__file__).parent / "fixtures" / "chat_templates" / "llama3_json.jinja").read_text()
    (copied / "tokenizer_config.json").write_text(json.dumps(config))
    served = Served(folder, SPEC.parent / "tiny-serve.yaml", copied)
    yield served
    assert served.stop() == 0


@pytest.mark.parametrize("served", ["quick_start", "llama_calls"], ids=["hermes", "llama3_json"])
def test_a_forced_tool_call_follows_its_function_streamed_or_not(request, served):
    """tool_choice naming a function, or `required`: the reply is calls whose arguments parse and follow the
    function's parameters (jsonschema), finish reason `tool_calls`; streamed, the deltas make up the same calls;
    the calls and a tool's answer sent back are a chat the template renders. In the format the checkpoint's chat
    template writes: Hermes' `<tool_call>` blocks, or Llama 3.1's JSON."""
    url = request.getfixturevalue(served).url
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
    parameters = {tool["function"]["name"]: tool["function"]["parameters"] for tool in (WEATHER, CLOCK)}
    for choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
        ask = {"model": "tiny", "messages": ASK, "tools": [WEATHER, CLOCK], "tool_choice": choice,
               "parallel_tool_calls": False, "max_tokens": 96, "temperature": 0}
        reply = client.chat.completions.create(**ask).choices[0]
        assert reply.finish_reason == "tool_calls" and len(reply.message.tool_calls) == 1
        [call] = reply.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        if choice != "required":
            assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), parameters[call.function.name])
        calls, finish = streamed_calls(list(client.chat.completions.create(**ask, stream=True)))
        assert finish == "tool_calls"
        assert calls == [{"name": call.function.name, "arguments": call.function.arguments}]
    answered = client.chat.completions.create(model="tiny", max_tokens=4, temperature=0, tools=[WEATHER], messages=[
        *ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "clear"}'}])
    assert answered.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize("served", ["quick_start", "llama_calls"], ids=["hermes", "llama3_json"])
def test_parallel_tool_calls_may_come_several(request, served):
    url = request.getfixturevalue(served).url
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
    reply = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER, CLOCK], tool_choice="required",
                                           max_tokens=200, temperature=1.0, seed=7).choices[0]
    if reply.finish_reason == "tool_calls":
        assert reply.message.tool_calls and all(c.function.name in ("get_weather", "get_time")
                                                for c in reply.message.tool_calls)
    else:
        assert reply.finish_reason == "length"


def test_the_messages_api_calls_tools_as_anthropics_clients_expect(quick_start):
    """Anthropic's tools and tool_choice: a forced call comes as a tool_use block whose input follows the tool's
    input_schema, stop_reason tool_use, streamed as the SDK rebuilds it (an input_json_delta); sent back with a
    tool_result, the chat goes on."""
    client = anthropic.Anthropic(base_url=quick_start.url, api_key="none", max_retries=0, timeout=60)
    weather = {"name": "get_weather", "description": "The weather in a city",
               "input_schema": WEATHER["function"]["parameters"]}
    clock = {"name": "get_time", "input_schema": CLOCK["function"]["parameters"]}
    ask = {"model": "tiny", "max_tokens": 96, "extra_body": {"temperature": 0}, "tools": [weather, clock],
           "messages": ASK}
    for choice in ({"type": "tool", "name": "get_weather"}, {"type": "any", "disable_parallel_tool_use": True}):
        message = client.messages.create(**ask, tool_choice=choice)
        assert message.stop_reason == "tool_use"
        [use] = [block for block in message.content if block.type == "tool_use"]
        assert use.id.startswith("toolu_") and (choice["type"] == "any" or use.name == "get_weather")
        jsonschema.validate(use.input, {"get_weather": weather, "get_time": clock}[use.name]["input_schema"])
        with client.messages.stream(**ask, tool_choice=choice) as stream:
            streamed = stream.get_final_message()
        assert streamed.stop_reason == "tool_use"
        assert [(b.name, b.input) for b in streamed.content if b.type == "tool_use"] == [(use.name, use.input)]
    answered = client.messages.create(model="tiny", max_tokens=4, tools=[weather], messages=[
        *ASK, {"role": "assistant", "content": [{"type": "tool_use", "id": use.id, "name": use.name,
                                                  "input": use.input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": '{"sky": "clear"}'}]}])
    assert answered.stop_reason in ("end_turn", "max_tokens", "tool_use")


@pytest.mark.parametrize("body, param, message", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "launch"}}}, "tool_choice",
     "no tool named 'launch' is given"),
    ({"tool_choice": "required"}, "tool_choice", "required needs tools"),
    ({"messages": [*ASK, {"role": "tool", "tool_call_id": "call_1", "content": "x"}]}, "messages.1.tool_call_id",
     "answers no call"),
    ({"messages": [*ASK, {"role": "tool", "content": "x"}]}, "messages.1",
     "a tool message gives the tool_call_id"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "two functions share a name"),
    ({"messages": [*ASK, {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "get_weather", "arguments": "{oops"}}]}]}, "messages.1.tool_calls.0.function.arguments",
     "is not JSON"),
])
def test_malformed_tool_requests_are_refused(quick_start, body, param, message):
    response = httpx.post(f"{quick_start.url}/v1/chat/completions", json={"messages": ASK} | body, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param and message in response.json()["error"]["message"]


@pytest.fixture(scope="module")
def anthropic_client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=60)


GREEDY = {"temperature": 0}  # not a parameter of Anthropic's SDK any more; older clients send it


def test_the_messages_api_gives_the_chat_endpoints_tokens(anthropic_client, reference):
    """Anthropic's `client.messages.create`, whole and streamed, and its token count: the system prompt and the
    messages are the chat's."""
    greedy, chat_ids, _ = reference
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]
    expected, ids = greedy(chat_ids(chat), 6)
    whole = anthropic_client.messages.create(model="tiny", system="Be brief.", max_tokens=6, extra_body=GREEDY,
                                             messages=[{"role": "user", "content": "Hello!"}],
                                             metadata={"user_id": "a"})
    assert whole.content[0].text == expected and whole.id.startswith("msg_") and whole.role == "assistant"
    assert whole.stop_reason == ("max_tokens" if len(ids) == 6 else "end_turn") and whole.stop_sequence is None
    assert (whole.usage.input_tokens, whole.usage.output_tokens) == (len(chat_ids(chat)), len(ids))
    blocks = {"system": [{"type": "text", "text": "Be ", "cache_control": {"type": "ephemeral"}},
                         {"type": "text", "text": "brief."}],
              "messages": [{"role": "user", "content": [{"type": "text", "text": "Hello!"}]}]}
    events = list(anthropic_client.messages.create(model="tiny", max_tokens=6, stream=True, extra_body=GREEDY,
                                                   **blocks))
    kinds = [event.type for event in events]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) <= {"content_block_delta"}
    assert "".join(event.delta.text for event in events if event.type == "content_block_delta") == expected
    assert events[-2].delta.stop_reason == whole.stop_reason and events[-2].usage.output_tokens == len(ids)
    with anthropic_client.messages.stream(model="tiny", max_tokens=6, extra_body=GREEDY, **blocks) as stream:
        assert "".join(stream.text_stream) == expected  # the SDK's helper, which rebuilds the message as it goes
        assert stream.get_final_message().content[0].text == expected
    counted = anthropic_client.messages.count_tokens(model="tiny", **blocks)
    assert counted.input_tokens == len(chat_ids(chat))


def test_the_messages_api_draws_within_top_k(anthropic_client, reference):
    """Anthropic's `top_k`: 1 leaves a sampled draw one token, the greedy one."""
    greedy, chat_ids, _ = reference
    user = [{"role": "user", "content": "Hello!"}]
    message = anthropic_client.messages.create(model="tiny", max_tokens=6, messages=user,
                                               extra_body={"temperature": 1, "top_k": 1})
    assert message.content[0].text == greedy(chat_ids(user), 6)[0]


def test_a_stop_sequence_ends_the_message_and_is_named(anthropic_client, reference):
    greedy, chat_ids, _ = reference
    text, _ = greedy(chat_ids([{"role": "user", "content": "Measure first."}]), 16)
    stop = text[len(text) // 2:len(text) // 2 + 2]
    message = anthropic_client.messages.create(model="tiny", max_tokens=16, stop_sequences=["\x00", stop],
                                               messages=[{"role": "user", "content": "Measure first."}],
                                               extra_body=GREEDY)
    assert message.content[0].text == text[:text.find(stop)]
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", stop)


def test_a_prefill_is_continued_by_both_apis(client, anthropic_client, reference):
    """A final assistant message (Anthropic's prefill, vLLM's `continue_final_message`) is the start of the reply:
    the prompt is the chat's up to the assistant's turn, then that text; the reply holds only what follows."""
    greedy, chat_ids, tokenizer = reference
    user = [{"role": "user", "content": "Hello!"}]
    prompt = chat_ids(user) + tokenizer.encode("The answer is", add_special_tokens=False).ids
    expected, _ = greedy(prompt, 6)
    prefilled = user + [{"role": "assistant", "content": "The answer is"}]
    message = anthropic_client.messages.create(model="tiny", max_tokens=6, messages=prefilled, extra_body=GREEDY)
    assert message.content[0].text == expected and message.usage.input_tokens == len(prompt)
    assert anthropic_client.messages.count_tokens(model="tiny", messages=prefilled).input_tokens == len(prompt)
    reply = client.chat.completions.create(model="tiny", messages=prefilled, max_tokens=6, temperature=0,
                                           extra_body={"continue_final_message": True})
    assert reply.choices[0].message.content == expected and reply.usage.prompt_tokens == len(prompt)


def test_the_messages_api_refuses_in_its_own_shape(server, anthropic_client):
    """Errors on /v1/messages are Anthropic's, naming the field; the key may be a bearer token too."""
    user = [{"role": "user", "content": "hi"}]
    for body, status, kind, message in [
            ({"messages": user}, 400, "invalid_request_error", "max_tokens: Field required"),
            ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                                          "content": "12:00"}]}], "max_tokens": 4}, 400,
             "invalid_request_error", "messages.0.content.0.tool_use_id: 'toolu_1' answers no tool_use block"),
            ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}],
              "max_tokens": 4}, 400, "invalid_request_error",
             "messages.0.content.0: a user message holds no tool_use blocks"),
            ({"messages": user, "max_tokens": 4, "tool_choice": {"type": "any"}}, 400, "invalid_request_error",
             "tool_choice: any needs tools"),
            ({"messages": user, "max_tokens": 4, "tools": [{"name": "f", "input_schema": {}}],
              "tool_choice": {"type": "tool", "name": "g"}}, 400, "invalid_request_error",
             "tool_choice: no tool named 'g' is given"),
            ({"max_tokens": 4, "messages": [{"role": "user", "content": [
                {"type": "image", "source": {"type": "url", "url": "http://127.0.0.1/a.png"}}]}]}, 400,
             "invalid_request_error", "messages.0.content.0: image blocks are not supported by this server"),
            ({"messages": user, "max_tokens": 4, "temperature": 1.5}, 400, "invalid_request_error",
             "temperature: Input should be less than or equal to 1"),
            ({"messages": user, "max_tokens": 500}, 400, "invalid_request_error", "exceeds the context length of 64"),
            ({"messages": user, "max_tokens": 4, "model": "claude"}, 404, "not_found_error", "no model named")]:
        response = httpx.post(f"{server.url}/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=30)
        error = response.json()
        assert (response.status_code, error["type"], error["error"]["type"]) == (status, "error", kind), response.text
        assert message in error["error"]["message"], response.text
    response = httpx.post(f"{server.url}/v1/messages", json={"messages": user}, headers={"x-api-key": "wrong"})
    assert response.status_code == 401 and response.json()["error"]["type"] == "authentication_error"
    response = httpx.post(f"{server.url}/v1/messages", json={"messages": user, "system": "x" * 70_000},
                          headers={"x-api-key": KEY})  # over --max-body
    assert response.status_code == 413 and response.json()["error"]["type"] == "request_too_large"
    response = httpx.post(f"{server.url}/v1/messages/count_tokens", json={"messages": user},
                          headers={"Authorization": f"Bearer {KEY}"})
    assert response.status_code == 200 and response.json()["input_tokens"] > 0
    with pytest.raises(anthropic.BadRequestError) as info:
        anthropic_client.messages.create(model="tiny", max_tokens=4, messages=user, thinking={"type": "enabled",
                                                                                             "budget_tokens": 1024})
    assert info.value.body["error"]["message"] == "thinking: extended thinking is not supported by this server"


def test_the_context_length_error_has_its_openai_code(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt=[1] * 60, max_tokens=10)
    assert info.value.code == "context_length_exceeded"


def test_without_the_api_key_requests_get_401(server):
    response = httpx.get(f"{server.url}/v1/models", timeout=10)
    assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server.url}/health", timeout=10).json() == {"status": "ok"}  # health stays open


# ---- `cascadia run --url`: the load generator ---------------------------------------------------------------------
@pytest.mark.parametrize("levels", [["--concurrency", "1,3"], ["--rate", "20", "--slo", "ttft=10s,tpot=2s"]])
def test_run_url_reports_the_workload_in_the_run_schema(server, tmp_path, levels):
    (tmp_path / "key").write_text(KEY + "\n")
    out = tmp_path / "load.json"
    result = CliRunner().invoke(cli, ["run", str(SPEC), "--url", server.url, "--api-key-file", str(tmp_path / "key"),
                                      *levels, "--requests", "6", "--max-new-tokens", "5", "--json", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["source"] == "run" and len(report["levels"]) == len(levels[1].split(","))
    for level in report["levels"]:
        assert (level["requests"], level["output_tokens"]) == (6, 30), level  # the workload ignores EOS
        assert 0 < level["ttft_s"]["p50"] <= level["ttft_s"]["p99"] and level["decode_tokens_per_s"] > 0
        assert set(level["busy"]) == {"node0", "node1", "node2"}  # from the server's /status
    if "--slo" in levels:
        assert 0 <= report["levels"][0]["goodput"]["fraction"] <= 1


def test_run_url_asks_for_a_workloads_choices_as_n_and_times_each(server, tmp_path):
    """`workload.choices: 2`: each request asks for two choices (`n`), and each choice is a stream of the report,
    its tokens timed by its own chunks."""
    (tmp_path / "key").write_text(KEY + "\n")
    (tmp_path / "spec.yaml").write_text(f"include: {SPEC}\nworkload: {{choices: 2, greedy: false, temperature: 1.0}}\n")
    out = tmp_path / "load.json"
    result = CliRunner().invoke(cli, ["run", str(tmp_path / "spec.yaml"), "--url", server.url, "--api-key-file",
                                      str(tmp_path / "key"), "--concurrency", "2", "--requests", "3",
                                      "--max-new-tokens", "5", "--json", str(out)])
    assert result.exit_code == 0, result.output
    [level] = json.loads(out.read_text())["levels"]
    assert (level["requests"], level["output_tokens"]) == (6, 30), level
    assert "each of 2 choices of its prompt (computed once)" in result.output


def test_run_url_names_a_server_it_cannot_reach(tmp_path):
    result = CliRunner().invoke(cli, ["run", str(SPEC), "--url", f"http://127.0.0.1:{free_port()}",
                                      "--concurrency", "1", "--requests", "1", "--max-new-tokens", "2"])
    assert result.exit_code != 0 and "cannot list the server's models" in result.output
    assert "Traceback" not in result.output


def test_run_url_refuses_the_options_of_a_local_pipeline(server):
    result = CliRunner().invoke(cli, ["run", str(SPEC), "--url", server.url, "--groups", "2"])
    assert result.exit_code == 2 and "--groups" in result.output


# ---- metrics and status -----------------------------------------------------------------------------------------
def test_metrics_parse_with_prometheus_own_parser(server, client):
    client.completions.create(model="tiny", prompt=[4, 5], max_tokens=3, temperature=0)
    client.completions.create(model="tiny", prompt=[4, 5], max_tokens=16, temperature=0,
                              extra_body={"response_format": {"type": "json_schema", "json_schema": {
                                  "name": "a", "schema": {"enum": [True, False]}}}})
    assert httpx.get(f"{server.url}/v1/models", timeout=10).status_code == 401
    wait_for(lambda: all(s["busy"] is not None for s in status(server.url)["stages"]))
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text)}
    assert families["cascadia_generated_tokens"].samples[0].value > 0
    assert {s.labels["node"] for s in families["cascadia_node_busy_ratio"].samples} == {"node0", "node1", "node2"}
    for name in ("cascadia_requests_running", "cascadia_requests_waiting", "cascadia_time_to_first_token_seconds",
                 "cascadia_time_per_output_token_seconds", "cascadia_requests_rejected", "cascadia_ready"):
        assert name in families
    rejected = {s.labels["reason"]: s.value for s in families["cascadia_requests_rejected"].samples
                if s.name.endswith("_total")}
    assert rejected["unauthorized"] >= 1
    structured = {(s.labels["format"], s.labels["finish_reason"]): s.value
                  for s in families["cascadia_structured_requests"].samples if s.name.endswith("_total")}
    assert structured[("json_schema", "stop")] >= 1
    assert [s.value for s in families["cascadia_draft_tokens_proposed"].samples if s.name.endswith("_total")] == [0]


def test_status_names_every_stage_and_node(server):
    body = status(server.url)
    assert [s["node"] for s in body["stages"]] == ["node0", "node1", "node2"] and body["ready"]
    assert body["stages"][0]["layers"] == [0, 1] and body["stages"][-1]["roles"] == ["layers", "head"]
    assert body["stages"][0]["machine"] == {"address": "local", "device": "auto", "memory": 2**30,
                                            "memory_bandwidth": None, "compute": None, "disk_bandwidth": None}
    assert body["spares"] == []


@pytest.mark.parametrize("deadline, finish", [("30", "length"), ("0", "cancelled")])
def test_the_server_stops_on_sigterm_and_leaves_no_process(tmp_path, checkpoint, deadline, finish):
    """Open streams may finish within the shutdown deadline, and are cancelled after it."""
    served = Served(tmp_path, SPEC, checkpoint, "--shutdown-timeout", deadline)
    nodes = served.children()
    client, response = stream_open(served.url, 55)
    lines = response.iter_lines()
    next(line for line in lines if line.startswith("data:"))
    served.process.send_signal(signal.SIGTERM)
    wait_for(lambda: httpx.get(f"{served.url}/health", timeout=10).status_code == 503)  # no new requests
    rest = [line for line in lines if line.startswith("data:")]
    assert rest[-1] == "data: [DONE]" and json.loads(rest[-2][5:])["choices"][0]["finish_reason"] == finish
    client.close()
    assert served.process.wait(60) == 0
    assert len(nodes) == 3 and not any(alive(pid) for pid in nodes)


def test_a_second_signal_ends_open_streams_with_an_error_and_exits_1(tmp_path, checkpoint):
    """Ctrl-C twice under load: every open stream ends with an error event, one line says so, exit status 1."""
    served = Served(tmp_path, SPEC, checkpoint, "--stall-timeout", "600")
    nodes = served.children()
    opened = [stream_open(served.url, 55) for _ in range(3)]
    for path, body in [("/v1/responses", {"input": "Hi", "max_output_tokens": 30, "stream": True}),
                       ("/v1/messages", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 30,
                                         "stream": True})]:  # and a stream of the Responses and Messages APIs
        other = httpx.Client(timeout=60)
        opened.append((other, other.send(other.build_request("POST", f"{served.url}{path}", json=body), stream=True)))
    streams = [response.iter_lines() for _, response in opened]
    for lines in streams:
        next(line for line in lines if line.startswith("data:"))
    for pid in nodes:  # the pipeline stands still: no stream can finish before the second signal
        os.kill(pid, signal.SIGSTOP)
    served.process.send_signal(signal.SIGINT)
    wait_for(lambda: httpx.get(f"{served.url}/health", timeout=10).status_code == 503)  # draining
    served.process.send_signal(signal.SIGINT)
    for lines in streams[:3]:
        last = [line for line in lines if line.startswith("data:")][-1]
        assert json.loads(last[5:])["error"]["message"] == "the server was stopped before the request finished"
    last = json.loads([line for line in streams[3] if line.startswith("data:")][-1][5:])
    assert (last["type"], last["message"]) == ("error", "the server was stopped before the request finished")
    lines = list(streams[4])
    assert lines[-3:-1] == ["event: error", 'data: {"type": "error", "error": {"type": "overloaded_error", '
                                            '"message": "the server was stopped before the request finished"}}']
    for client, _ in opened:
        client.close()
    for pid in nodes:  # going on, they stop when told (else they are killed after SHUTDOWN_S)
        os.kill(pid, signal.SIGCONT)
    assert served.process.wait(60) == 1
    log = served.log.read_text()
    assert log.splitlines()[-1] == "Error: stopped at once by a second signal: 5 open requests ended with an error"
    assert "Traceback" not in log
    assert len(nodes) == 3 and not any(alive(pid) for pid in nodes)

