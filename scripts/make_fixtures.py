"""Write the tiny reference checkpoints and logits under tests/fixtures/ (needs torch and transformers; tests don't).

For each case: seeded random weights (cascadia.engine.init_model.random_weights, so every parameter, including norm
weights, global scales and routing corrections, is away from its trivial init) are loaded into transformers'
InklingForCausalLM, LlamaForCausalLM, Qwen3MoeForCausalLM or DeepseekV3ForCausalLM, saved with save_pretrained,
read back in float32 with eager attention, and run to record reference logits. Run from the repository root:

    python scripts/make_fixtures.py            # writes tests/fixtures/<case>/, long/ and sampling/
    python scripts/make_fixtures.py --only long

The long case keeps no weights (tests rewrite them from its config and seed with `cascadia.engine.init_model`, the
same draws) and only the logits of some positions: a few thousand positions of full logits would be megabytes.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from transformers import (DeepseekV3Config, DeepseekV3ForCausalLM, DynamicCache, InklingForCausalLM, LlamaConfig,
                          LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)
from transformers.generation.logits_process import (MinNewTokensLengthLogitsProcessor, MinPLogitsWarper,
                                                    RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor,
                                                    TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)
from transformers.models.inkling.configuration_inkling import InklingTextConfig

from cascadia.engine.init_model import random_weights
from cascadia.models import config_from_hf_dict

S, G = "hybrid_sliding", "hybrid"
SEQ_LEN = 40  # > sliding window and > rel_extent in every case
MIXED_LENS = (23, 31)  # two independent streams of different lengths for batching checks
TOLERANCE = 1e-5

# name: (HF config keys, save options, decode prefill length P)
CASES = {
    # Single f32 file. Log scaling on, dense and sparse layers, sliding heads differ from global heads.
    "base": (dict(
        vocab_size=256, hidden_size=48, num_hidden_layers=4, layer_types=[S, G, S, G],
        mlp_layer_types=["dense", "sparse", "sparse", "dense"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        swa_num_attention_heads=2, swa_num_key_value_heads=1, swa_head_dim=16,
        sliding_window_size=8, rel_extent=12, d_rel=4, log_scaling_n_floor=4, log_scaling_alpha=0.2,
        intermediate_size=64, moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2,
        n_shared_experts=2, route_scale=2.5, logits_mup_width_multiplier=4.0, conv_kernel_size=4,
    ), dict(), 10),
    # Sharded into several files with an index. GQA 4:1 on global layers, top-3 of 12, kernel 3, no log scaling.
    "sharded": (dict(
        vocab_size=320, hidden_size=64, num_hidden_layers=5, layer_types=[G, S, S, G, S],
        mlp_layer_types=["sparse", "dense", "sparse", "sparse", "dense"],
        num_attention_heads=4, num_key_value_heads=1, head_dim=16,
        swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=8,
        sliding_window_size=6, rel_extent=16, d_rel=8,
        intermediate_size=96, moe_intermediate_size=16, n_routed_experts=12, num_experts_per_tok=3,
        n_shared_experts=2, route_scale=3.0, logits_mup_width_multiplier=6.0, conv_kernel_size=3,
    ), dict(max_shard_size="500KB"), 7),
    # Saved in bf16 (as transformers writes a bf16 model: fp32-kept modules stay fp32); head padded past
    # unpadded_vocab_size; top-4 of 16 experts; log scaling on.
    "bf16_unpadded": (dict(
        vocab_size=512, unpadded_vocab_size=500, hidden_size=32, num_hidden_layers=3, layer_types=[S, G, S],
        mlp_layer_types=["sparse", "sparse", "dense"],
        num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=8,
        sliding_window_size=8, rel_extent=12, d_rel=4, log_scaling_n_floor=6,
        intermediate_size=48, moe_intermediate_size=8, n_routed_experts=16, num_experts_per_tok=4,
        n_shared_experts=2, route_scale=4.0, logits_mup_width_multiplier=3.0, conv_kernel_size=4,
    ), dict(dtype=torch.bfloat16), 12),
    # Llama: GQA 3:1, head_dim 12 (not hidden / heads = 8), q/k/v/o biases, a tied head, llama3 RoPE whose
    # frequencies fall in all three bands (kept, blended, divided) within 40 positions.
    "llama_odd": (dict(
        model_type="llama", vocab_size=300, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
        num_attention_heads=6, num_key_value_heads=2, head_dim=12, attention_bias=True, tie_word_embeddings=True,
        rms_norm_eps=1e-5, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
        rope_parameters=dict(rope_type="llama3", rope_theta=500.0, factor=4.0, low_freq_factor=1.0,
                             high_freq_factor=8.0, original_max_position_embeddings=64),
    ), dict(), 10),
    # Llama with the defaults of every optional key (key/value heads as query heads, head_dim hidden / heads),
    # untied, linear RoPE under the released configs' older keys, sharded.
    "llama_plain": (dict(
        model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, rope_theta=10000.0, rope_scaling=dict(type="linear", factor=2.0),
    ), dict(max_shard_size="200KB"), 7),
    # Qwen3-MoE: head_dim 20 (not 48 / 4), q/k/v/o biases before the q and k norms, 6 experts top-2 unnormalised, a
    # dense layer (mlp_only_layers) among MoE ones.
    "qwen3_odd": (dict(
        model_type="qwen3_moe", vocab_size=300, hidden_size=48, intermediate_size=72, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=20, attention_bias=True, num_experts=6,
        num_experts_per_tok=2, moe_intermediate_size=16, mlp_only_layers=[2], rope_theta=10000.0,
    ), dict(), 10),
    # qwen3_odd saved with its experts stacked as transformers holds them in memory (gate_up_proj [E, 2I, H],
    # down_proj [E, H, I]): what `save_pretrained(save_original_format=False)` writes.
    "qwen3_stacked": (dict(
        model_type="qwen3_moe", vocab_size=300, hidden_size=48, intermediate_size=72, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=20, attention_bias=True, num_experts=6,
        num_experts_per_tok=2, moe_intermediate_size=16, mlp_only_layers=[2], rope_theta=10000.0,
    ), dict(save_original_format=False), 10),
    # Qwen3-MoE as released configs are: top-k renormalised, every other layer MoE (decoder_sparse_step 2), a tied
    # head, MQA, sharded.
    "qwen3_norm": (dict(
        model_type="qwen3_moe", vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=1, num_experts=8, num_experts_per_tok=3,
        moe_intermediate_size=24, norm_topk_prob=True, decoder_sparse_step=2, tie_word_embeddings=True,
        rope_theta=1e6,
    ), dict(max_shard_size="200KB"), 7),
    # DeepSeek-V3: low q and kv ranks, odd head widths (rope 8, nope 12, v 10), 12 experts in 3 groups of which 2
    # are kept, top-3 renormalised and scaled, two shared experts, two dense layers first, biases, YaRN with
    # mscale_all_dim (the softmax scale too), interleaved RoPE.
    "deepseek_odd": (dict(
        model_type="deepseek_v3", vocab_size=300, hidden_size=48, intermediate_size=72, moe_intermediate_size=12,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10, n_routed_experts=12, n_group=3, topk_group=2,
        num_experts_per_tok=3, n_shared_experts=2, first_k_dense_replace=2, attention_bias=True,
        routed_scaling_factor=1.5, max_position_embeddings=256,
        rope_parameters=dict(rope_type="yarn", rope_theta=1000.0, factor=4.0, original_max_position_embeddings=64,
                             mscale=1.0, mscale_all_dim=0.7, beta_fast=8.0, beta_slow=1.0),
    ), dict(), 10),
    # a plain q_proj, one expert group, unnormalised weights, no dense layer, plain RoPE laid out in halves, a tied
    # head, sharded
    "deepseek_plain": (dict(
        model_type="deepseek_v3", vocab_size=256, hidden_size=32, intermediate_size=40, moe_intermediate_size=8,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=None, kv_lora_rank=12,
        qk_rope_head_dim=4, qk_nope_head_dim=6, v_head_dim=8, n_routed_experts=5, n_group=1, topk_group=1,
        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=0, norm_topk_prob=False,
        rope_interleave=False, tie_word_embeddings=True, rope_theta=10000.0,
    ), dict(max_shard_size="100KB"), 7),
}


# Long positions: a small window and bias extent, so that thousands of positions wrap the sliding rings hundreds of
# times and put almost every key beyond the bias bank; log scaling from position 64 (tau reaches 2.8 at 6k).
LONG = dict(
    vocab_size=128, hidden_size=32, num_hidden_layers=4, layer_types=[S, G, S, G],
    mlp_layer_types=["dense", "sparse", "sparse", "dense"],
    num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    swa_num_attention_heads=2, swa_num_key_value_heads=1, swa_head_dim=16,
    sliding_window_size=16, rel_extent=24, d_rel=4, log_scaling_n_floor=64, log_scaling_alpha=0.4,
    intermediate_size=48, moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2,
    n_shared_experts=2, route_scale=2.5, logits_mup_width_multiplier=2.0, conv_kernel_size=4,
    max_position_embeddings=8192,
)
# DeepSeek-V3 at long positions: YaRN over a trained context of 512 (factor 16), so that most of the prompt lies
# beyond it; latents in many blocks and spans.
LONG_DEEPSEEK = dict(
    model_type="deepseek_v3", vocab_size=128, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16,
    qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, n_routed_experts=8, n_group=2, topk_group=1,
    num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, max_position_embeddings=8192,
    rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=16.0, original_max_position_embeddings=512,
                         mscale=1.0, mscale_all_dim=1.0),
)
LONG_PROMPT = 6080  # prompt tokens; then LONG_DECODE greedy tokens, one at a time with the cache
LONG_DECODE = 64
LONG_SAMPLED = 48  # prompt positions whose full-forward logits are kept (besides the last)


REFERENCES = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
              "deepseek_v3": (DeepseekV3Config, DeepseekV3ForCausalLM)}


def model_class(hf: dict):
    return REFERENCES[hf["model_type"]][1] if hf.get("model_type") in REFERENCES else InklingForCausalLM


def stacked_experts(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Qwen3-MoE's and DeepSeek-V3's experts as transformers holds them in memory: per layer gate_up_proj [E, 2I, H]
    (gate's rows, then up's) and down_proj [E, H, I], from the checkpoint's one expert at a time."""
    out, stacks = {}, {}
    for name, w in weights.items():
        prefix, sep, rest = name.partition(".mlp.experts.")
        if not sep:
            out[name] = w
            continue
        j, projection = rest.split(".")[:2]
        stacks.setdefault(prefix, {}).setdefault(projection, {})[int(j)] = w
    for prefix, by_projection in stacks.items():
        gate, up, down = (by_projection[p] for p in ("gate_proj", "up_proj", "down_proj"))
        out[f"{prefix}.mlp.experts.gate_up_proj"] = torch.stack([torch.cat([gate[j], up[j]]) for j in sorted(gate)])
        out[f"{prefix}.mlp.experts.down_proj"] = torch.stack([down[j] for j in sorted(down)])
    return out


def build_model(hf: dict, seed: int):
    if hf.get("model_type") in REFERENCES:
        config_class, model_class_ = REFERENCES[hf["model_type"]]
        model = model_class_(config_class(**{k: v for k, v in hf.items() if k != "model_type"},
                                          attn_implementation="eager"))
    else:
        model = InklingForCausalLM(InklingTextConfig(**hf, attn_implementation="eager"))
    weights = {name: torch.from_numpy(w)
               for name, w in random_weights(config_from_hf_dict({"model_type": "inkling_text"} | hf), seed)}
    if hf.get("model_type") in ("qwen3_moe", "deepseek_v3"):
        weights = stacked_experts(weights)
    # also proves the family's module names every parameter (a tied head is the embedding's, loaded with it)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and missing == (["lm_head.weight"] if model.config.tie_word_embeddings else []), missing
    return model.float().eval()


def save(model: InklingForCausalLM, out: Path, max_shard_size: str = "50GB", dtype=None, **options) -> None:
    """`options`: more of save_pretrained's (save_original_format)."""
    if out.exists():
        shutil.rmtree(out)
    if dtype is None:
        model.save_pretrained(out, max_shard_size=max_shard_size, **options)
        return
    with tempfile.TemporaryDirectory() as tmp:  # let transformers decide which modules it keeps in fp32
        model.save_pretrained(tmp)
        type(model).from_pretrained(tmp, dtype=dtype).save_pretrained(out)


@torch.no_grad()
def logits(model: InklingForCausalLM, ids: np.ndarray) -> np.ndarray:
    return model(torch.from_numpy(ids)[None]).logits[0].numpy()


@torch.no_grad()
def decode_logits(model: InklingForCausalLM, ids: np.ndarray, prefill_len: int) -> np.ndarray:
    """Logits of positions prefill_len.. when the first prefill_len tokens go in at once and the rest one by one."""
    cache = DynamicCache(config=model.config)
    tokens = torch.from_numpy(ids)[None]
    model(tokens[:, :prefill_len], cache=cache, use_cache=True)
    rows = [model(tokens[:, t:t + 1], cache=cache, use_cache=True).logits[0, 0] for t in range(prefill_len, len(ids))]
    return torch.stack(rows).numpy()


@torch.no_grad()
def check_window(model: InklingForCausalLM, ids: np.ndarray) -> str:
    """Confirm how many keys each query attends to: a sliding layer at position t sees t-W+1..t (itself included)."""
    window = model.config.sliding_window_size
    out = model(torch.from_numpy(ids)[None], output_attentions=True)
    for kind, attn in zip(model.config.layer_types, out.attentions):
        seen = (attn[0] > 0).sum(-1)  # [heads, T]: keys with nonzero weight per query
        positions = torch.arange(len(ids))
        expected = torch.clamp(positions + 1, max=window) if kind == S else positions + 1
        assert (seen == expected).all(), f"{kind}: attended keys {seen[0].tolist()}"
    return f"sliding layers attend to min(t + 1, {window}) keys, global layers to t + 1"


def make_case(name: str, hf: dict, save_options: dict, prefill_len: int, root: Path, seed: int) -> None:
    out = root / name
    save(build_model(hf, seed), out, **save_options)
    model = model_class(hf).from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()
    write_references(name, model, hf, prefill_len, out, seed)


def write_references(name: str, model, hf: dict, prefill_len: int, out: Path, seed: int) -> None:
    """reference.npz of a case: its model's logits for seeded token sequences, prefilled and decoded."""
    vocab = hf.get("unpadded_vocab_size") or hf["vocab_size"]
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, SEQ_LEN, dtype=np.int64)
    mixed_a = rng.integers(0, vocab, MIXED_LENS[0], dtype=np.int64)
    mixed_b = rng.integers(0, vocab, MIXED_LENS[1], dtype=np.int64)
    ref = dict(ids=ids, prefill_logits=logits(model, ids), prefill_len=np.int64(prefill_len),
               decode_logits=decode_logits(model, ids, prefill_len),
               mixed_a_ids=mixed_a, mixed_a_logits=logits(model, mixed_a),
               mixed_b_ids=mixed_b, mixed_b_logits=logits(model, mixed_b))
    gap = np.abs(ref["decode_logits"] - ref["prefill_logits"][prefill_len:]).max()
    assert gap <= TOLERANCE, f"{name}: cached decode differs from prefill by {gap}"
    np.savez_compressed(out / "reference.npz", **ref)
    files = sorted(p.name for p in out.iterdir())
    print(f"{name}: logits {ref['prefill_logits'].shape} (std {ref['prefill_logits'].std():.3f}), "
          f"decode vs prefill max |diff| {gap:.2e}, files {files}")
    if model_class(hf) is InklingForCausalLM:
        print(f"  {check_window(model, ids)}")


# DeepSeek-V3 as DeepSeek releases its checkpoints: each matrix of the decoder layers in FP8 (e4m3) with a float32
# factor per block (`weight_scale_inv`; blocks of 8 x 8 here, of 128 x 128 in the releases, so that the fixture's
# small matrices hold several), everything else unquantised, and a multi-token-prediction layer after the last.
FP8_BLOCK = (8, 8)
FP8_LAYER_PARTS = (".self_attn.", ".mlp.")  # matrices of these, but the router's (`mlp.gate.weight`), go FP8


def fp8_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A matrix as FP8 values and their blocks' factors: each block divided by its largest magnitude over 448."""
    rows, cols = w.shape
    blocks = -(-rows // FP8_BLOCK[0]), -(-cols // FP8_BLOCK[1])
    scale = torch.ones(blocks)
    for i in range(blocks[0]):
        for j in range(blocks[1]):
            block = w[i * FP8_BLOCK[0]:(i + 1) * FP8_BLOCK[0], j * FP8_BLOCK[1]:(j + 1) * FP8_BLOCK[1]]
            scale[i, j] = max(float(block.abs().max()), 1e-12) / 448.0
    expanded = scale.repeat_interleave(FP8_BLOCK[0], 0)[:rows].repeat_interleave(FP8_BLOCK[1], 1)[:, :cols]
    return (w / expanded).to(torch.float8_e4m3fn), scale


def make_fp8_case(root: Path, seed: int) -> None:
    """tests/fixtures/deepseek_fp8: deepseek_odd's weights stored as DeepSeek releases them; references from a
    transformers model of the values the FP8 bytes and factors hold."""
    name, (hf, _, prefill_len) = "deepseek_fp8", CASES["deepseek_odd"]
    out = root / name
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    config = config_from_hf_dict(hf)
    stored, held = {}, {}
    for tensor_name, w in random_weights(config, seed):
        w = torch.from_numpy(w)
        if w.ndim == 2 and any(part in tensor_name for part in FP8_LAYER_PARTS) and not tensor_name.endswith(
                "mlp.gate.weight"):
            values, scale = fp8_blocks(w)
            stored[tensor_name], stored[tensor_name.removesuffix("weight") + "weight_scale_inv"] = values, scale
            expanded = scale.repeat_interleave(FP8_BLOCK[0], 0).repeat_interleave(FP8_BLOCK[1], 1)
            w = values.float() * expanded[:w.shape[0], :w.shape[1]]
        else:
            stored[tensor_name] = w
        held[tensor_name] = w
    mtp = f"model.layers.{hf['num_hidden_layers']}."  # what a release holds there, in part
    generator = torch.Generator().manual_seed(seed)
    stored |= {mtp + "enorm.weight": torch.ones(hf["hidden_size"]),
               mtp + "eh_proj.weight": torch.randn(hf["hidden_size"], 2 * hf["hidden_size"], generator=generator)}
    save_file({key: value.contiguous() for key, value in stored.items()}, out / "model.safetensors",
              metadata={"format": "pt"})
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**{k: v for k, v in hf.items() if k != "model_type"},
                                                   attn_implementation="eager"))
    missing, unexpected = model.load_state_dict(stacked_experts(held), strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    raw = model.config.to_dict() | {"num_nextn_predict_layers": 1, "quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(FP8_BLOCK)}}
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    write_references(name, model.float().eval(), hf, prefill_len, out, seed)


@torch.no_grad()
def greedy(model: InklingForCausalLM, prompt: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """n greedy tokens after the prompt (prompt at once, then one token at a time with the cache), and the logits
    each was taken from [n, V]."""
    cache = DynamicCache(config=model.config)
    row = model(torch.from_numpy(prompt)[None], cache=cache, use_cache=True).logits[0, -1]
    tokens, rows = [], []
    for _ in range(n):
        rows.append(row)
        tokens.append(int(row.argmax()))
        row = model(torch.tensor([[tokens[-1]]]), cache=cache, use_cache=True).logits[0, 0]
    return np.array(tokens, np.int64), torch.stack(rows).numpy()


def make_long_case(root: Path, seed: int, name: str = "long", hf: dict = LONG) -> None:
    """tests/fixtures/<name> (long, long_deepseek): config.json and reference.npz (see tests/fixtures/README.md)."""
    out = root / name
    out.mkdir(parents=True, exist_ok=True)
    model = build_model(hf, seed)
    config = config_from_hf_dict({"model_type": "inkling_text"} | hf)
    (out / "config.json").write_text(json.dumps(config.to_hf_dict(), indent=2) + "\n")
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, hf["vocab_size"], LONG_PROMPT, dtype=np.int64)
    full = logits(model, prompt)
    positions = np.unique(np.r_[np.sort(rng.choice(LONG_PROMPT - 1, LONG_SAMPLED, replace=False)), LONG_PROMPT - 1])
    tokens, decode = greedy(model, prompt, LONG_DECODE)
    whole = logits(model, np.r_[prompt, tokens[:-1]])[LONG_PROMPT - 1:]
    gap = np.abs(decode - whole).max()
    assert gap <= TOLERANCE, f"{name}: cached decode differs from the full forward by {gap}"
    np.savez_compressed(out / "reference.npz", seed=np.int64(seed), prompt_ids=prompt, positions=positions,
                        prompt_logits=full[positions], greedy_ids=tokens, greedy_logits=decode)
    print(f"{name}: {LONG_PROMPT} prompt tokens, logits at {len(positions)} positions (std {full.std():.3f}), "
          f"{LONG_DECODE} greedy tokens; cached decode vs full forward max |diff| {gap:.2e}")


# (temperature, top_k, top_p, min_p): each alone, then together
SAMPLING_SETTINGS = [(1.0, 0, 1.0, 0.0), (0.7, 0, 1.0, 0.0), (1.0, 5, 1.0, 0.0), (1.0, 40, 1.0, 0.0),
                     (1.0, 0, 0.9, 0.0), (1.3, 0, 0.5, 0.0), (1.0, 0, 1.0, 0.05), (0.8, 0, 1.0, 0.2),
                     (0.8, 20, 0.9, 0.0), (1.2, 50, 0.95, 0.05), (0.6, 0, 0.8, 0.1), (1.0, 300, 0.99, 0.01)]


def make_sampling_case(root: Path, seed: int) -> None:
    """tests/fixtures/sampling/warpers.npz: the distribution transformers' logits warpers leave, in their order
    (temperature, top-k, top-p, min-p), for random logits under each of SAMPLING_SETTINGS."""
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal((len(SAMPLING_SETTINGS), 256)) * 3).astype(np.float32)
    probs = []
    for row, (temperature, top_k, top_p, min_p) in zip(logits, SAMPLING_SETTINGS):
        scores = torch.from_numpy(row)[None]
        warpers = [TemperatureLogitsWarper(temperature), TopKLogitsWarper(top_k) if top_k else None,
                   TopPLogitsWarper(top_p) if top_p < 1 else None, MinPLogitsWarper(min_p) if min_p else None]
        for warper in filter(None, warpers):
            scores = warper(None, scores)
        probs.append(scores.softmax(-1)[0].numpy())
    out = root / "sampling"
    out.mkdir(parents=True, exist_ok=True)
    np.savez(out / "warpers.npz", logits=logits, settings=np.array(SAMPLING_SETTINGS, np.float64),
             probs=np.array(probs, np.float32))
    print(f"wrote {out / 'warpers.npz'}")


# (min_tokens, logit_bias, repetition_penalty): each alone, then together; after a prompt of 12 and 5 output tokens
ADJUSTMENT_SETTINGS = [(8, {}, 1.0), (3, {}, 1.0), (0, {7: 5.0, 9: -100.0, 200: 0.5}, 1.0), (0, {}, 1.3),
                       (0, {}, 0.8), (10, {3: 2.0, 4: -1.5}, 1.2), (0, {11: 30.0}, 2.0)]
ADJUSTMENT_PROMPT, ADJUSTMENT_OUTPUT, ADJUSTMENT_STOP = 12, 5, (1, 2)


def make_adjustments_case(root: Path, seed: int) -> None:
    """tests/fixtures/sampling/adjustments.npz: logits as transformers' processors change them, in vLLM's order
    (MinNewTokensLength for min_tokens, SequenceBias for logit_bias, RepetitionPenalty), for random logits and
    tokens under each of ADJUSTMENT_SETTINGS."""
    rng = np.random.default_rng(seed + 1)
    n = len(ADJUSTMENT_SETTINGS)
    logits = (rng.standard_normal((n, 256)) * 3).astype(np.float32)
    tokens = rng.integers(0, 40, (n, ADJUSTMENT_PROMPT + ADJUSTMENT_OUTPUT))  # a small range: tokens come again
    changed = []
    for row, ids, (min_tokens, bias, penalty) in zip(logits, tokens, ADJUSTMENT_SETTINGS):
        scores, input_ids = torch.from_numpy(row.copy())[None], torch.from_numpy(ids)[None]
        processors = [MinNewTokensLengthLogitsProcessor(ADJUSTMENT_PROMPT, min_tokens, list(ADJUSTMENT_STOP))
                      if min_tokens else None,
                      SequenceBiasLogitsProcessor([[[token], value] for token, value in bias.items()])
                      if bias else None,
                      RepetitionPenaltyLogitsProcessor(penalty) if penalty != 1.0 else None]
        for processor in filter(None, processors):
            scores = processor(input_ids, scores)
        changed.append(scores[0].numpy())
    out = root / "sampling"
    out.mkdir(parents=True, exist_ok=True)
    np.savez(out / "adjustments.npz", logits=logits, tokens=tokens, changed=np.array(changed, np.float32),
             settings=json.dumps([[m, sorted(b.items()), p] for m, b, p in ADJUSTMENT_SETTINGS]),
             prompt=ADJUSTMENT_PROMPT, stop=np.array(ADJUSTMENT_STOP))
    print(f"wrote {out / 'adjustments.npz'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("tests/fixtures"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", choices=[*CASES, "deepseek_fp8", "long", "long_deepseek", "sampling"],
                        help="write this case alone")
    args = parser.parse_args()
    for name, (hf, save_options, prefill_len) in CASES.items():
        if args.only in (None, name):
            make_case(name, hf, save_options, prefill_len, args.out, args.seed)
    if args.only in (None, "deepseek_fp8"):
        make_fp8_case(args.out, args.seed)
    if args.only in (None, "long"):
        make_long_case(args.out, args.seed)
    if args.only in (None, "long_deepseek"):
        make_long_case(args.out, args.seed, "long_deepseek", LONG_DEEPSEEK)
    if args.only in (None, "sampling"):
        make_sampling_case(args.out, args.seed)
        make_adjustments_case(args.out, args.seed)


if __name__ == "__main__":
    main()
