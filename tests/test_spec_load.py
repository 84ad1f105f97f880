import json
import os
import re
import textwrap
import threading
from pathlib import Path

import attrs
import pytest
import yaml
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cascadia.cli import cli
from cascadia.graph.planner import plan
from cascadia.models import read_config
from cascadia.models.inkling import InklingConfig
from cascadia.spec.dump import dump_spec, spec_from_hf
from cascadia.spec.load import SpecError, load_spec
from cascadia.spec.types import PAPER_FORMATS, LengthSpec, LinkSpec, WeightFormat

SPECS = Path(__file__).resolve().parent.parent / "specs"
TINY_CONFIG = SPECS / "tiny" / "config.json"
CLUSTER = "cluster: {nodes: [{name: a, memory: 8GB}]}\n"
MODEL = "model: {config: {model_type: inkling}}\n"  # an inline config of the defaults
TIMEOUT_S = 30  # bound on a read that must not block; the tests never measure time


def write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def problems(path: Path) -> list[str]:
    with pytest.raises(SpecError) as caught:
        load_spec(path)
    return [str(p) for p in caught.value.problems]


def tiny_spec(folder: Path, cluster: str) -> Path:
    return write(folder, "spec.yaml", f"model: {{hf_config: {TINY_CONFIG}}}\n{textwrap.dedent(cluster)}")


# ---- the ready specs -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", sorted(SPECS.glob("*.yaml")), ids=lambda p: p.name)
def test_ready_specs_load_and_dump_round_trips(path, tmp_path):
    spec = load_spec(path)
    again = load_spec(write(tmp_path, "dumped.yaml", yaml.safe_dump(dump_spec(spec), sort_keys=False)))
    assert attrs.evolve(again, source=None) == attrs.evolve(spec, source=None)


def test_paper_deployment():
    spec = load_spec(SPECS / "inkling-975b-11pc.yaml")
    cfg = spec.model.config
    assert cfg == read_config(SPECS / "inkling-975b" / "config.json")
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size, cfg.output_vocab_size) == (66, 6144, 201024, 200058)
    assert [i for i in range(66) if cfg.is_dense(i)] == [0, 1]
    assert [n.name for n in spec.cluster.nodes] == [f"pc{i}" for i in range(11)]
    assert {n.memory_bytes for n in spec.cluster.nodes} == {round(61.2 * 2**30)}
    assert spec.cluster.link("pc0", "pc5") == LinkSpec(125e6, 1e-4)
    formats = spec.model.formats
    int4_g32 = WeightFormat("int4", 32, symmetric=False)
    assert formats.routed_experts == formats.shared_experts == formats.dense_mlp == int4_g32
    assert formats.attention == formats.head == WeightFormat("int8", symmetric=False)
    assert {n.layers for n in spec.cluster.nodes} == {6}
    assert formats.embedding == WeightFormat("bf16")
    assert formats == PAPER_FORMATS  # what `spec from-hf` and `generate --compressed` use
    assert spec.workload.concurrency[0] == 1 and max(spec.workload.concurrency) == spec.runtime.max_streams == 176
    assert len(spec.workload.concurrency) == 15 and spec.workload.output_tokens == 128


@pytest.mark.parametrize("text, value", [("16", 16), ("never", "never"), ("Auto", "auto")])
def test_moe_grouped_from_is_a_row_count_auto_or_never(tmp_path, text, value):
    spec = load_spec(write(tmp_path, "s.yaml", MODEL + CLUSTER +
                           f"runtime: {{moe_grouped_from: {text}}}\n"))
    assert spec.runtime.moe_grouped_from == value
    assert load_spec(write(tmp_path, "t.yaml", MODEL + CLUSTER)).runtime.moe_grouped_from == "never"


@pytest.mark.parametrize("text, value", [("64", 64), ("Never", "never")])
def test_fused_attention_from_is_a_row_count_or_never(tmp_path, text, value):
    spec = load_spec(write(tmp_path, "s.yaml", MODEL + CLUSTER + f"runtime: {{fused_attention_from: {text}}}\n"))
    assert spec.runtime.fused_attention_from == value
    assert load_spec(write(tmp_path, "t.yaml", MODEL + CLUSTER)).runtime.fused_attention_from == "never"


def test_tiny_spec_paths_resolve_against_the_spec_folder():
    spec = load_spec(SPECS / "tiny-local.yaml")
    assert spec.model.checkpoint == SPECS / "tiny-checkpoint"
    assert [n.name for n in spec.cluster.nodes] == ["node0", "node1", "node2"]
    assert spec.model.formats.routed_experts == WeightFormat("f32")
    assert spec.workload.prompt_tokens == LengthSpec(8, 24)
    cfg = spec.model.config
    assert {cfg.is_sliding(i) for i in range(6)} == {True, False} and cfg.is_dense(0) and not cfg.is_dense(1)


def test_hetero_example_mixes_nodes_and_links():
    spec = load_spec(SPECS / "hetero-example.yaml")
    assert len({n.memory_bytes for n in spec.cluster.nodes}) == 3 and len(spec.cluster.nodes) == 14
    assert spec.cluster.link("mini1", "mini0").bandwidth == 1.25e9
    assert spec.cluster.link("ws0", "mini0") == spec.cluster.default_link


# ---- language features ---------------------------------------------------------------------------------------------
def test_includes_merge_deeply_replace_lists_and_null_drops(tmp_path):
    write(tmp_path, "parts/model.yaml", "model: {hf_config: ../tiny/config.json, name: base, checkpoint: ckpt}\n")
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "config.json").write_text(TINY_CONFIG.read_text())
    write(tmp_path, "parts/cluster.yaml", """\
        cluster:
          reserve: 1GiB
          nodes: [{name: a, memory: 8GB}, {name: b, memory: 8GB}]
        runtime: {max_streams: 4, row_buckets: [2, 4]}
    """)
    spec = load_spec(write(tmp_path, "main.yaml", """\
        include: [parts/model.yaml, parts/cluster.yaml]
        model: {name: mine, checkpoint: null}
        cluster:
          nodes: [{name: c, memory: 16GB}]
        runtime: {row_buckets: [8]}
    """))
    assert spec.model.name == "mine" and spec.model.checkpoint is None
    assert spec.model.config.hidden_size == 64  # hf_config relative to parts/, where it was written
    assert [n.name for n in spec.cluster.nodes] == ["c"] and spec.cluster.reserve_bytes == 2**30
    assert (spec.runtime.max_streams, spec.runtime.row_buckets) == (4, (8,))


def test_count_stamps_out_named_nodes(tmp_path):
    spec = load_spec(tiny_spec(tmp_path, cluster="""\
        cluster:
          nodes:
            - {name: pc, count: 3, memory: 64GB, compute: 30TFLOPS, threads: 4}
            - {name: gw, address: "tcp://10.0.0.1:5555", memory: 32GB, reserve: 1GiB}
          links:
            default: {bandwidth: 2.5gbit}
            pairs: [{between: [gw, pc2], latency: 1ms}]
    """))
    nodes = spec.cluster.nodes
    assert [n.name for n in nodes] == ["pc0", "pc1", "pc2", "gw"]
    assert nodes[1].compute_flops == 30e12 and nodes[1].threads == 4 and nodes[1].is_local
    assert spec.cluster.reserve(nodes[3]) == 2**30 and spec.cluster.reserve(nodes[0]) == 2 * 2**30
    assert spec.cluster.link("pc2", "gw") == LinkSpec(312.5e6, 1e-3)  # the pair keeps the default's bandwidth
    assert spec.cluster.link("pc0", "gw") == LinkSpec(312.5e6, 1e-4)


def test_spares_stand_apart_from_the_plan_and_round_trip(tmp_path):
    path = tiny_spec(tmp_path, cluster="""\
        cluster:
          nodes: [{name: pc, count: 3, memory: 8GB}]
          spares: [{name: spare, count: 2, memory: 16GB, threads: 2}]
    """)
    spec = load_spec(path)
    assert [n.name for n in spec.cluster.spares] == ["spare0", "spare1"]
    assert [n.name for n in spec.cluster.members] == ["pc0", "pc1", "pc2", "spare0", "spare1"]
    assert spec.cluster.node("spare1").threads == 2
    assert [stage.node for stage in plan(spec).stages] == ["pc0", "pc1", "pc2"]  # spares hold no stage
    table = CliRunner().invoke(cli, ["plan", str(path)]).output
    assert "spare spare1 (16 GB): holds no stage; `serve` gives it a lost node's" in table
    (tmp_path / "again.yaml").write_text(yaml.safe_dump(dump_spec(spec)))
    assert load_spec(tmp_path / "again.yaml").cluster == spec.cluster


def test_model_formats_config_and_overrides(tmp_path):
    spec = load_spec(write(tmp_path, "s.yaml", CLUSTER + textwrap.dedent("""\
        model:
          config: {model_type: inkling, hidden_size: 32, num_hidden_layers: 2, dense_mlp_idx: 1,
                   n_routed_experts: 4, num_experts_per_tok: 2, rms_norm_eps: 1e-5}
          overrides: {num_experts_per_tok: 3}
          formats: {default: int8, routed_experts: {dtype: int4, group_size: 32, symmetric: false}}
        workload: {concurrency: "1, 2,4", prompt_tokens: 8, stop_at_eos: true}
    """)))
    cfg = spec.model.config
    assert (cfg.hidden_size, cfg.num_experts_per_tok, cfg.mlp_layer_types, cfg.rms_norm_eps) == (
        32, 3, ("dense", "sparse"), 1e-5)
    assert spec.model.formats.routed_experts == WeightFormat("int4", 32, symmetric=False)
    assert spec.model.formats.head == WeightFormat("int8")
    assert spec.workload.concurrency == (1, 2, 4) and spec.workload.prompt_tokens == LengthSpec.fixed(8)
    assert spec.workload.stop_at_eos and not load_spec(write(tmp_path, "t.yaml", CLUSTER + MODEL)
                                                    ).workload.stop_at_eos


def test_multimodal_hf_config_with_mtp(tmp_path):
    text = json.loads(TINY_CONFIG.read_text())
    del text["num_mtp_layers"]  # as in transformers, a text config's own value (even null) wins over mtp_config
    write(tmp_path, "ckpt/config.json", json.dumps({"model_type": "inkling", "text_config": text, "vision_config": {},
                                                   "mtp_config": {"num_nextn_predict_layers": 1}}))
    spec = load_spec(write(tmp_path, "s.yaml", "model: {hf_config: ckpt}\n" + CLUSTER))
    assert spec.model.config.num_mtp_layers == 1 and spec.model.config.hidden_size == 64


# ---- problems ------------------------------------------------------------------------------------------------------
BAD = [
    ("model: {hf_config: missing.json}\n" + CLUSTER, "s.yaml:1: model.hf_config: {dir}/missing.json: no such file"),
    ("model: {hf_config: " + str(TINY_CONFIG) + ", config: {model_type: inkling}}\n" + CLUSTER,
     "s.yaml:1: model.config: give"),
    ("model: {name: x}\n" + CLUSTER, "s.yaml:1: model: missing hf_config"),
    (CLUSTER, "s.yaml:1: model: missing (required)"),
    (MODEL + "cluster: {nodes: [{name: a, memory: 8GB, address: 'tcp://*:5601'}]}\n",
     "s.yaml:2: cluster.nodes[0].address: expected 'local' or 'tcp://HOST:PORT', got 'tcp://*:5601'"),
    (MODEL + CLUSTER + "? [1]\n: 2\n", "s.yaml:3: keys must be text, got [1]"),
    (MODEL + CLUSTER + "workload: {temperature: 0}\n",
     "s.yaml:3: workload.temperature: must be more than zero, got 0"),
    (MODEL + CLUSTER + "workload: {stop_at_eos: 3}\n", "s.yaml:3: workload.stop_at_eos: expected"),
    ("model: {config: {model_type: inkling, hidden_size: 0}}\n" + CLUSTER,
     "s.yaml:1: model.config.hidden_size: hidden_size must be a positive integer, got 0"),
    ("model: {config: {model_type: inkling, num_hidden_layers: 1000000000000}}\n" + CLUSTER,
     "s.yaml:1: model.config.num_hidden_layers: num_hidden_layers must be an integer in 1..10000, got 1000000000000"),
    ("model: {config: {model_type: inkling, hidden_sise: 8}}\n" + CLUSTER,
     "model.config.hidden_sise: unknown model config key; did you mean 'hidden_size'?"),
    ("model: {config: {model_type: inkling, eos_token_id: [1, x]}}\n" + CLUSTER,
     "model.config.eos_token_id: expected an integer or a list of integers or null, got [1, 'x']"),
    ("model:\n  config: {model_type: inkling}\n  formats: {head: {dtype: bf16, group_size: 32}}\n" + CLUSTER,
     "s.yaml:3: model.formats.head: group_size and symmetric apply to int4 and int8 only, not bf16"),
    ("model: {config: {model_type: inkling}, formats: int3}\n" + CLUSTER,
     "s.yaml:1: model.formats: expected one of int4, int8"),
    (MODEL + "cluster: {nodes: [{name: a, memory: -1GB}]}\n",
     "s.yaml:2: cluster.nodes[0].memory: a size must not be negative, got '-1GB'"),
    (MODEL + "cluster: {nodes: [{name: a, memory: 1GB}]}\n",
     "s.yaml:2: cluster.nodes[0].memory: 1 GB leaves nothing beyond the reserve of 2 GiB"),
    (MODEL + "cluster:\n  nodes:\n  - {name: a, memroy: 1GB}\n",
     "s.yaml:4: cluster.nodes[0].memroy: unknown key; did you mean 'memory'?"),
    (MODEL + "cluster: {nodes: [{name: a1, memory: 8GB}, {name: a, count: 2, memory: 8GB}]}\n",
     "s.yaml:2: cluster.nodes[1]: name 'a1' already used by cluster.nodes[0]"),
    (MODEL + "cluster: {nodes: [{name: a, count: 2, memory: 8GB, address: 'tcp://h:1'}]}\n",
     "cluster.nodes[0].address: nodes stamped out by count cannot share an address"),
    (MODEL + "cluster: {nodes: [{name: a, memory: 8GB}], links: {pairs: [{between: [a, b]}]}}\n",
     "s.yaml:2: cluster.links.pairs[0].between: no node named 'b'"),
    (MODEL + CLUSTER + "runtime: {max_streams: 4}\nworkload: {concurrency: [1, 8]}\n",
     "s.yaml:4: workload.concurrency: 8 streams exceed runtime.max_streams (4)"),
    (MODEL + CLUSTER + "runtime: {max_streams: 4}\nworkload: {concurrency: [1, 2], choices: 3}\n",
     "s.yaml:4: workload.choices: 2 clients x 3 choices = 6 streams exceed runtime.max_streams (4)"),
    (MODEL + CLUSTER + "runtime: {max_streams: 4}\nworkload: {rate: [1], choices: 5}\n",
     "s.yaml:4: workload.choices: 5 streams of one prompt exceed runtime.max_streams (4)"),
    (MODEL + CLUSTER + "runtime: {context_budget: 32}\nworkload: {output_tokens: 20}\n",
     "s.yaml:4: workload.output_tokens: prompt (16) + output (20) tokens exceed runtime.context_budget (32)"),
    (MODEL + CLUSTER + "workload: {prompts_file: none.jsonl}\n",
     "s.yaml:3: workload.prompts_file: no such file: {dir}/none.jsonl"),
    (MODEL + CLUSTER + "runtime: {row_buckets: [8, 2]}\n", "runtime.row_buckets: must be increasing"),
    (MODEL + CLUSTER + "runtime: {kv_precision: int8}\n",
     "s.yaml:3: runtime.kv_precision: expected one of f32, bf16, f16, got 'int8'"),
    (MODEL + CLUSTER + "runtime: {moe_grouped_from: 0}\n",
     "s.yaml:3: runtime.moe_grouped_from: expected a row count >= 1, auto or never, got 0"),
    (MODEL + CLUSTER + "runtime: {moe_grouped_from: sometimes}\n",
     "s.yaml:3: runtime.moe_grouped_from: expected a row count >= 1, auto or never, got 'sometimes'"),
    (MODEL + CLUSTER + "runtime: {fused_attention_from: auto}\n",
     "s.yaml:3: runtime.fused_attention_from: expected a row count >= 1 or never, got 'auto'"),
    (MODEL + "cluster: {nodes: [{name: a, memory: 8GB}], spares: [{name: a, memory: 8GB}]}\n",
     "s.yaml:2: cluster.spares[0]: name 'a' already used by cluster.nodes[0]"),
    (MODEL + "cluster: {nodes: [{name: a, memory: 8GB}], spares: [{name: s, memory: 8GB, layers: 2}]}\n",
     "s.yaml:2: cluster.spares: spare 's' pins `layers`"),
    (MODEL + "cluster: {nodes: [{name: a, memory: 8GB}], spares: {name: s}}\n",
     "s.yaml:2: cluster.spares: expected a list of nodes"),
    (MODEL + CLUSTER + "worklaod: {}\n", "s.yaml:3: worklaod: unknown key; did you mean 'workload'?"),
    (MODEL + CLUSTER + "runtime:\n  max_streams: 2\n  max_streams: 3\n",
     "s.yaml:5: runtime.max_streams: duplicate key (first on line 4)"),
    (MODEL + "cluster: {nodes: [{name: a, memory: 8GB}], links: [1]}\n",
     "s.yaml:2: cluster.links: expected a mapping of keys, got [1]"),
    ("model: {config: [1]}\n" + CLUSTER, "s.yaml:1: model.config: expected a mapping of config fields, got [1]"),
    ("model: [1\n", "s.yaml:2: not valid YAML"),
    ("- 1\n", "s.yaml:1: a spec is a mapping of sections"),
    ("", "s.yaml: the file is empty"),
    ("a: !!python/object:os.system {}\n", "s.yaml:1: unsupported YAML tag"),
    ("a: &x [*x]\n", "nested deeper than 64 levels"),
    ("include: other.yaml\n", "s.yaml:1: include: {dir}/other.yaml: no such file"),
    (MODEL + CLUSTER + "workload: {top_k: -1}\n", "workload.top_k: expected an integer >= 0, got -1"),
    (MODEL + CLUSTER + "workload: {min_p: 1.5}\n", "workload.min_p: expected a number in [0, 1], got 1.5"),
]


@pytest.mark.parametrize("text, expected", BAD, ids=[b[1][:50] for b in BAD])
def test_bad_spec_names_file_line_and_key(tmp_path, text, expected):
    found = problems(write(tmp_path, "s.yaml", text))
    expected = expected.format(dir=tmp_path)
    assert any(expected in p for p in found), found


def test_every_problem_is_reported_at_once(tmp_path):
    path = write(tmp_path, "s.yaml", """\
        model: {config: {model_type: inkling, hidden_size: -1}, formats: {head: int3}}
        cluster:
          nodes:
            - {name: a, memory: 8 furlongs}
            - {name: b, memory: 8GB, device: TPU}
        runtime: {precision: fp8}
        workload: {top_p: 2}
    """)
    lines = sorted(int(p.split(":")[1]) for p in problems(path))
    assert lines == [1, 1, 4, 5, 6, 7]


def test_problems_in_an_included_file_name_that_file(tmp_path):
    write(tmp_path, "clusters/bad.yaml", "cluster:\n  nodes:\n    - {name: a, memory: lots}\n")
    found = problems(write(tmp_path, "s.yaml", f"include: clusters/bad.yaml\nmodel: {{hf_config: {TINY_CONFIG}}}\n"))
    assert found == [f"{tmp_path}/clusters/bad.yaml:3: cluster.nodes[0].memory: "
                     "expected a size like '64GB', got 'lots'"]


def test_include_cycle_is_reported(tmp_path):
    write(tmp_path, "a.yaml", "include: b.yaml\n")
    write(tmp_path, "b.yaml", "runtime: {}\ninclude: [a.yaml]\n")
    found = problems(tmp_path / "a.yaml")
    assert any(p.startswith(f"{tmp_path}/b.yaml:2: include: include cycle:") for p in found), found


def test_override_problem_points_at_the_override_line(tmp_path):
    found = problems(write(tmp_path, "spec.yaml", f"model:\n  hf_config: {TINY_CONFIG}\n  overrides:\n"
                                                  f"    num_experts_per_tok: 9\n{CLUSTER}"))
    assert found == [f"{tmp_path}/spec.yaml:4: model.overrides.num_experts_per_tok: "
                     "num_experts_per_tok (9) exceeds n_routed_experts (8)"]


def test_override_by_alias_beats_the_base_field(tmp_path):
    text = f"model: {{hf_config: {TINY_CONFIG}, overrides: {{sliding_window: 8}}}}\n" + CLUSTER
    spec = load_spec(write(tmp_path, "s.yaml", text))
    assert spec.model.config.sliding_window_size == 8


@pytest.mark.parametrize("field, value, message", [
    ("hidden_size", "64", "hidden_size: expected an integer, got '64'"),
    ("head_dim", None, "head_dim: expected an integer, got None"),
    ("head_dim", 64.5, "head_dim: expected an integer, got 64.5"),
    ("route_scale", float("nan"), "route_scale: expected a number, got nan"),
    ("layer_types", "hybrid", "layer_types: expected a list of text values, got 'hybrid'"),
    ("rms_norm_eps", -1, "rms_norm_eps must be a positive number, got -1.0"),
    ("eos_token_id", 512, "eos_token_id 512 lies outside the vocabulary (0..511)"),
])
def test_hf_config_problems_name_the_config_file_and_key(tmp_path, field, value, message):
    write(tmp_path, "ckpt/config.json", json.dumps(json.loads(TINY_CONFIG.read_text()) | {field: value}))
    found = problems(write(tmp_path, "s.yaml", CLUSTER + "model:\n  hf_config: ckpt\n"))
    assert found == [f"{tmp_path}/s.yaml:3: model.hf_config: {tmp_path}/ckpt/config.json: {message}"]


def test_hf_config_that_is_a_folder_or_not_an_object(tmp_path):
    (tmp_path / "ckpt" / "config.json").mkdir(parents=True)
    write(tmp_path, "list.json", json.dumps({"model_type": "inkling", "text_config": [1]}))
    found = problems(write(tmp_path, "s.yaml", CLUSTER + "model: {hf_config: ckpt}\n"))
    assert found == [f"{tmp_path}/s.yaml:2: model.hf_config: {tmp_path}/ckpt/config.json: is a folder, not a file"]
    found = problems(write(tmp_path, "s.yaml", CLUSTER + "model: {hf_config: list.json}\n"))
    assert found == [f"{tmp_path}/s.yaml:2: model.hf_config: {tmp_path}/list.json: text_config: expected a JSON object"]


def test_an_invalid_reserve_is_the_only_problem(tmp_path):
    found = problems(write(tmp_path, "s.yaml", MODEL + "cluster:\n  reserve: -64MiB\n  nodes: "
                                               "[{name: a, memory: 1GiB}, {name: b, memory: 1GiB, reserve: x}]\n"))
    assert found == [f"{tmp_path}/s.yaml:3: cluster.reserve: a size must not be negative, got '-64MiB'",
                     f"{tmp_path}/s.yaml:4: cluster.nodes[1].reserve: expected a size like '64GB', got 'x'"]


def test_a_wrong_config_field_does_not_set_off_others(tmp_path):
    found = problems(write(tmp_path, "s.yaml", "model:\n  config:\n    model_type: inkling\n"
                                               "    num_hidden_layers: six\n    layer_types: [hybrid, hybrid]\n"
                                               + CLUSTER))
    assert found == [f"{tmp_path}/s.yaml:4: model.config.num_hidden_layers: expected an integer, got 'six'"]


def test_a_curve_keys_folder_without_public_keys_is_refused(tmp_path):
    path = write(tmp_path, "s.yaml", f"model: {{hf_config: {TINY_CONFIG}}}\n"
                                     "cluster: {curve_keys: keys, nodes: [{name: a, memory: 8GB}]}\n")
    assert problems(path) == [f"{path}:2: cluster.curve_keys: {tmp_path}/keys: no folder of public keys "
                              f"({tmp_path}/keys/public); make one with `cascadia keys generate`"]
    (tmp_path / "keys" / "public").mkdir(parents=True)
    assert load_spec(path).cluster.curve_keys == tmp_path / "keys"


@pytest.mark.parametrize("runtime, message", [
    ("{context_budget: 2048}", "runtime.context_budget: 2048 positions exceed the model's max_position_embeddings "
                               "(1024)"),
    ("{max_streams: 2, context_budget: 8, prefill_window: 17}",
     "runtime.prefill_window: 17 prompt rows exceed what max_streams (2) x context_budget (8) positions hold"),
    ("{row_buckets: [1, 1000000000]}", "runtime.row_buckets: a call holds at most 4096 rows, got 1000000000"),
    ("{pipeline_groups: 0}", "runtime.pipeline_groups: expected an integer >= 1, got 0"),
])
def test_runtime_values_beyond_what_a_run_can_use_are_refused(tmp_path, runtime, message):
    path = write(tmp_path, "s.yaml", f"model: {{hf_config: {TINY_CONFIG}}}\n{CLUSTER}runtime: {runtime}\n")
    assert problems(path) == [f"{path}:3: {message}"]


def test_missing_spec_file(tmp_path):
    assert problems(tmp_path / "nope.yaml") == [f"{tmp_path}/nope.yaml: no such file"]


def within(seconds: float, work):
    """`work()`'s result, from a thread given `seconds` (a bound on a wait, not a measurement): a read that blocks
    for ever fails the test instead of hanging the suite."""
    done = []
    worker = threading.Thread(target=lambda: done.append(work()), daemon=True)
    worker.start()
    worker.join(seconds)
    assert done, f"still working after {seconds} s"
    return done[0]


@pytest.mark.parametrize("target, message", [
    ("/dev/zero", "is not a regular file (a device, FIFO or socket cannot be read as one)"),
    ("/dev/urandom", "is not a regular file (a device, FIFO or socket cannot be read as one)"),
    ("fifo", "is not a regular file (a device, FIFO or socket cannot be read as one)"),
    ("huge.yaml", "5 MiB: holds more than the 1 MiB a spec file may hold"),
    ("binary.yaml", "not UTF-8 text (invalid start byte at byte 0)"),
])
def test_an_include_that_is_no_spec_file_is_refused_unread(tmp_path, target, message):
    os.mkfifo(tmp_path / "fifo")  # opened for reading, it would block until a writer came
    with open(tmp_path / "huge.yaml", "wb") as f:
        f.truncate(5 * 1024**2)
    (tmp_path / "binary.yaml").write_bytes(b"\xff\xfe" * 100)
    path = write(tmp_path, "s.yaml", f"include: {target}\nmodel: {{hf_config: {TINY_CONFIG}}}\n{CLUSTER}")
    where = target if target.startswith("/") else f"{tmp_path}/{target}"
    assert within(TIMEOUT_S, lambda: problems(path)) == [f"{path}:1: include: {where}: {message}"]


@pytest.mark.parametrize("target, message", [
    ("/dev/urandom", "is not a regular file (a device, FIFO or socket cannot be read as one)"),
    ("weights.bin", "64 GiB: holds more than the 1 MiB a model config may hold"),
])
def test_an_hf_config_that_is_no_config_file_is_refused_unread(tmp_path, target, message):
    with open(tmp_path / "weights.bin", "wb") as f:
        f.truncate(64 * 1024**3)  # sparse: a checkpoint's weights named by mistake
    path = write(tmp_path, "s.yaml", f"model: {{hf_config: {target}}}\n{CLUSTER}")
    where = target if target.startswith("/") else f"{tmp_path}/{target}"
    assert within(TIMEOUT_S, lambda: problems(path)) == [f"{path}:1: model.hf_config: {where}: {message}"]


def test_a_spec_over_the_size_limit_is_refused_before_it_is_read(tmp_path):
    path = tmp_path / "big.yaml"
    path.write_text("cluster: {nodes: [{name: a, memory: 8GB}]}\n" + "# padding\n" * 460_000)  # 4.5 MB
    assert problems(path) == [f"{path}: 4.6 MB: holds more than the 1 MiB a spec file may hold"]


# ---- never anything but SpecError ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    return tmp_path_factory.mktemp("junk")


def load_never_crashes(path: Path) -> None:
    try:
        load_spec(path)
    except SpecError as e:
        assert e.problems and all(p.file is not None for p in e.problems)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(max_size=200))
def test_random_text_gives_spec_error_only(scratch, text):
    path = scratch / "text.yaml"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    load_never_crashes(path)


KEYS = ["model", "cluster", "runtime", "workload", "include", "config", "hf_config", "overrides", "formats",
        "nodes", "name", "count", "memory", "reserve", "links", "default", "pairs", "between", "bandwidth",
        "latency", "concurrency", "prompt_tokens", "uniform", "row_buckets", "dtype", "group_size"]
SCALARS = (st.integers(-5, 300) | st.floats(allow_nan=True) | st.booleans() | st.none() | st.sampled_from(
    ["64GB", "1gbit", "100us", "int4", "a", "..", "/", "1,2", "hybrid", "sparse", "tcp://h:1", "GPU"])
    | st.text(max_size=10))
JUNK = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
    st.sampled_from(KEYS) | st.text(max_size=5), inner, max_size=4), max_leaves=10)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(JUNK)
def test_random_structures_give_spec_error_only(scratch, junk):
    path = scratch / "junk.yaml"
    path.write_text(yaml.safe_dump(junk))
    load_never_crashes(path)


def _set(tree: dict, where: list, value) -> None:
    """Put `value` at the path `where` of keys and list indices, unless an earlier edit put junk on the way."""
    node = tree
    for key in where:
        if isinstance(node, list) and isinstance(key, int) and key < len(node):
            parent, node = node, node[key]
        elif isinstance(node, dict) and isinstance(key, str):
            parent, node = node, node.setdefault(key, {})
        else:
            return
    parent[where[-1]] = value


PLACES = [["model", "config", key] for key in attrs.fields_dict(InklingConfig)]
PLACES += [["model", "config", key] for key in ("dense_mlp_idx", "local_layer_ids", "num_local_experts",
                                                "dense_intermediate_size")]
PLACES += [["model", "formats"], ["model", "formats", "head"], ["model", "name"], ["cluster", "reserve"],
           ["cluster", "nodes", 0, "memory"], ["cluster", "nodes", 0, "count"], ["cluster", "nodes", 0, "address"],
           ["cluster", "links"], ["cluster", "links", "pairs"], ["runtime", "row_buckets"],
           ["workload", "prompt_tokens"], ["workload", "concurrency"], ["workload", "seed"]]


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.sampled_from(PLACES), JUNK), min_size=1, max_size=3))
def test_valid_spec_with_junk_in_places_gives_spec_error_only(scratch, edits):
    tree = {"model": {"config": {"num_hidden_layers": 2}}, "cluster": {"nodes": [{"name": "a", "memory": "8GB"}]}}
    for where, value in edits:
        _set(tree, where, value)
    path = scratch / "mutated.yaml"
    path.write_text(yaml.safe_dump(tree))
    load_never_crashes(path)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.dictionaries(st.sampled_from(sorted(attrs.fields_dict(InklingConfig)) + ["text_config", "mtp_config"]),
                       JUNK, max_size=4))
def test_junk_hf_config_gives_spec_error_only(scratch, config):
    (scratch / "config.json").write_text(json.dumps(config))
    path = scratch / "hf.yaml"
    path.write_text("model: {hf_config: config.json}\n" + CLUSTER)
    load_never_crashes(path)


# ---- the command line ----------------------------------------------------------------------------------------------
def test_cli_validate_ok_and_problems(tmp_path):
    runner = CliRunner()
    ok = runner.invoke(cli, ["spec", "validate", str(SPECS / "inkling-975b-11pc.yaml")])
    assert ok.exit_code == 0 and ok.output.startswith("OK: ") and "11 nodes (11 x 61.2 GiB)" in ok.output
    bad = write(tmp_path, "s.yaml", MODEL + "cluster: {nodes: [{name: a, memory: 1GB}]}\nruntme: {}\n")
    result = runner.invoke(cli, ["spec", "validate", str(bad)])
    assert result.exit_code == 2
    assert f"{bad}:2: cluster.nodes[0].memory:" in result.stderr and f"{bad}:3: runtme:" in result.stderr


def test_cli_show_prints_loadable_yaml(tmp_path):
    result = CliRunner().invoke(cli, ["spec", "show", str(SPECS / "tiny-local.yaml")])
    assert result.exit_code == 0
    shown = yaml.safe_load(result.output)
    assert [n["name"] for n in shown["cluster"]["nodes"]] == ["node0", "node1", "node2"]
    assert load_spec(write(tmp_path, "shown.yaml", result.output)).model.config.hidden_size == 64


def test_cli_from_hf_writes_a_spec_that_validates(tmp_path):
    out = tmp_path / "spec.yaml"
    result = CliRunner().invoke(cli, ["spec", "from-hf", str(SPECS / "tiny"), "--nodes", "3", "--memory", "16GiB",
                                      "--bandwidth", "10gbit", "-o", str(out)])
    assert result.exit_code == 0, result.output
    spec = load_spec(out)
    assert len(spec.cluster.nodes) == 3 and spec.cluster.nodes[0].memory_bytes == 16 * 2**30
    assert spec.cluster.default_link.bandwidth == 1.25e9
    assert spec.model.formats == PAPER_FORMATS


@pytest.mark.parametrize("output", ["spec.yaml", "-"])
def test_cli_from_hf_of_another_model_writes_nothing(tmp_path, output):
    write(tmp_path, "gpt2/config.json", json.dumps({"model_type": "gpt2", "n_layer": 12, "n_embd": 768}))
    result = CliRunner().invoke(cli, ["spec", "from-hf", str(tmp_path / "gpt2"), "--nodes", "2", "--memory", "64GiB",
                                      "-o", output if output == "-" else str(tmp_path / output)])
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr == (f"Error: {tmp_path}/gpt2/config.json: model_type 'gpt2' is not supported "
                             "(supported: inkling, inkling_text, llama, qwen3_moe, deepseek_v3)\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpt2"]


@pytest.mark.parametrize("output", ["spec.yaml", "-"])
def test_cli_from_hf_validates_before_it_writes(tmp_path, output, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(cli, ["spec", "from-hf", str(SPECS / "tiny"), "--nodes", "2", "--memory", "64B",
                                      "-o", output])
    assert result.exit_code == 2 and result.stdout == ""
    shown_as = "<stdout>" if output == "-" else output
    assert result.stderr.splitlines() == [
        f"Error: the spec for {SPECS / 'tiny'} is not valid; nothing was written:",
        f"{shown_as}:15: cluster.nodes[0].memory: 64 B leaves nothing beyond the reserve of 2 GiB"]
    assert list(tmp_path.iterdir()) == []


def test_a_spec_of_another_model_is_refused_at_its_line(tmp_path):
    write(tmp_path, "gemma.json", json.dumps({"model_type": "gemma3", "architectures": ["Gemma3ForCausalLM"]}))
    assert problems(write(tmp_path, "s.yaml", CLUSTER + "model: {hf_config: gemma.json}\n")) == [
        f"{tmp_path}/s.yaml:2: model.hf_config: {tmp_path}/gemma.json: model_type 'gemma3' is not supported "
        "(supported: inkling, inkling_text, llama, qwen3_moe, deepseek_v3)"]
    assert problems(write(tmp_path, "t.yaml", CLUSTER + "model:\n  config:\n    model_type: mixtral\n")) == [
        f"{tmp_path}/t.yaml:4: model.config.model_type: model_type 'mixtral' is not supported "
        "(supported: inkling, inkling_text, llama, qwen3_moe, deepseek_v3)"]


def test_the_paper_specs_figures_are_the_plans():
    """The comment of specs/inkling-975b-11pc.yaml quotes `cascadia plan`'s positions: they must be what it shows."""
    text = (SPECS / "inkling-975b-11pc.yaml").read_text()
    quoted = re.search(r"shows it: ([\d,]+) positions for one stream, ([\d,]+) for each of (\d+)\)", text)
    assert quoted is not None
    stages = plan(load_spec(SPECS / "inkling-975b-11pc.yaml")).stages
    one, each, streams = (int(group.replace(",", "")) for group in quoted.groups())
    assert (one, each) == (min(s.positions_one_stream for s in stages), min(s.max_positions_per_stream for s in stages))
    assert streams == load_spec(SPECS / "inkling-975b-11pc.yaml").runtime.max_streams


def test_spec_from_hf_names_nearby_configs_relatively(tmp_path):
    write(tmp_path, "models/tiny/config.json", TINY_CONFIG.read_text())
    (tmp_path / "models" / "tiny" / "model.safetensors").write_bytes(b"")
    body = spec_from_hf(tmp_path / "models" / "tiny", tmp_path, nodes=2, memory_bytes=8 * 10**9)
    assert body["model"]["hf_config"] == "models/tiny" and body["model"]["checkpoint"] == "models/tiny"
    assert body["model"]["name"] == "tiny"
    elsewhere = spec_from_hf(tmp_path / "models" / "tiny", tmp_path / "specs", nodes=2, memory_bytes=8 * 10**9)
    assert elsewhere["model"]["hf_config"] == str(tmp_path / "models" / "tiny")


def test_stage_graph_is_a_boolean_for_the_families_that_run_it(tmp_path):
    llama = "model: {config: {model_type: llama}}\n"
    assert load_spec(write(tmp_path, "s.yaml", llama + CLUSTER + "runtime: {stage_graph: true}\n")).runtime.stage_graph
    assert not load_spec(write(tmp_path, "t.yaml", llama + CLUSTER)).runtime.stage_graph
    with pytest.raises(SpecError, match=r"runtime\.stage_graph: runs the layers of llama and qwen3_moe models as one "
                                        r"graph, not inkling"):
        load_spec(write(tmp_path, "u.yaml", MODEL + CLUSTER + "runtime: {stage_graph: true}\n"))
    with pytest.raises(SpecError, match=r"runtime\.stage_graph: expected true or false"):
        load_spec(write(tmp_path, "v.yaml", llama + CLUSTER + "runtime: {stage_graph: 1}\n"))
