import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import cascadia.engine.init_model as init_module
from cascadia.cli import cli
from cascadia.engine.checkpoint import Checkpoint
from cascadia.engine.init_model import init_model, random_tensor
from cascadia.models.inkling import InklingConfig
from cascadia.models.inkling import all_tensors
from cascadia.tokenizer import TokenizerError, build_tokenizer, load_tokenizer

FIXTURES = Path(__file__).parent / "fixtures"
SPEC = Path(__file__).parent.parent / "specs" / "tiny-local.yaml"


def small_config(**over) -> InklingConfig:
    return InklingConfig.from_hf_dict(dict(
        vocab_size=320, hidden_size=16, num_hidden_layers=3, layer_types=["hybrid_sliding", "hybrid", "hybrid"],
        mlp_layer_types=["dense", "sparse", "sparse"], num_attention_heads=2, num_key_value_heads=1, head_dim=8,
        swa_num_attention_heads=2, swa_num_key_value_heads=1, swa_head_dim=8, sliding_window_size=4, rel_extent=6,
        d_rel=2, intermediate_size=24, moe_intermediate_size=8, n_routed_experts=4, num_experts_per_tok=2) | over)


def stored_dtypes(path: Path) -> dict[str, str]:
    with path.open("rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    return {name: meta["dtype"] for name, meta in header.items() if name != "__metadata__"}


def file_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_checkpoint_opens_validates_and_holds_the_seeded_weights(tmp_path):
    cfg = small_config()
    report = init_model(cfg, tmp_path, seed=7)
    assert report.weight_files == ("model.safetensors",) and report.notes == ()
    ckpt = Checkpoint.open(tmp_path)
    assert ckpt.config == cfg
    ckpt.validate(embed=True, head=True)
    for name, (shape, _) in all_tensors(cfg).items():
        np.testing.assert_array_equal(ckpt.tensor(name), random_tensor(cfg, 7, name, shape), err_msg=name)
    assert report.weight_bytes == sum(4 * np.prod(shape) for shape, _ in all_tensors(cfg).values())


def test_weights_are_sane_by_role(tmp_path):
    ckpt = Checkpoint.open(init_model(small_config(hidden_size=64, moe_intermediate_size=32), tmp_path).out_dir)
    layer = ckpt.layer(1)
    assert abs(layer["input_layernorm.weight"].mean() - 1) < 0.05
    assert abs(layer["mlp.experts.gate_up_proj"].std() - 64 ** -0.5) < 0.01  # N(0, 1/fan_in)
    assert abs(layer["mlp.experts.down_proj"].std() - 32 ** -0.5) < 0.01
    assert 0 < np.abs(layer["attn_sconv.conv1d.weight"]).max() < 0.6


def test_bf16_checkpoint_is_what_transformers_writes(tmp_path):
    # tests/fixtures/bf16_unpadded is random_weights(seed 0) saved by transformers as a bf16 model
    fixture = FIXTURES / "bf16_unpadded"
    expected = Checkpoint.open(fixture)
    init_model(expected.config, tmp_path, seed=0, dtype="bf16")
    assert stored_dtypes(tmp_path / "model.safetensors") == stored_dtypes(fixture / "model.safetensors")
    ours = Checkpoint.open(tmp_path)
    for name in expected.names():
        np.testing.assert_array_equal(ours.tensor(name), expected.tensor(name), err_msg=name)


def test_same_seed_same_bytes(tmp_path):
    cfg = small_config()
    for folder, seed in (("a", 1), ("b", 1), ("c", 2)):
        init_model(cfg, tmp_path / folder, seed=seed)
    assert file_bytes(tmp_path / "a") == file_bytes(tmp_path / "b")
    assert (tmp_path / "a" / "model.safetensors").read_bytes() != (tmp_path / "c" / "model.safetensors").read_bytes()


def test_values_do_not_depend_on_how_tensors_are_sliced(tmp_path, monkeypatch):
    cfg = small_config()
    init_model(cfg, tmp_path / "whole")
    monkeypatch.setattr(init_module, "_CHUNK_VALUES", 100)  # expert banks now come in many slices
    init_model(cfg, tmp_path / "sliced")
    assert file_bytes(tmp_path / "whole") == file_bytes(tmp_path / "sliced")


def test_sharded_write_replaces_an_older_checkpoint(tmp_path):
    cfg = small_config()
    init_model(cfg, tmp_path, seed=3, max_shard_bytes=8_000, progress=(heard := []).append)
    report = init_model(cfg, tmp_path, seed=4, max_shard_bytes=8_000, progress=heard.append)
    assert len(report.weight_files) > 2 and len(heard) == 2 * len(report.weight_files)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(all_tensors(cfg))
    assert sorted(p.name for p in tmp_path.glob("model-*")) == sorted(report.weight_files)
    ckpt = Checkpoint.open(tmp_path)
    ckpt.validate(embed=True, head=True)
    name, (shape, _) = next(iter(all_tensors(cfg).items()))
    np.testing.assert_array_equal(ckpt.tensor(name), random_tensor(cfg, 4, name, shape))
    init_model(cfg, tmp_path, seed=5)  # back to one file: no shard or index of the old one may survive
    assert sorted(p.name for p in tmp_path.glob("model*")) == ["model.safetensors"]


def test_tokenizer_round_trips_and_places_special_ids(tmp_path):
    cfg = small_config(vocab_size=400, unpadded_vocab_size=380, eos_token_id=[2, 5], pad_token_id=0)
    report = init_model(cfg, tmp_path)
    tokenizer = load_tokenizer(tmp_path)
    assert report.tokenizer_size == tokenizer.get_vocab_size() == 380  # the head's rows, not the padding
    assert [tokenizer.token_to_id(t) for t in ("<|pad|>", "<|bos|>", "<|eos|>", "<|eos_1|>")] == [0, 1, 2, 5]
    text = "The planner weighs memory, bandwidth and arithmetic. Grüße, naïve café! 日本語 🙂"
    ids = tokenizer.encode(text).ids
    assert len(ids) < len(text.encode()) and max(ids) < 380  # merges were learned and fit the head
    assert tokenizer.decode(ids) == text


def test_tokenizer_limits_are_reported(tmp_path):
    report = init_model(small_config(vocab_size=5000), tmp_path)
    assert report.tokenizer_size < 5000 and "allows no more merges" in report.notes[0]
    tiny = small_config(vocab_size=256)
    with pytest.raises(TokenizerError, match="needs 259 entries"):
        build_tokenizer(tiny)
    report = init_model(tiny, tmp_path)
    assert report.tokenizer_size is None and not (tmp_path / "tokenizer.json").exists()
    with pytest.raises(TokenizerError, match="tokenizer.json: cannot read a tokenizer"):
        load_tokenizer(tmp_path)


@pytest.mark.slow
def test_transformers_loads_the_checkpoint(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = small_config(vocab_size=300, unpadded_vocab_size=290, log_scaling_n_floor=2)
    init_model(cfg, tmp_path, seed=9, dtype="bf16")
    model = transformers.InklingForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    ckpt = Checkpoint.open(tmp_path)
    state = model.state_dict()
    assert sorted(state) == ckpt.names()
    for name in ckpt.names():
        np.testing.assert_array_equal(state[name].numpy(), ckpt.tensor(name), err_msg=name)
    logits = model(torch.tensor([[1, 17, 42, 99, 7]])).logits
    assert logits.shape == (1, 5, 290) and torch.isfinite(logits).all() and logits.std() > 0.01


def test_cli_from_config_checkpoint_and_spec(tmp_path):
    runner = CliRunner()
    cfg = small_config()
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    result = runner.invoke(cli, ["init-model", str(tmp_path / "config.json"), str(tmp_path / "a"), "--seed", "3"])
    assert result.exit_code == 0, result.output
    assert "1 safetensors file(s)" in result.output and "tokenizer.json (320 tokens)" in result.output
    result = runner.invoke(cli, ["init-model", str(tmp_path / "a"), str(tmp_path / "b"), "--dtype", "bf16"])
    assert result.exit_code == 0, result.output
    assert Checkpoint.open(tmp_path / "b").config == cfg
    assert set(stored_dtypes(tmp_path / "b" / "model.safetensors").values()) == {"BF16", "F32"}
    result = runner.invoke(cli, ["init-model", str(SPEC), str(tmp_path / "c")])
    assert result.exit_code == 0, result.output
    Checkpoint.open(tmp_path / "c").validate(embed=True, head=True)


def test_cli_keeps_an_existing_checkpoint_unless_forced(tmp_path):
    runner = CliRunner()
    assert runner.invoke(cli, ["init-model", str(SPEC), str(tmp_path / "c"), "--seed", "1"]).exit_code == 0
    written = (tmp_path / "c" / "model.safetensors").read_bytes()
    result = runner.invoke(cli, ["init-model", str(SPEC), str(tmp_path / "c"), "--seed", "2"])
    assert result.exit_code == 1
    assert result.stderr == (f"Error: {tmp_path / 'c'}: already holds a checkpoint (config.json, model.safetensors); "
                             "give --force to replace it\n")
    assert (tmp_path / "c" / "model.safetensors").read_bytes() == written
    result = runner.invoke(cli, ["init-model", str(SPEC), str(tmp_path / "c"), "--seed", "2", "--force"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "c" / "model.safetensors").read_bytes() != written


def test_cli_errors_are_messages(tmp_path):
    runner = CliRunner()
    (tmp_path / "bad.json").write_text("{")
    result = runner.invoke(cli, ["init-model", str(tmp_path / "bad.json"), str(tmp_path / "out")])
    assert result.exit_code == 2 and "bad.json: not valid JSON" in result.output
    assert isinstance(result.exception, SystemExit)  # a message, not a traceback
    result = runner.invoke(cli, ["init-model", str(tmp_path / "bad.json"), str(tmp_path / "out"), "--dtype", "f8"])
    assert result.exit_code == 2 and "'f8' is not one of" in result.output
