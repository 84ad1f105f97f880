"""Each new family through the distributed pipeline: three real node processes on 127.0.0.1 serving a fixture saved
by transformers (llama_odd: GQA, head_dim 12, biases, a tied head, llama3 RoPE; qwen3_odd: q/k norms, 6 experts
top-2 and a dense layer; deepseek_odd: latent attention, YaRN, grouped sigmoid routing, shared experts) give the
tokens of the single-process engine, greedy and sampled, with and without speculation; served, a node killed under
24 streaming clients costs no request and no token."""

import asyncio
import os
import random
import signal
from pathlib import Path

import attrs
import pytest
from serving import Served, alive
from test_pipeline import assert_outputs_match_engine
from test_serve_failover import (assert_the_engines_texts, engine_texts, node_pids, recovered, stage_nodes,
                                 stream_all)

from cascadia.engine.checkpoint import Checkpoint
from cascadia.engine.engine import Engine
from cascadia.engine.init_model import init_model
from cascadia.graph.planner import plan as make_plan
from cascadia.models import config_from_hf_dict
from cascadia.pipeline.run import Pipeline
from cascadia.sampling import Sampling
from cascadia.spec.dump import write_spec
from cascadia.spec.load import load_spec
from cascadia.spec.types import PAGED_ATTENTION_BLOCK, STAGE_GRAPH_FAMILIES
from cascadia.speculation import ReplayDrafter

FIXTURES = Path(__file__).parent / "fixtures"
# family: (a fixture checkpoint saved by transformers; a random model's config with room for a tokenizer, to serve)
FAMILIES = {
    "llama": ("llama_odd", {"model_type": "llama", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 96,
                            "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
                            "max_position_embeddings": 256, "rope_theta": 500.0}),
    "qwen3_moe": ("qwen3_odd", {"model_type": "qwen3_moe", "vocab_size": 512, "hidden_size": 64,
                                "intermediate_size": 96, "num_hidden_layers": 3, "num_attention_heads": 4,
                                "num_key_value_heads": 2, "num_experts": 8, "num_experts_per_tok": 2,
                                "moe_intermediate_size": 32, "norm_topk_prob": True, "mlp_only_layers": [0],
                                "max_position_embeddings": 256}),
    "deepseek_v3": ("deepseek_odd", {"model_type": "deepseek_v3", "vocab_size": 512, "hidden_size": 64,
                                     "intermediate_size": 96, "moe_intermediate_size": 32, "num_hidden_layers": 3,
                                     "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 32,
                                     "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
                                     "v_head_dim": 8, "n_routed_experts": 8, "n_group": 2, "topk_group": 1,
                                     "num_experts_per_tok": 2, "first_k_dense_replace": 1,
                                     "max_position_embeddings": 256}),
}
SPEC = """\
model: {{name: {name}, hf_config: {checkpoint}/config.json, checkpoint: {checkpoint}, formats: f32}}
cluster:
  reserve: 64MiB
  nodes: [{{name: node, count: 3, memory: 1GiB, host: localhost, threads: 1}}]
  links: {{default: {{bandwidth: 1gbit, latency: 100us}}}}
runtime: {{context_budget: 64, max_streams: 8, precision: f32, kv_precision: f32, row_buckets: [1, 2, 4, 8],
          prefill_window: 4}}
workload: {{concurrency: [1, 4], prompt_tokens: {{uniform: [6, 14]}}, output_tokens: 8, greedy: true, seed: 0}}
"""


def spec_of(family: str, folder: Path):
    """The 3-node spec of the family's fixture checkpoint."""
    fixture = FAMILIES[family][0]
    path = folder / "spec.yaml"
    path.write_text(SPEC.format(name=fixture, checkpoint=FIXTURES / fixture))
    return load_spec(path)


def engine_of(spec) -> Engine:
    """The single-process engine of `spec`, its layers one by one."""
    runtime = attrs.evolve(spec.runtime, stage_graph=False)
    return Engine(Checkpoint.open(spec.model.checkpoint), runtime, formats=spec.model.formats, threads=1)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_spec(request, tmp_path_factory):
    return spec_of(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def family_engine(family_spec):
    return engine_of(family_spec)


@pytest.mark.parametrize("speculate", [None, "ngram:4"], ids=["plain", "speculating"])
def test_three_nodes_give_the_single_process_tokens(family_spec, family_engine, speculate):
    assert_three_nodes_give_the_engines_tokens(
        attrs.evolve(family_spec, runtime=attrs.evolve(family_spec.runtime, speculate=speculate)), family_engine)


@pytest.mark.parametrize("kv_block", [PAGED_ATTENTION_BLOCK, 16], ids=["paged", "gathered"])
@pytest.mark.parametrize("family", STAGE_GRAPH_FAMILIES)
def test_three_nodes_each_a_stage_as_one_graph_give_the_single_process_tokens(family, kv_block, tmp_path):
    """`runtime.stage_graph` on every node, speculating (rows of several drafts a stream, rewinds), its attention
    paged (OpenVINO's PagedAttention writing the pool in place) or gathered: the tokens of the single-process
    engine that runs its layers one by one."""
    spec = spec_of(family, tmp_path)
    runtime = attrs.evolve(spec.runtime, speculate="ngram:4", stage_graph=True, kv_block=kv_block)
    assert_three_nodes_give_the_engines_tokens(attrs.evolve(spec, runtime=runtime), engine_of(spec))


def assert_three_nodes_give_the_engines_tokens(spec, family_engine) -> None:
    """Greedy and sampled (with the greedy run's tokens replayed as drafts where `spec` speculates), a 3-node run of
    `spec` gives `family_engine`'s tokens, and its nodes end cleanly."""
    speculate = spec.runtime.speculate
    plan = make_plan(spec)
    assert len(plan.stages) == 3
    with Pipeline.start(spec, plan, checkpoint=spec.model.checkpoint, node_timeout_s=20) as pipeline:
        greedy = pipeline.run(spec.workload)
        assert_outputs_match_engine(greedy.outputs, family_engine, Sampling())
        sampled = attrs.evolve(spec.workload, greedy=False, temperature=0.8, top_p=0.9, seed=5)
        replies = {tuple(line["prompt_ids"]): line["output_ids"] for line in greedy.outputs}
        done = pipeline.run(sampled, prompts=list(replies), drafter=ReplayDrafter(replies) if speculate else None)
        assert_outputs_match_engine(done.outputs, family_engine, Sampling.of(sampled))
        if speculate:  # the replayed greedy tokens are drafts a sampled stream rejects, at least at times
            assert sum(level["speculation"]["proposed"] for level in done.result["levels"]) > 0
    assert [p.returncode for p in pipeline.local.processes] == [0, 0, 0]


def test_a_served_model_loses_a_node_and_no_request_or_token(tmp_path, family_spec):
    """A random model of the family with a tokenizer (init-model's) served by three local nodes and a spare: the
    middle stage's node killed at a random moment under 24 streaming clients, greedy and sampled, six of them asking
    two choices."""
    config = config_from_hf_dict(FAMILIES[family_spec.model.config.model_type][1])
    init_model(config, tmp_path / "ckpt", seed=1)
    spare = attrs.evolve(family_spec.cluster.nodes[0], name="spare0")
    spec = attrs.evolve(family_spec, model=attrs.evolve(family_spec.model, config=config, checkpoint=tmp_path / "ckpt"),
                        cluster=attrs.evolve(family_spec.cluster, spares=(spare,)))
    expected = engine_texts(spec, tmp_path / "ckpt")
    # the clients' 30 streams (six ask two choices) wait for the 8 slots: none gets a 429
    served = Served(tmp_path, write_spec(spec, tmp_path / "spec.yaml"), tmp_path / "ckpt", "--max-waiting", "32")
    try:
        victim = stage_nodes(served.url)[1]
        pid = node_pids(served)[victim]

        async def kill():
            await asyncio.sleep(random.uniform(0, 0.5))
            os.kill(pid, signal.SIGKILL)

        assert_the_engines_texts(asyncio.run(stream_all(served.url, kill, model=spec.model.name)), expected)
        assert recovered(served.url) == {victim: 1}
        assert stage_nodes(served.url)[1] == "spare0"
    finally:
        nodes = served.children()
        assert served.stop() == 0
        assert not any(alive(pid) for pid in nodes), "node processes left behind"
