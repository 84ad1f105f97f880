import pytest

from cascadia.model_config import ConfigError, InklingConfig


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
    ({"num_hidden_layers": "six"}, "num_hidden_layers must be an integer in 1..10000, got 'six'"),
    ({"num_hidden_layers": 10**12}, "num_hidden_layers must be an integer in 1..10000"),
    ({"text_config": [1]}, "text_config: expected a JSON object"),
])
def test_invalid_configs_name_the_field(raw, needle):
    with pytest.raises(ConfigError, match=needle):
        InklingConfig.from_hf_dict(raw)


@pytest.mark.parametrize("content, problem", [
    (None, "is a folder, not a file"),
    (b"\xff{}", "not valid JSON"),
    (b"[" * 100_000, "not valid JSON"),
    (b'{"mtp_config": 1}', "mtp_config: expected a JSON object"),
], ids=["folder", "not utf-8", "nested too deeply", "mtp_config not an object"])
def test_unreadable_config_files_name_the_file(tmp_path, content, problem):
    path = tmp_path / "config.json"
    if content is None:
        path.mkdir()
    else:
        path.write_bytes(content)
    with pytest.raises(ConfigError, match=f"^{tmp_path}/config.json: {problem}"):
        InklingConfig.from_file(tmp_path)
