"""`cascadia serve` losing a node: the chaos test (3 local nodes and a spare; kill -9 a stage's node at a random
moment under 24 streaming clients, greedy and sampled, six of them asking two choices, a random stage then each in
turn; every request completes
with the tokens of the single-process engine, but for f32 rounding at a sampled draw: `assert_the_engines_texts`),
a frozen node (SIGSTOP) caught by the stall timeout and started again, a tcp spare taking a stage and then the
survivors taking the model over with a new plan, tcp nodes whose stage is down (no spare, no room to re-plan)
until a node comes back, and a restarted server taking `--keep-serving` nodes back as they are."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import attrs
import httpx
import numpy as np
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serving import Served, alive, scored_log_softmax

from cascadia.engine.checkpoint import Checkpoint
from cascadia.engine.engine import Engine
from cascadia.engine.generate import generate
from cascadia.graph.planner import InfeasiblePlan
from cascadia.graph.planner import plan as make_plan
from cascadia.pipeline.run import Addresses
from cascadia.pipeline.transport import free_port, tcp_address
from cascadia.grammar import json_grammar, vocabulary
from cascadia.sampling import LogitAdjustments, Sampling
from cascadia.spec.dump import write_spec
from cascadia.spec.types import PAPER_FORMATS, WeightFormat, WeightFormats
from cascadia.tokenizer import load_tokenizer

SPEC = Path(__file__).parent.parent / "specs" / "tiny-local.yaml"
STREAMS, TOKENS = 24, 40
WAIT_S = 60


def prompt(i: int) -> list[int]:
    return [1 + i % 7, 2 + i % 5, 3 + i % 3, 4 + i % 11]


def choices(i: int) -> int:
    """Every fourth client (from client 3: sampled) asks for two choices of its prompt, which the nodes compute once
    and fork; a replay rebuilds each on its own."""
    return 2 if i % 4 == 3 else 1


def sampling(i: int, eos: tuple[int, ...] = (), choice: int = 0) -> Sampling:
    """Even clients greedy, odd ones sampled with a seed of their own (a further choice with the next seed); every
    third (from client 1) with its logits changed by its tokens so far (penalties, a bias, min_tokens holding `eos`
    back), every sixth (from client 5) held to any JSON object: state the last stage rebuilds in a replay."""
    drawn = Sampling() if i % 2 == 0 else Sampling(temperature=1.0, top_p=0.9, seed=i + choice, top_k=50, min_p=0.01)
    if i % 3 == 1:
        return attrs.evolve(drawn, adjust=LogitAdjustments(len(prompt(i)), 5, eos, ((7 + i, 2.0),), 1.2, 0.3, 0.2))
    if i % 6 == 5:
        return attrs.evolve(drawn, adjust=LogitAdjustments(len(prompt(i)), grammar=json_grammar(None)))
    return drawn


def engine_tokens(engine: Engine, spec, checkpoint: Path, i: int, choice: int) -> list[int]:
    """The tokens of client i's choice from the single-process engine."""
    cfg = spec.model.config
    return list(generate(engine, prompt(i), TOKENS, sampling(i, tuple(sorted(cfg.eos_ids)), choice),
                         vocabulary=vocabulary(checkpoint, cfg.output_vocab_size, cfg.eos_ids)).ids)


EVERY_CHOICE = [(i, choice) for i in range(STREAMS) for choice in range(choices(i))]


def engine_texts(spec, checkpoint: Path) -> list[str]:
    """Every client's texts (one per choice, in `EVERY_CHOICE`'s order), from the single-process engine."""
    engine = Engine(Checkpoint.open(checkpoint), spec.runtime, formats=spec.model.formats, threads=1)
    tokenizer = load_tokenizer(checkpoint)
    return [tokenizer.decode(engine_tokens(engine, spec, checkpoint, i, choice), skip_special_tokens=True)
            for i, choice in EVERY_CHOICE]


@pytest.fixture(scope="module")
def expected(spec, checkpoint) -> list[str]:
    return engine_texts(spec, checkpoint)


@pytest.fixture(scope="module")
def expected_logprobs(spec, checkpoint) -> list[list[float]]:
    """Each choice's tokens' log-probabilities, as `cascadia score` gives them on the single-process engine."""
    engine = Engine(Checkpoint.open(checkpoint), spec.runtime, formats=spec.model.formats, threads=1)
    logprobs = []
    for i, choice in EVERY_CHOICE:
        ids = engine_tokens(engine, spec, checkpoint, i, choice)
        rows = scored_log_softmax(engine, prompt(i), ids)[len(prompt(i)) - 1:]
        logprobs.append([row[token] for row, token in zip(rows, ids)])
    return logprobs


async def stream_all(url: str, during=None, model: str = "tiny", logprobs: bool = False) -> list:
    """STREAMS streaming completions at once, each choice's text (with `logprobs`: and its tokens'
    log-probabilities) in `EVERY_CHOICE`'s order; `during` runs once the first tokens came."""
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    first = asyncio.Event()

    async def one(i: int) -> list:
        drawn = sampling(i)
        options = {"temperature": 0} if drawn.greedy else {"temperature": drawn.temperature, "top_p": drawn.top_p,
                                                             "seed": drawn.seed}
        limits = {} if drawn.greedy else {"top_k": drawn.top_k, "min_p": drawn.min_p}
        if drawn.adjust is not None and drawn.adjust.grammar is not None:
            limits |= {"response_format": {"type": "json_object"}}
        elif (adjust := drawn.adjust) is not None:
            limits |= {"presence_penalty": adjust.presence_penalty, "frequency_penalty": adjust.frequency_penalty,
                       "repetition_penalty": adjust.repetition_penalty, "min_tokens": adjust.min_tokens,
                       "logit_bias": dict(adjust.logit_bias)}
        stream = await client.completions.create(model=model, prompt=prompt(i), max_tokens=TOKENS, stream=True,
                                                 logprobs=2 if logprobs else None, n=choices(i),
                                                 extra_body={"ignore_eos": True, **limits}, **options)
        texts, values = [""] * choices(i), [[] for _ in range(choices(i))]
        async for chunk in stream:
            first.set()
            for choice in chunk.choices:
                texts[choice.index] += choice.text
                values[choice.index] += choice.logprobs.token_logprobs if choice.logprobs else []
        return list(zip(texts, values)) if logprobs else texts

    async with client:
        tasks = [asyncio.create_task(one(i)) for i in range(STREAMS)]
        if during is not None:
            await first.wait()
            await during()
        return [each for one_client in await asyncio.gather(*tasks) for each in one_client]


def metric(url: str, name: str) -> dict:
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text)}
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for s in families[name].samples}


def node_pids(served: Served) -> dict[str, int]:
    """The server's node processes, by their --name."""
    by_name = {}
    for pid in served.children():
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        by_name[args[args.index(b"--name") + 1].decode()] = pid
    return by_name


def stage_nodes(url: str) -> list[str]:
    """The nodes that serve the stages now, in stage order."""
    return [stage["node"] for stage in httpx.get(f"{url}/status", timeout=10).json()["stages"]]


def standing_by(url: str) -> list[str]:
    return httpx.get(f"{url}/status", timeout=10).json()["standing_by"]


def assert_the_engines_texts(texts: list[str], expected: list[str]) -> None:
    """Every choice's text, greedy or sampled, is the single-process engine's: a replay computes each row of a stream
    bit for bit as its decode step did, whatever else its calls hold (tests/test_row_invariance.py), and a draw
    depends only on the stream's seed and tokens. (Before the engine computed a row independently of its call, a
    sampled stream could part at f32 rounding, about one run in twenty.)"""
    assert texts == expected, [i for i in range(len(expected)) if texts[i] != expected[i]]


def test_a_node_killed_at_a_random_moment_costs_no_request_and_no_token(tmp_path, spec, checkpoint, expected,
                                                                        expected_logprobs):
    """Three local nodes and a spare: the node of a stage picked at random is killed at a random moment, then that of
    each stage in turn. The node standing by takes the stage each time, and the lost one, started again, stands by
    for the next. The first time, every token comes with its log-probability: the score's, replayed or not."""
    spare = attrs.evolve(spec.cluster.nodes[0], name="spare0")
    with_spare = attrs.evolve(spec, cluster=attrs.evolve(spec.cluster, spares=(spare,)))
    served = Served(tmp_path, write_spec(with_spare, tmp_path / "spec.yaml"), checkpoint)
    losses: Counter[str] = Counter()
    try:
        for stage in [random.randrange(3), 0, 1, 2]:
            victim = stage_nodes(served.url)[stage]
            pid = node_pids(served)[victim]

            async def kill():
                await asyncio.sleep(random.uniform(0, 0.5))
                os.kill(pid, signal.SIGKILL)

            if not losses:
                texts, logprobs = zip(*asyncio.run(stream_all(served.url, kill, logprobs=True)))
                for mine, theirs in zip(logprobs, expected_logprobs, strict=True):
                    np.testing.assert_allclose(mine, theirs, rtol=0, atol=1e-5)
            else:
                texts = asyncio.run(stream_all(served.url, kill))
            assert_the_engines_texts(list(texts), expected)
            losses[victim] += 1
            assert recovered(served.url) == losses
            assert not alive(pid)
            if sum(losses.values()) == 1:
                assert stage_nodes(served.url)[stage] == "spare0"
            wait_until(lambda: standing_by(served.url) == [victim], served)
            assert len(served.children()) == 4
        print(f"recoveries: {metric(served.url, 'cascadia_recovery_seconds')}")
    finally:
        nodes = served.children()
        assert served.stop() == 0
        assert not any(alive(pid) for pid in nodes), "node processes left behind"


@pytest.mark.parametrize("formats", [WeightFormats(**{field.name: WeightFormat("bf16")
                                                      for field in attrs.fields(WeightFormats)}), PAPER_FORMATS],
                         ids=["bf16", "paper-formats"])
def test_at_bf16_a_stream_recovered_from_a_node_loss_goes_on_as_it_would_have(tmp_path, spec, checkpoint, formats):
    """The chaos test's random loss at bf16 compute and K/V, the weights bf16 or in the paper's formats (int4 in
    groups of 32, int8), where the engine's rounding is coarse: the replay takes each stream's tokens in again in
    calls of many rows, and every client's text is still the single-process engine's (a stage's node killed at a
    random moment, a spare taking its stage)."""
    from cascadia.engine.device import runs_as

    if runs_as("bf16", "CPU") != "bf16":
        pytest.skip(f"this CPU has no bf16 arithmetic: OpenVINO computes it in {runs_as('bf16', 'CPU')}")
    spec = attrs.evolve(spec, runtime=attrs.evolve(spec.runtime, precision="bf16", kv_precision="bf16"),
                        model=attrs.evolve(spec.model, formats=formats))
    spare = attrs.evolve(spec.cluster.nodes[0], name="spare0")
    with_spare = attrs.evolve(spec, cluster=attrs.evolve(spec.cluster, spares=(spare,)))
    served = Served(tmp_path, write_spec(with_spare, tmp_path / "spec.yaml"), checkpoint)
    try:
        pid = node_pids(served)[stage_nodes(served.url)[random.randrange(3)]]

        async def kill():
            await asyncio.sleep(random.uniform(0, 0.5))
            os.kill(pid, signal.SIGKILL)

        assert_the_engines_texts(asyncio.run(stream_all(served.url, kill)), engine_texts(spec, checkpoint))
        assert sum(recovered(served.url).values()) == 1
    finally:
        nodes = served.children()
        assert served.stop() == 0
        assert not any(alive(pid) for pid in nodes), "node processes left behind"


def test_a_spare_killed_while_standing_by_is_started_again_and_takes_the_next_loss(tmp_path, spec, checkpoint,
                                                                                  expected):
    """A node standing by is supervised as a stage's node is: killed, it is reaped, logged, counted (fewer standing
    by meanwhile) and started again to stand by; the next loss then goes to it."""
    spare = attrs.evolve(spec.cluster.nodes[0], name="spare0")
    with_spare = attrs.evolve(spec, cluster=attrs.evolve(spec.cluster, spares=(spare,)))
    served = Served(tmp_path, write_spec(with_spare, tmp_path / "spec.yaml"), checkpoint)
    try:
        wait_until(lambda: standing_by(served.url) == ["spare0"], served)
        first = node_pids(served)["spare0"]
        os.kill(first, signal.SIGKILL)
        wait_until(lambda: metric(served.url, "cascadia_standby_losses").get(
            ("cascadia_standby_losses_total", (("node", "spare0"),))) == 1, served)
        assert not Path(f"/proc/{first}").exists()  # reaped, not left a zombie
        assert "spare0, standing by, was lost: the node process was killed by signal 9" in served.log.read_text()
        wait_until(lambda: standing_by(served.url) == ["spare0"], served)  # started again, and ready
        assert node_pids(served)["spare0"] != first
        assert metric(served.url, "cascadia_nodes_standing_by") == {("cascadia_nodes_standing_by", ()): 1.0}
        victim = node_pids(served)["node1"]

        async def kill():
            os.kill(victim, signal.SIGKILL)

        assert_the_engines_texts(asyncio.run(stream_all(served.url, kill)), expected)
        assert stage_nodes(served.url) == ["node0", "spare0", "node2"] and recovered(served.url) == {"node1": 1}
    finally:
        nodes = served.children()
        assert served.stop() == 0
        assert not any(alive(pid) for pid in nodes), "node processes left behind"


def wait_until(condition, served: Served) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, served.log.read_text()[-2000:]
        time.sleep(0.2)


def test_a_frozen_node_is_caught_by_the_stall_timeout_and_replaced(tmp_path, checkpoint, expected):
    served = Served(tmp_path, SPEC, checkpoint, "--stall-timeout", "1")
    try:
        victim = node_pids(served)["node1"]

        async def freeze():
            os.kill(victim, signal.SIGSTOP)

        assert_the_engines_texts(asyncio.run(stream_all(served.url, freeze)), expected)
        assert recovered(served.url) == {"node1": 1}
        assert not alive(victim)  # killed, not left stopped
    finally:
        nodes = served.children()
        assert served.stop() == 0
        assert not any(alive(pid) for pid in nodes)


def recovered(url: str) -> dict[str, int]:
    """Losses by node, from /metrics, after checking that each was recovered from."""
    failures = {labels[0][1]: int(value) for (name, labels), value in metric(url, "cascadia_node_failures").items()}
    recovery = metric(url, "cascadia_recovery_seconds")
    assert recovery[("cascadia_recovery_seconds_count", ())] == sum(failures.values())
    assert recovery[("cascadia_recovery_seconds_sum", ())] > 0
    return failures


class TcpNodes:
    """The spec's nodes, and `spares` spares like them, at tcp addresses on 127.0.0.1, each a `cascadia node` process
    started here (as on its own machine), for a server started with `options`."""

    def __init__(self, tmp_path: Path, spec, checkpoint: Path, *node_options: str, spares: int = 0,
                 spare_checkpoint: Path | None = None):
        self.tmp_path, self.checkpoint, self.node_options = tmp_path, checkpoint, node_options
        self.spare_checkpoint = spare_checkpoint or checkpoint
        like = spec.cluster.nodes[0]
        members = [*spec.cluster.nodes, *(attrs.evolve(like, name=f"spare{i}") for i in range(spares))]
        self.nodes = tuple(attrs.evolve(n, address=tcp_address("127.0.0.1", free_port())) for n in members)
        stages = len(spec.cluster.nodes)
        remote = attrs.evolve(spec, cluster=attrs.evolve(spec.cluster, nodes=self.nodes[:stages],
                                                         spares=self.nodes[stages:]))
        self.spec_path = write_spec(remote, tmp_path / "spec.yaml")
        self.plan_path = make_plan(remote).save(tmp_path / "plan.json")
        self.addresses = Addresses.local()
        self.options = ("--plan", str(self.plan_path), "--control", self.addresses.control, "--tokens",
                        self.addresses.tokens)
        self.last_stage = stages - 1
        self.processes = [self.start(i) for i in range(len(self.nodes))]

    def start(self, i: int) -> subprocess.Popen:
        node = self.nodes[i]
        last = ["--successor", self.addresses.tokens] if i == self.last_stage else []
        checkpoint = self.checkpoint if i <= self.last_stage else self.spare_checkpoint
        with (self.tmp_path / f"node{i}.log").open("a") as log:
            return subprocess.Popen([sys.executable, "-m", "cascadia", "node", "--spec", str(self.spec_path),
                                     "--plan", str(self.plan_path), "--name", node.name, "--listen", node.address,
                                     "--control", self.addresses.control, "--checkpoint", str(checkpoint),
                                     "--parent-pid", str(os.getpid()), *last, *self.node_options],
                                    stdout=log, stderr=subprocess.STDOUT)

    def kill(self) -> None:
        for process in self.processes:
            process.kill()
            process.wait()


def with_memory(spec, memory: int):
    return attrs.evolve(spec, cluster=attrs.evolve(spec.cluster, nodes=tuple(
        attrs.evolve(node, memory_bytes=memory) for node in spec.cluster.nodes)))


def tightest(spec):
    """The spec with the least memory per node (to a KiB) that still holds the model on all its nodes."""
    low, high = spec.cluster.reserve_bytes, spec.cluster.nodes[0].memory_bytes
    while high - low > 1024:
        middle = (low + high) // 2
        try:
            make_plan(with_memory(spec, middle))
            high = middle
        except InfeasiblePlan:
            low = middle
    return with_memory(spec, high)


def test_a_tcp_node_lost_for_good_takes_its_stage_down_until_a_node_comes_back(tmp_path, spec, checkpoint,
                                                                               expected):
    """No spare, and no room on the two nodes left for the model: the stage is down."""
    spec = tightest(spec)
    survivors = attrs.evolve(spec, cluster=attrs.evolve(spec.cluster, nodes=spec.cluster.nodes[::2]))
    with pytest.raises(InfeasiblePlan):
        make_plan(survivors)
    tcp = TcpNodes(tmp_path, spec, checkpoint)
    processes, start = tcp.processes, tcp.start
    served = Served(tmp_path, tcp.spec_path, checkpoint, *tcp.options, "--replace-timeout", "2")
    try:
        client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="none", max_retries=0, timeout=WAIT_S)
        stream = client.completions.create(model="tiny", prompt=prompt(0), max_tokens=55, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        next(iter(stream))
        processes[1].kill()
        with pytest.raises(openai.APIError, match="node1 \\(layers 2-3\\) is down: .* does not fit the nodes left"):
            list(stream)  # the open request ends with an error event once the replace timeout has passed
        health = httpx.get(f"{served.url}/health", timeout=10)
        assert health.status_code == 503 and "node1 (layers 2-3) is down" in health.json()["detail"]
        with pytest.raises(openai.APIStatusError, match="node1 \\(layers 2-3\\) is down") as refused:
            client.completions.create(model="tiny", prompt=prompt(1), max_tokens=4)
        assert refused.value.status_code == 503
        processes[1] = start(1)  # a node for the stage appears: serving resumes
        deadline = time.monotonic() + WAIT_S
        while httpx.get(f"{served.url}/health", timeout=10).status_code != 200:
            assert time.monotonic() < deadline, served.log.read_text()[-2000:]
            time.sleep(0.2)
        reply = client.completions.create(model="tiny", prompt=prompt(2), max_tokens=TOKENS, temperature=0,
                                          extra_body={"ignore_eos": True})
        assert reply.choices[0].text == expected[2]
    finally:
        assert served.stop() == 0
        tcp.kill()


def test_a_restarted_server_takes_keep_serving_nodes_back_without_reloading(tmp_path, spec, checkpoint, expected):
    tcp = TcpNodes(tmp_path, spec, checkpoint, "--keep-serving")
    try:
        first = Served(tmp_path, tcp.spec_path, checkpoint, *tcp.options)
        client = openai.OpenAI(base_url=f"{first.url}/v1", api_key="none", max_retries=0, timeout=WAIT_S)
        reply = client.completions.create(model="tiny", prompt=prompt(0), max_tokens=TOKENS, temperature=0,
                                          extra_body={"ignore_eos": True})
        assert reply.choices[0].text == expected[0]
        first.process.kill()  # the server dies; its nodes are on other machines and keep their stages
        first.process.wait()
        second = Served(tmp_path, tcp.spec_path, checkpoint, *tcp.options)
        try:
            client = openai.OpenAI(base_url=f"{second.url}/v1", api_key="none", max_retries=0, timeout=WAIT_S)
            reply = client.completions.create(model="tiny", prompt=prompt(2), max_tokens=TOKENS, temperature=0,
                                              extra_body={"ignore_eos": True})
            assert reply.choices[0].text == expected[2]
        finally:
            assert second.stop() == 0
        assert all(process.poll() is None for process in tcp.processes)  # the same processes: nothing reloaded
        for i in range(len(tcp.nodes)):
            assert (tmp_path / f"node{i}.log").read_text().count(": ready on ") == 2  # ready for each server
    finally:
        tcp.kill()


def test_a_tcp_spare_lost_while_standing_by_is_noticed_and_stands_by_again_once_back(tmp_path, spec, checkpoint):
    """A spare on another machine is not started here: its loss (its connection gone) is logged and counted, it
    stands by no more, and it stands by again once started again there."""
    tcp = TcpNodes(tmp_path, spec, checkpoint, spares=1)
    served = Served(tmp_path, tcp.spec_path, checkpoint, *tcp.options)
    try:
        wait_until(lambda: standing_by(served.url) == ["spare0"], served)
        tcp.processes[3].kill()
        tcp.processes[3].wait()
        wait_until(lambda: standing_by(served.url) == [], served)
        assert metric(served.url, "cascadia_standby_losses") == {
            ("cascadia_standby_losses_total", (("node", "spare0"),)): 1.0}
        assert metric(served.url, "cascadia_nodes_standing_by") == {("cascadia_nodes_standing_by", ()): 0.0}
        assert "spare0, standing by, was lost: lost its control connection" in served.log.read_text()
        tcp.processes[3] = tcp.start(3)
        wait_until(lambda: standing_by(served.url) == ["spare0"], served)
    finally:
        assert served.stop() == 0
        tcp.kill()


def test_a_tcp_spare_takes_a_lost_stage_and_then_the_survivors_take_the_model_over(tmp_path, spec, checkpoint,
                                                                                  expected):
    tcp = TcpNodes(tmp_path, spec, checkpoint, spares=1)
    served = Served(tmp_path, tcp.spec_path, checkpoint, *tcp.options, "--replace-timeout", "1")
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="none", max_retries=0, timeout=WAIT_S)

    def killing(node: int, i: int) -> str:
        """Client i's greedy text, node `node` killed once its first token came."""
        chunks = iter(client.completions.create(model="tiny", prompt=prompt(i), max_tokens=TOKENS, temperature=0,
                                                stream=True, extra_body={"ignore_eos": True}))
        text = next(chunks).choices[0].text
        tcp.processes[node].kill()
        return text + "".join(chunk.choices[0].text for chunk in chunks)

    try:
        assert killing(1, 0) == expected[0]
        assert stage_nodes(served.url) == ["node0", "spare0", "node2"]
        assert killing(3, 2) == expected[2]  # no spare left, node1 gone for good: a plan over the two left
        assert stage_nodes(served.url) == ["node0", "node2"]
        assert recovered(served.url) == {"node1": 1, "spare0": 1}
    finally:
        assert served.stop() == 0
        tcp.kill()


def test_a_spare_that_cannot_load_the_stage_is_lost_in_turn_and_the_survivors_take_the_model_over(
        tmp_path, spec, checkpoint, expected):
    (tmp_path / "empty").mkdir()
    tcp = TcpNodes(tmp_path, spec, checkpoint, spares=1, spare_checkpoint=tmp_path / "empty")
    served = Served(tmp_path, tcp.spec_path, checkpoint, *tcp.options, "--replace-timeout", "1")
    try:
        client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="none", max_retries=0, timeout=WAIT_S)
        chunks = iter(client.completions.create(model="tiny", prompt=prompt(0), max_tokens=TOKENS, temperature=0,
                                                stream=True, extra_body={"ignore_eos": True}))
        text = next(chunks).choices[0].text
        tcp.processes[1].kill()
        assert text + "".join(chunk.choices[0].text for chunk in chunks) == expected[0]
        assert stage_nodes(served.url) == ["node0", "node2"]
        failures = metric(served.url, "cascadia_node_failures")
        assert {labels[0][1]: value for (_, labels), value in failures.items()} == {"node1": 1, "spare0": 1}
        assert metric(served.url, "cascadia_recovery_seconds")[("cascadia_recovery_seconds_count", ())] == 1
        assert "spare0: CheckpointError" in served.log.read_text()
    finally:
        assert served.stop() == 0
        tcp.kill()
