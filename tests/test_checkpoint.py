import json
import shutil
import struct
from pathlib import Path

import attrs
import numpy as np
import pytest
from safetensors.numpy import save_file
from sim_specs import even_plan, tiny_spec

from cascadia.engine.checkpoint import E4M3, Checkpoint, CheckpointError
from cascadia.engine.init_model import random_tensor
from cascadia.engine.quantize import round_to_bf16
from cascadia.models.inkling import InklingConfig
from cascadia.pipeline.stage import load_stage
from cascadia.models import family
from cascadia.models.inkling import all_tensors, canonical_name, embedding_tensors, head_tensors, layer_tensors
from cascadia.models.names import EMBED, HEAD, layer_prefix

FIXTURES = Path(__file__).parent / "fixtures"
CASES = ("base", "sharded", "bf16_unpadded", "llama_odd", "llama_plain", "qwen3_odd", "qwen3_norm", "qwen3_stacked",
         "deepseek_odd", "deepseek_plain", "deepseek_fp8")


def small_config(**over) -> dict:
    return dict(model_type="inkling_text", vocab_size=64, hidden_size=16, num_hidden_layers=2,
                layer_types=["hybrid_sliding", "hybrid"], mlp_layer_types=["dense", "sparse"], num_attention_heads=2,
                num_key_value_heads=1, head_dim=8, swa_num_attention_heads=2, swa_num_key_value_heads=1,
                swa_head_dim=8, sliding_window_size=4, rel_extent=6, d_rel=2, intermediate_size=24,
                moe_intermediate_size=8, n_routed_experts=4, num_experts_per_tok=2) | over


def write_checkpoint(path: Path, raw_config: dict, tensors: dict[str, np.ndarray]) -> Path:
    """A single-file checkpoint written with safetensors' own numpy writer (independent of cascadia's)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(raw_config))
    save_file(tensors, path / "model.safetensors")
    return path


def full_tensors(raw_config: dict) -> dict[str, np.ndarray]:
    cfg = InklingConfig.from_hf_dict(raw_config)
    return {name: random_tensor(cfg, 1, name, shape) for name, (shape, _) in all_tensors(cfg).items()}


@pytest.mark.parametrize("case", CASES)
def test_fixture_lists_exactly_the_model_tensors_and_validates(case):
    ckpt = Checkpoint.open(FIXTURES / case)
    ckpt.validate(embed=True, head=True)
    assert ckpt.names() == sorted(family(ckpt.config).all_tensors(ckpt.config))  # FP8 block factors: not tensors
    # a DeepSeek-V3 release's multi-token-prediction layer, after the last: listed apart, as transformers ignores it
    assert ckpt.mtp_names() == (["model.layers.4.eh_proj.weight", "model.layers.4.enorm.weight"]
                                if case == "deepseek_fp8" else [])


@pytest.mark.parametrize("case", ["base", "sharded", "llama_odd", "llama_plain", "qwen3_odd", "qwen3_norm",
                                  "qwen3_stacked", "deepseek_odd", "deepseek_plain"])
def test_f32_fixture_values_are_the_seeded_random_weights(case):
    # scripts/make_fixtures.py loads random_weights(seed 0) into transformers and saves: values come back exactly
    ckpt = Checkpoint.open(FIXTURES / case)
    for name, (shape, _) in family(ckpt.config).all_tensors(ckpt.config).items():
        np.testing.assert_array_equal(ckpt.tensor(name), random_tensor(ckpt.config, 0, name, shape), err_msg=name)


def test_bf16_fixture_reads_as_the_values_torch_rounded():
    ckpt = Checkpoint.open(FIXTURES / "bf16_unpadded")
    kept_f32 = 0
    for name, (shape, _) in all_tensors(ckpt.config).items():
        drawn = random_tensor(ckpt.config, 0, name, shape)
        got = ckpt.tensor(name)
        assert got.dtype == np.float32 and got.shape == shape
        if np.array_equal(got, drawn):  # transformers keeps convolutions and routing corrections in F32
            kept_f32 += 1
            continue
        # torch rounded to bf16 when saving: reading back must give exactly those 16 bits, zero-extended
        np.testing.assert_array_equal(got.view(np.uint32) >> 16, round_to_bf16(drawn), err_msg=name)
        assert not (got.view(np.uint32) & 0xFFFF).any()
    assert kept_f32 == 16  # 4 convolutions per layer x 3 layers + correction bias and global scale x 2 MoE layers


def test_layer_reads_only_that_layer(monkeypatch):
    reads = []  # (offset, bytes) of every data read
    real_fromfile = np.fromfile

    def spy(file, dtype, count, offset):
        reads.append((offset, count * np.dtype(dtype).itemsize))
        return real_fromfile(file, dtype=dtype, count=count, offset=offset)

    monkeypatch.setattr(np, "fromfile", spy)
    ckpt = Checkpoint.open(FIXTURES / "base")
    tensors = ckpt.layer(0)
    assert {k: v.shape for k, v in tensors.items()} == {k: s for k, (s, _) in layer_tensors(ckpt.config, 0).items()}
    assert len(reads) == len(tensors) and sum(n for _, n in reads) == sum(v.nbytes for v in tensors.values())
    assert ckpt.embedding().keys() == embedding_tensors(ckpt.config).keys()
    assert ckpt.head().keys() == head_tensors(ckpt.config).keys()


@pytest.mark.parametrize("case", ["base", "bf16_unpadded"])
def test_slices_read_only_their_byte_ranges(monkeypatch, case):
    """Expert e of an [E, N, K] stack is the e-th contiguous run of N*K values: each slice reads just that run."""
    reads = []  # (offset, values) of every data read
    real_fromfile = np.fromfile

    def spy(file, dtype, count, offset):
        reads.append((offset, count))
        return real_fromfile(file, dtype=dtype, count=count, offset=offset)

    ckpt = Checkpoint.open(FIXTURES / case)
    layer = next(i for i in range(ckpt.config.num_hidden_layers) if not ckpt.config.is_dense(i))
    name = layer_prefix(layer) + "mlp.experts.down_proj"
    monkeypatch.setattr(np, "fromfile", spy)
    whole = ckpt.tensor(name)
    (whole_offset, _), *reads = reads
    chunks = list(ckpt.slices(name, per=3))
    n_experts, per_expert = len(whole), whole[0].size
    assert [len(c) for c in chunks] == [3] * (n_experts // 3) + ([n_experts % 3] if n_experts % 3 else [])
    np.testing.assert_array_equal(np.concatenate(chunks), whole)
    itemsize = 2 if case == "bf16_unpadded" else 4
    assert reads == [(whole_offset + 3 * i * per_expert * itemsize, len(c) * per_expert) for i, c in enumerate(chunks)]
    assert ckpt.layer(layer).slices("mlp.experts.down_proj").__next__().shape == whole[:1].shape


def test_a_node_needs_only_the_shards_holding_its_layers(tmp_path):
    partial = shutil.copytree(FIXTURES / "sharded", tmp_path / "ckpt")
    (partial / "model-00003-of-00003.safetensors").unlink()
    ckpt = Checkpoint.open(partial)
    ckpt.validate(layers=[0, 1], embed=True)
    assert ckpt.layer(1).keys() == layer_tensors(ckpt.config, 1).keys()
    with pytest.raises(CheckpointError, match=r"model-00003-of-00003\.safetensors: tensor 'model\.norm\.weight' "
                                              r"\(expected shape \(64,\)\): no such file"):
        ckpt.validate(layers=[], head=True)


def test_multimodal_checkpoint_maps_the_language_model_prefix(tmp_path):
    raw = small_config()
    tensors = full_tensors(raw)
    stored = {name.replace("model.", "model.language_model.", 1) if name != HEAD else name: value
              for name, value in tensors.items()}
    stored["model.vision_tower.patch.weight"] = np.zeros((3, 3), np.float32)
    stored["model.audio_tower.norm.weight"] = np.zeros(3, np.float32)
    stored["model.mtp.0.fc.weight"] = np.ones((2, 5), np.float32)
    multimodal = {"model_type": "inkling", "text_config": raw, "vision_config": {}}
    ckpt = Checkpoint.open(write_checkpoint(tmp_path, multimodal, stored))
    ckpt.validate(embed=True, head=True)
    assert ckpt.names() == sorted(tensors)
    assert ckpt.mtp_names() == ["model.mtp.0.fc.weight"]
    np.testing.assert_array_equal(ckpt.tensor(EMBED), tensors[EMBED])
    np.testing.assert_array_equal(ckpt.tensor("model.mtp.0.fc.weight"), np.ones((2, 5)))
    assert canonical_name("model.vision_tower.patch.weight") is None


def test_f16_tensors_are_widened(tmp_path):
    raw = small_config()
    tensors = full_tensors(raw)
    tensors[EMBED] = tensors[EMBED].astype(np.float16)
    ckpt = Checkpoint.open(write_checkpoint(tmp_path, raw, tensors))
    got = ckpt.tensor(EMBED)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, tensors[EMBED].astype(np.float32))


def _without(name):
    def edit(tensors):
        del tensors[name]
    return edit


def _reshaped(name):
    def edit(tensors):
        tensors[name] = tensors[name].T.copy()
    return edit


def _as_int8(name):
    def edit(tensors):
        tensors[name] = tensors[name].astype(np.int8)
    return edit


@pytest.mark.parametrize("edit, needle", [
    (_without(HEAD), r"tensor 'lm_head\.weight' \(expected shape \(64, 16\)\): missing from the checkpoint"),
    (_reshaped(HEAD), r"tensor 'lm_head\.weight' \(expected shape \(64, 16\)\): stored with shape \(16, 64\)"),
    (_as_int8(HEAD), r"tensor 'lm_head\.weight' \(expected shape \(64, 16\)\): stored as I8; only F32, F16, BF16"),
])
def test_bad_tensors_are_named_with_file_and_expected_shape(tmp_path, edit, needle):
    raw = small_config()
    tensors = full_tensors(raw)
    edit(tensors)
    ckpt = Checkpoint.open(write_checkpoint(tmp_path, raw, tensors))
    ckpt.validate(layers=[0, 1], embed=True)  # the head is the only fault
    with pytest.raises(CheckpointError, match=r"model\.safetensors: " + needle):
        ckpt.validate(layers=[], head=True)
    with pytest.raises(CheckpointError, match=needle):
        ckpt.tensor(HEAD)


def test_truncated_file(tmp_path):
    path = shutil.copytree(FIXTURES / "base", tmp_path / "ckpt")
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[:-100])
    ckpt = Checkpoint.open(path)
    ckpt.validate(layers=[0])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor '.+' \(expected shape \(.+\)\): "
                                              r"the file is truncated"):
        ckpt.validate(embed=True, head=True)
    (path / "model.safetensors").write_bytes(data[:5])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: not a readable safetensors file"):
        Checkpoint.open(path)


def test_missing_config_or_weights(tmp_path):
    with pytest.raises(CheckpointError, match=r"config\.json: no such file"):
        Checkpoint.open(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(small_config()))
    with pytest.raises(CheckpointError, match="neither model.safetensors nor model.safetensors.index.json"):
        Checkpoint.open(tmp_path)


def test_unknown_names_and_layers_are_refused():
    ckpt = Checkpoint.open(FIXTURES / "base")
    with pytest.raises(CheckpointError, match="'model.layers.9.mlp.gate.weight' is not a tensor"):
        ckpt.tensor("model.layers.9.mlp.gate.weight")
    with pytest.raises(CheckpointError, match="layer 4 out of range"):
        ckpt.layer(4)


def _header_file(path: Path, header: bytes) -> Path:
    """A checkpoint folder whose model.safetensors holds `header` and four bytes of data."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(small_config()))
    (path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(4))
    return path


@pytest.mark.parametrize("header, needle", [
    (b"[]", r"not a readable safetensors file \(its header is a JSON list, not an object\)"),
    (b'{"lm_head.weight": [1]}', r"expected a JSON object, got \[1\]"),
    (b'{"lm_head.weight": {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}}', r"dtype must be text"),
    (b'{"lm_head.weight": {"dtype": "F32", "shape": ["a"], "data_offsets": [0, 4]}}', r"shape must be a list"),
    (b'{"lm_head.weight": {"dtype": "F32", "shape": [1], "data_offsets": [0.5, 4]}}', r"data_offsets must be"),
])
def test_malformed_headers_name_the_file_and_tensor(tmp_path, header, needle):
    entry = r"the header entry of tensor 'lm_head\.weight' is malformed: " if header != b"[]" else ""
    with pytest.raises(CheckpointError, match=rf"model\.safetensors: {entry}{needle}"):
        Checkpoint.open(_header_file(tmp_path, header))


def test_an_index_naming_a_folder(tmp_path):
    path = tmp_path / "ckpt"
    (path / "shards").mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(small_config()))
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {HEAD: "shards"}}))
    with pytest.raises(CheckpointError, match=r"shards: tensor 'lm_head\.weight' \(expected shape \(64, 16\)\): "
                                              r"is a folder, not a file"):
        Checkpoint.open(path).tensor(HEAD)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_non_finite_weights_are_named_with_file_and_position(tmp_path, dtype):
    raw = small_config()
    tensors = full_tensors(raw)
    tensors[HEAD][3, 5] = np.nan
    stack = layer_prefix(1) + "mlp.experts.down_proj"
    tensors[stack][2, 1, 0] = -np.inf
    ckpt = Checkpoint.open(write_checkpoint(tmp_path, raw, {k: v.astype(dtype) for k, v in tensors.items()}))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor 'lm_head\.weight': holds NaN or infinite "
                                              r"values \(the first, at \[3, 5\], is nan\)"):
        ckpt.tensor(HEAD)
    assert len(next(ckpt.slices(stack, per=2))) == 2  # experts 0 and 1 are finite
    with pytest.raises(CheckpointError, match=r"\(the first, at \[2, 1, 0\], is -inf\)"):
        list(ckpt.slices(stack, per=2))


def test_huge_finite_weights_are_accepted(tmp_path):
    raw = small_config()
    tensors = full_tensors(raw)
    tensors[HEAD][:] = 3e38  # their squares overflow: the exact test must clear them
    ckpt = Checkpoint.open(write_checkpoint(tmp_path, raw, tensors))
    assert (ckpt.tensor(HEAD) == np.float32(3e38)).all()


def test_a_stage_names_the_fields_its_checkpoint_differs_in(tmp_path):
    config = Checkpoint.open(FIXTURES / "base").config
    spec = tiny_spec()
    other = attrs.evolve(config, hidden_size=2 * config.hidden_size, rms_norm_eps=1e-5)
    spec = attrs.evolve(spec, model=attrs.evolve(spec.model, config=other), source=tmp_path / "spec.yaml")
    with pytest.raises(CheckpointError) as caught:
        load_stage(spec, even_plan(spec).stages[0], FIXTURES / "base", None, False,
                   lambda done, total: None)
    assert str(caught.value) == (f"{FIXTURES / 'base'}: its config.json describes another model than the spec's: "
                                 f"hidden_size {config.hidden_size} vs {2 * config.hidden_size}, "
                                 "rms_norm_eps 1e-06 vs 1e-05 (checkpoint vs spec)")


@pytest.mark.parametrize("shard", ["../outside.safetensors", "/etc/passwd", "sub/../../outside.safetensors"])
def test_an_index_naming_a_file_outside_the_checkpoint_is_refused(tmp_path, shard):
    raw = small_config()
    write_checkpoint(tmp_path / "outside-source", raw, full_tensors(raw))
    shutil.copy(tmp_path / "outside-source" / "model.safetensors", tmp_path / "outside.safetensors")
    path = tmp_path / "ckpt"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(raw))
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {HEAD: shard}}))
    with pytest.raises(CheckpointError, match=rf"index\.json: weight_map\['lm_head\.weight'\]: '{shard}' lies "
                                              rf"outside the checkpoint folder {path}: a shard must be a file in it"):
        Checkpoint.open(path)


def test_a_shard_reached_through_a_link_is_read(tmp_path):
    """As in the Hugging Face cache, where each shard is a link to a blob elsewhere."""
    raw = small_config()
    source = write_checkpoint(tmp_path / "blobs", raw, full_tensors(raw))
    path = tmp_path / "snapshot"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(raw))
    (path / "model-1.safetensors").symlink_to(source / "model.safetensors")
    names = json.loads((source / "model.safetensors").read_bytes()[8:8 + struct.unpack(
        "<Q", (source / "model.safetensors").read_bytes()[:8])[0]])
    weight_map = {name: "model-1.safetensors" for name in names if name != "__metadata__"}
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    np.testing.assert_array_equal(Checkpoint.open(path).tensor(HEAD), Checkpoint.open(source).tensor(HEAD))


def test_a_weight_file_that_is_no_regular_file_is_refused_unread(tmp_path):
    import os

    path = tmp_path / "ckpt"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(small_config()))
    os.mkfifo(path / "shard.safetensors")  # reading it would block for ever
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {HEAD: "shard.safetensors"}}))
    with pytest.raises(CheckpointError, match=r"shard\.safetensors: tensor 'lm_head\.weight' .*: is not a regular "
                                              r"file"):
        Checkpoint.open(path).tensor(HEAD)


def test_a_stack_of_another_shape_is_refused_naming_it(tmp_path):
    """qwen3_stacked's experts are stored stacked (gate_up_proj [6, 32, 48]): read with a config whose experts are
    half as wide, the stack is named with its shape and the one expected, not read as misaligned rows."""
    shutil.copytree(FIXTURES / "qwen3_stacked", tmp_path / "ckpt")
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text()) | {"moe_intermediate_size": 8}
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"stored with shape \(6, 32, 48\) in "
                                              r"'model.layers.0.mlp.experts.gate_up_proj', not \(6, 16, 48\)"):
        Checkpoint.open(tmp_path / "ckpt").validate(layers=[0])



def fp8_copy(tmp_path, change=None, leave_out: str | None = None) -> Path:
    """tests/fixtures/deepseek_fp8 copied, its config changed by `change`, or a shard index listing every stored
    tensor but `leave_out`."""
    folder = tmp_path / "fp8"
    shutil.copytree(FIXTURES / "deepseek_fp8", folder)
    if change:
        config = json.loads((folder / "config.json").read_text())
        change(config)
        (folder / "config.json").write_text(json.dumps(config))
    if leave_out:
        with open(folder / "model.safetensors", "rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        weight_map = {name: "model.safetensors" for name in header if name not in ("__metadata__", leave_out)}
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return folder


O_PROJ = "model.layers.0.self_attn.o_proj.weight"


def test_an_fp8_matrix_is_its_values_times_its_blocks_factors(tmp_path):
    """The fixture's o_proj [48, 40] in blocks of 8 x 8: its bytes' e4m3 values times each block's factor, read
    whole and by rows (the rows of a block share its factor)."""
    checkpoint = Checkpoint.open(FIXTURES / "deepseek_fp8")
    with open(FIXTURES / "deepseek_fp8" / "model.safetensors", "rb") as f:
        size = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(size))
        begin, end = header[O_PROJ]["data_offsets"]
        f.seek(8 + size + begin)
        raw = np.frombuffer(f.read(end - begin), np.uint8).reshape(48, 40)
        begin, end = header[O_PROJ + "_scale_inv"]["data_offsets"]
        f.seek(8 + size + begin)
        factors = np.frombuffer(f.read(end - begin), "<f4").reshape(6, 5)
    expected = E4M3[raw] * np.repeat(np.repeat(factors, 8, 0), 8, 1)
    assert np.array_equal(checkpoint.tensor(O_PROJ), expected)
    assert np.array_equal(np.concatenate(list(checkpoint.slices(O_PROJ, per=5))), expected)
    assert E4M3[0x38] == 1 and E4M3[0x7E] == 448 and E4M3[0x01] == 2.0 ** -9 and np.isnan(E4M3[0x7F])


@pytest.mark.parametrize("change, leave_out, words", [
    (None, O_PROJ + "_scale_inv", f"{O_PROJ!r} is stored as F8_E4M3 without its {O_PROJ + '_scale_inv'!r}"),
    (lambda c: c["quantization_config"].update(weight_block_size=[16, 16]), None,
     "expected F32 factors of shape (3, 3) (blocks of 16 x 16), got F32 (6, 5)"),
    (lambda c: c.update(quantization_config={"quant_method": "awq", "bits": 4}), None,
     "quantization_config: quant_method 'awq' is not read (only unquantised checkpoints and fp8 ones with block "
     "scales are)"),
])
def test_an_fp8_checkpoint_it_cannot_read_is_named(tmp_path, change, leave_out, words):
    with pytest.raises(CheckpointError) as raised:
        Checkpoint.open(fp8_copy(tmp_path, change, leave_out)).tensor(O_PROJ)
    assert words in str(raised.value)
