import json
import os

import pytest

from cascadia.engine.checkpoint import Checkpoint
from cascadia.errors import CheckpointError
from cascadia.models import config_from_hf_dict, read_config
from cascadia.models.base import ConfigError, UnsupportedModel
from cascadia.models.inkling import InklingConfig


def test_defaults_follow_transformers_layer_pattern():
    cfg = InklingConfig.from_hf_dict({"dense_mlp_idx": 2})
    # every 6th layer (index 5, 11, ...) is global; the rest slide
    assert [i for i in range(cfg.num_hidden_layers) if not cfg.is_sliding(i)] == list(range(5, 66, 6))
    assert [i for i in range(cfg.num_hidden_layers) if cfg.is_dense(i)] == [0, 1]
    assert cfg.heads(0) == (64, 16, 128) and cfg.heads(5) == (64, 8, 128)
    assert cfg.layer_rel_extent(0) == 512 and cfg.layer_rel_extent(5) == 1024


def test_multimodal_top_level_and_aliases():
    raw = {"text_config": {"num_hidden_layers": 2, "num_local_experts": 8, "sliding_window": 64,
                           "num_experts_per_tok": 2, "hidden_size": 32}, "vision_config": {}}
    cfg = InklingConfig.from_hf_dict(raw)
    assert (cfg.n_routed_experts, cfg.sliding_window_size, cfg.hidden_size) == (8, 64, 32)


def test_dense_intermediate_size_means_intermediate_is_expert_width():
    cfg = InklingConfig.from_hf_dict({"intermediate_size": 3072, "dense_intermediate_size": 24576})
    assert (cfg.moe_intermediate_size, cfg.intermediate_size) == (3072, 24576)
    cfg = InklingConfig.from_hf_dict({"dense_intermediate_size": 20000})  # experts keep their default width
    assert (cfg.moe_intermediate_size, cfg.intermediate_size) == (3072, 20000)


def test_round_trip_through_hf_dict():
    cfg = InklingConfig.from_hf_dict({"num_hidden_layers": 3, "dense_mlp_idx": 1, "unpadded_vocab_size": 100})
    assert InklingConfig.from_hf_dict(cfg.to_hf_dict()) == cfg


@pytest.mark.parametrize("raw, needle", [
    ({"num_experts_per_tok": 300}, "exceeds n_routed_experts"),
    ({"hidden_size": 0}, "hidden_size must be a positive integer"),
    ({"num_hidden_layers": 2, "layer_types": ["hybrid"]}, "layer_types has 1 entries"),
    ({"mlp_layer_types": ["moe"] * 66}, "mlp_layer_types may hold only"),
    ({"rms_norm_eps": -1}, "rms_norm_eps must be a positive number, got -1"),
    ({"eos_token_id": [2, 201024]}, r"eos_token_id 201024 lies outside the vocabulary \(0..201023\)"),
    ({"unpadded_vocab_size": 100, "eos_token_id": 100}, r"eos_token_id 100 lies outside the vocabulary \(0..99\)"),
    ({"num_hidden_layers": "six"}, "num_hidden_layers: expected an integer, got 'six'"),
    ({"num_hidden_layers": 10**12}, "num_hidden_layers must be an integer in 1..10000"),
    ({"text_config": [1]}, "text_config: expected a JSON object"),
])
def test_invalid_configs_name_the_field(raw, needle):
    with pytest.raises(ConfigError, match=needle):
        InklingConfig.from_hf_dict(raw)


@pytest.mark.parametrize("content, problem", [
    (None, "is a folder, not a file"),
    (b"\xff{}", "not UTF-8 text"),
    (b"[" * 100_000, "not valid JSON"),
    (b'{"model_type": "inkling", "mtp_config": 1}', "mtp_config: expected a JSON object"),
], ids=["folder", "not utf-8", "nested too deeply", "mtp_config not an object"])
def test_unreadable_config_files_name_the_file(tmp_path, content, problem):
    path = tmp_path / "config.json"
    if content is None:
        path.mkdir()
    else:
        path.write_bytes(content)
    with pytest.raises(ConfigError, match=f"^{tmp_path}/config.json: {problem}"):
        read_config(tmp_path)


# Each field a config.json may get wrong, as the issue found them: a type, or a value out of range.
WRONG_FIELDS = [
    ({"logits_mup_width_multiplier": 0}, "logits_mup_width_multiplier must be a positive number, got 0.0"),
    ({"rms_norm_eps": True}, "rms_norm_eps: expected a number, got True"),
    ({"route_scale": "8"}, "route_scale: expected a number, got '8'"),
    ({"route_scale": -1}, "route_scale must be a positive number, got -1.0"),
    ({"shared_expert_sink": "no"}, "shared_expert_sink: expected true or false, got 'no'"),
    ({"log_scaling_alpha": "x"}, "log_scaling_alpha: expected a number, got 'x'"),
    ({"log_scaling_alpha": -0.5}, "log_scaling_alpha must be a number >= 0, got -0.5"),
    ({"log_scaling_n_floor": 0}, r"log_scaling_n_floor must be at least 1 \(or null\), got 0"),
    ({"n_shared_experts": "2"}, "n_shared_experts: expected an integer, got '2'"),
    ({"max_position_embeddings": 0}, "max_position_embeddings must be a positive integer, got 0"),
    ({"model_max_length": 1.5}, "model_max_length: expected an integer, got 1.5"),
    ({"hidden_act": 7}, "hidden_act: expected text, got 7"),
    ({"layer_types": "hybrid"}, "layer_types: expected a list of text values, got 'hybrid'"),
    ({"local_layer_ids": ["a"]}, r"local_layer_ids: expected a list of integers or null, got \['a'\]"),
    ({"dense_mlp_idx": "1"}, "dense_mlp_idx: expected an integer or null, got '1'"),
    ({"bos_token_id": 10**6}, r"bos_token_id 1000000 lies outside the vocabulary \(0..201023\)"),
    ({"pad_token_id": -1}, r"pad_token_id -1 lies outside the vocabulary \(0..201023\)"),
    ({"num_mtp_layers": -1}, r"num_mtp_layers must be at least 0 \(or null\), got -1"),
]


@pytest.mark.parametrize("field, problem", WRONG_FIELDS, ids=[next(iter(f)) for f, _ in WRONG_FIELDS])
def test_every_field_of_a_config_file_is_checked_naming_file_and_key(tmp_path, field, problem):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "inkling_text"} | field))
    with pytest.raises(ConfigError, match=f"^{tmp_path}/config.json: {problem}$"):
        read_config(tmp_path)
    with pytest.raises(CheckpointError, match=f"^{tmp_path}/config.json: {problem}$"):
        Checkpoint.open(tmp_path)  # what a node reads: refused before any weight file is looked at


def test_integers_for_numbers_are_read_as_numbers():
    cfg = InklingConfig.from_hf_dict({"route_scale": 8, "rms_norm_eps": 1})
    assert (cfg.route_scale, cfg.rms_norm_eps) == (8.0, 1.0) and isinstance(cfg.route_scale, float)


@pytest.mark.parametrize("make", [lambda path: os.mkfifo(path), lambda path: path.symlink_to("/dev/zero")],
                         ids=["fifo", "device"])
def test_a_config_that_is_no_regular_file_is_refused_unread(tmp_path, make):
    make(tmp_path / "config.json")
    with pytest.raises(ConfigError, match="is not a regular file"):
        read_config(tmp_path)


def test_a_config_file_over_the_size_limit_is_refused_unread(tmp_path):
    with open(tmp_path / "config.json", "wb") as f:
        f.truncate(64 * 1024**3)  # sparse: 64 GiB that would fill memory if read
    with pytest.raises(ConfigError, match=r"config.json: 64 GiB: holds more than the 1 MiB a model config may hold"):
        read_config(tmp_path)


# ---- which model a config describes --------------------------------------------------------------------------------
OTHER_MODELS = [
    ({"model_type": "gpt2", "n_layer": 12, "n_embd": 768},
     r"model_type 'gpt2' is not supported \(supported: inkling, inkling_text, llama, qwen3_moe, deepseek_v3\)"),
    # refused before any field is read
    ({"model_type": "mixtral", "hidden_size": "junk"}, "model_type 'mixtral' is not supported"),
    ({"architectures": ["MixtralForCausalLM"]},
     r"architectures \['MixtralForCausalLM'\] names no supported model"),
    ({"model_type": "llama", "architectures": ["InklingForCausalLM"]}, r"architectures \['InklingForCausalLM'\] "
                                                                       r"names no supported model \(supported: "
                                                                       r"LlamaForCausalLM\)"),
    ({"model_type": "inkling_text", "architectures": "InklingForCausalLM"}, "architectures 'InklingForCausalLM'"),
    ({"model_type": "llava", "text_config": {"model_type": "inkling_text"}}, "model_type 'llava' is not supported"),
    ({"hidden_size": 64}, r"model_type missing \(a model config names its model's type; supported: inkling"),
    ({"model_type": ["inkling"]}, r"model_type \['inkling'\] is not supported"),  # found by tests/test_fuzz.py
]


@pytest.mark.parametrize("raw, problem", OTHER_MODELS, ids=["gpt2", "mixtral with junk", "architectures only",
                                                            "architectures of another family",
                                                            "architectures not a list", "multimodal", "unnamed",
                                                            "model_type not text"])
def test_a_config_of_another_model_is_refused_by_name_before_its_fields(tmp_path, raw, problem):
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(UnsupportedModel, match=f"^{tmp_path}/config.json: {problem}"):
        read_config(tmp_path)
    with pytest.raises(UnsupportedModel, match=f"^{tmp_path}/config.json: {problem}"):
        Checkpoint.open(tmp_path)  # not a fault of the checkpoint's files: no CheckpointError
    assert UnsupportedModel.exit_status == 2


@pytest.mark.parametrize("named", [{"model_type": "inkling_text"}, {"model_type": "inkling"},
                                   {"architectures": ["InklingForCausalLM"]},
                                   {"architectures": ["InklingForConditionalGeneration"]}])
def test_inkling_is_known_by_its_model_type_or_architectures(tmp_path, named):
    (tmp_path / "config.json").write_text(json.dumps(named | {"hidden_size": 64}))
    assert read_config(tmp_path).hidden_size == 64


def test_a_config_dict_must_name_its_model_and_may_not_name_another():
    with pytest.raises(UnsupportedModel, match=r"^model_type missing \(a model config names its model's type"):
        config_from_hf_dict({"hidden_size": 64})  # as a spec's inline config must too
    with pytest.raises(UnsupportedModel, match="^model_type 'mixtral' is not supported"):
        config_from_hf_dict({"model_type": "mixtral", "hidden_size": 64})
