"""Write tests/fixtures/param_counts.json: parameter counts per op kind of transformers' InklingForCausalLM,
LlamaForCausalLM, Qwen3MoeForCausalLM and DeepseekV3ForCausalLM, for the released sizes and for small configurations
of odd shapes.

Reference tooling, run by a developer (needs torch and transformers, `pip install -e .[dev]`), never by the tests:
    python scripts/count_params.py
The models are built on the meta device, so even the full 947B-parameter configuration takes no memory. Counts
cover every stored tensor (the state dict: parameters and persistent buffers such as the router's correction bias;
a tied head is stored once, as the embedding), and the parameters one token uses (`active`: top-k of the routed
experts). The small configurations also record every tensor's shape (but the routed experts of Qwen3-MoE and
DeepSeek-V3: transformers holds them stacked in memory and saves them one by one), and each Llama, Qwen3-MoE or
DeepSeek-V3 its RoPE as transformers reads it (`rope_parameters`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from transformers import (DeepseekV3Config, DeepseekV3ForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig,
                          Qwen3MoeForCausalLM)
from transformers.models.inkling.configuration_inkling import InklingTextConfig
from transformers.models.inkling.modeling_inkling import InklingForCausalLM

from cascadia.graph.costs import EMBEDDING, FINAL_NORM, HEAD
from cascadia.models import config_from_hf_dict, family

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "param_counts.json"
LLAMA_31 = {"model_type": "llama", "vocab_size": 128256, "num_attention_heads": 32, "num_key_value_heads": 8,
            "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 131072,
            "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192},
            "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009]}

QWEN3 = {"model_type": "qwen3_moe", "vocab_size": 151936, "num_key_value_heads": 4, "head_dim": 128,
         "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True, "rope_theta": 1e6,
         "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}

# DeepSeek-V3's config.json as released; Kimi K2 Instruct 0905's differs in the keys below
DEEPSEEK_V3 = {"model_type": "deepseek_v3", "vocab_size": 129280, "max_position_embeddings": 163840,
               "rope_theta": 10000.0, "num_nextn_predict_layers": 1,
               "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                                "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}}
KIMI_K2 = DEEPSEEK_V3 | {"vocab_size": 163840, "num_attention_heads": 64, "num_key_value_heads": 64,
                         "n_routed_experts": 384, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
                         "routed_scaling_factor": 2.827, "max_position_embeddings": 262144, "rope_theta": 50000.0,
                         "rope_scaling": {"type": "yarn", "factor": 64, "original_max_position_embeddings": 4096,
                                          "beta_fast": 1, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}}

CONFIGS = {
    # the released model
    "inkling": {"model_type": "inkling_text", "dense_mlp_idx": 2, "unpadded_vocab_size": 200058},
    # an unpadded head and odd widths
    "small_unpadded": {
        "model_type": "inkling_text", "vocab_size": 1000, "unpadded_vocab_size": 997, "hidden_size": 40,
        "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 12, "swa_num_attention_heads": 4,
        "swa_num_key_value_heads": 4, "swa_head_dim": 12, "sliding_window_size": 8, "d_rel": 3, "rel_extent": 20,
        "intermediate_size": 72, "moe_intermediate_size": 24, "n_routed_experts": 5, "num_experts_per_tok": 2,
        "n_shared_experts": 1, "dense_mlp_idx": 1,
    },
    # dense and sparse MLPs interleaved, not just a dense prefix
    "small_mixed": {
        "model_type": "inkling_text", "vocab_size": 301, "hidden_size": 48, "num_hidden_layers": 5,
        "mlp_layer_types": ["sparse", "dense", "sparse", "dense", "sparse"],
        "num_attention_heads": 6, "num_key_value_heads": 3, "head_dim": 8, "swa_num_attention_heads": 6,
        "swa_num_key_value_heads": 2, "swa_head_dim": 8, "sliding_window_size": 6, "d_rel": 2, "rel_extent": 10,
        "intermediate_size": 40, "moe_intermediate_size": 16, "n_routed_experts": 7, "num_experts_per_tok": 3,
        "n_shared_experts": 2,
    },
    # sliding and global layers with different head counts and head widths, a custom local-layer set
    "small_heads": {
        "model_type": "inkling_text", "vocab_size": 512, "hidden_size": 32, "num_hidden_layers": 4,
        "local_layer_ids": [0, 2],
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 24, "swa_num_attention_heads": 8,
        "swa_num_key_value_heads": 4, "swa_head_dim": 16, "sliding_window_size": 5, "d_rel": 4, "rel_extent": 11,
        "conv_kernel_size": 3, "intermediate_size": 64, "moe_intermediate_size": 8, "n_routed_experts": 6,
        "num_experts_per_tok": 2, "n_shared_experts": 3, "dense_mlp_idx": 2,
    },
    # Llama 3.1 as released (Meta's config.json files)
    "llama-3.1-8b": LLAMA_31 | {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32},
    "llama-3.1-70b": LLAMA_31 | {"hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                                 "num_attention_heads": 64},
    # grouped-query attention, head_dim not hidden / heads, biases, a tied head; transformers 5's RoPE keys
    "llama_small_odd": {
        "model_type": "llama", "vocab_size": 300, "hidden_size": 48, "intermediate_size": 80, "num_hidden_layers": 3,
        "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 12, "attention_bias": True,
        "mlp_bias": True, "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 1000.0, "factor": 4.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 2.0, "original_max_position_embeddings": 64},
    },
    # every default but the sizes: as many key/value heads as query heads, head_dim hidden / heads; linear RoPE
    # under its older key
    "llama_small_plain": {
        "model_type": "llama", "vocab_size": 250, "hidden_size": 32, "intermediate_size": 56, "num_hidden_layers": 2,
        "num_attention_heads": 4, "rope_scaling": {"type": "linear", "factor": 2.0},
    },
    # Qwen3-MoE as released (Qwen's config.json files; 235B's hidden and expert widths from the Qwen3 report)
    "qwen3-30b-a3b": QWEN3 | {"hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48,
                              "num_attention_heads": 32, "moe_intermediate_size": 768},
    "qwen3-235b-a22b": QWEN3 | {"hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 94,
                                "num_attention_heads": 64, "moe_intermediate_size": 1536},
    # dense layers among MoE ones (decoder_sparse_step 2 and mlp_only_layers), head_dim not hidden / heads, biases
    "qwen3_small_odd": {
        "model_type": "qwen3_moe", "vocab_size": 300, "hidden_size": 48, "intermediate_size": 72,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 20,
        "attention_bias": True, "num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
        "decoder_sparse_step": 2, "mlp_only_layers": [3], "rope_theta": 1e6,
    },
    "deepseek-v3": DEEPSEEK_V3,
    "kimi-k2": KIMI_K2,
    # low ranks, several expert groups, two dense layers, two shared experts, biases, YaRN in transformers 5's keys
    "deepseek_small_odd": {
        "model_type": "deepseek_v3", "vocab_size": 300, "hidden_size": 48, "intermediate_size": 72,
        "moe_intermediate_size": 12, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4,
        "q_lora_rank": 24, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 12, "v_head_dim": 10,
        "n_routed_experts": 12, "n_group": 3, "topk_group": 2, "num_experts_per_tok": 3, "n_shared_experts": 2,
        "first_k_dense_replace": 2, "attention_bias": True, "routed_scaling_factor": 1.5,
        "max_position_embeddings": 256,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 1000.0, "factor": 4.0,
                            "original_max_position_embeddings": 64, "mscale_all_dim": 0.7},
    },
    # a plain q_proj (no q_lora_rank), one group, one shared expert, no dense layer, plain RoPE
    "deepseek_small_plain": {
        "model_type": "deepseek_v3", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 40,
        "moe_intermediate_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
        "q_lora_rank": None, "kv_lora_rank": 12, "qk_rope_head_dim": 4, "qk_nope_head_dim": 6, "v_head_dim": 8,
        "n_routed_experts": 5, "n_group": 1, "topk_group": 1, "num_experts_per_tok": 2, "n_shared_experts": 1,
        "first_k_dense_replace": 0,
    },
}


REFERENCES = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
              "deepseek_v3": (DeepseekV3Config, DeepseekV3ForCausalLM)}
STACKED_EXPERTS = ("qwen3_moe", "deepseek_v3")  # families whose routed experts transformers holds stacked


def count(raw: dict, with_shapes: bool) -> dict:
    if raw.get("model_type") in REFERENCES:
        config_class, build = REFERENCES[raw["model_type"]]
        config = config_class(**{k: v for k, v in raw.items() if k != "model_type"})
    else:
        config, build = InklingTextConfig(**{k: v for k, v in raw.items() if k != "model_type"}), InklingForCausalLM
    with torch.device("meta"):
        model = build(config)
    ours = config_from_hf_dict(raw)
    by_kind: dict[str, int] = {}
    shapes = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and getattr(config, "tie_word_embeddings", False):
            continue  # the embedding's own tensor: saved once
        kind = tensor_kind(ours, name)
        by_kind[kind] = by_kind.get(kind, 0) + tensor.numel()
        shapes[name] = list(tensor.shape)
    out = {"config": raw, "total": sum(by_kind.values()), "params_by_kind": dict(sorted(by_kind.items()))}
    experts, top_k = ours.routed_experts
    routed = by_kind.get("routed_experts", 0)
    out["active"] = out["total"] - routed + routed // experts * top_k if experts else out["total"]
    if with_shapes:
        stacked = raw.get("model_type") in STACKED_EXPERTS
        out["shapes"] = {name: shape for name, shape in shapes.items() if not (stacked and ".mlp.experts." in name)}
    if raw.get("model_type") in REFERENCES:
        out["rope_parameters"] = dict(config.rope_parameters)
    return out


def tensor_kind(config, name: str) -> str:
    if name.startswith("model.embed_tokens."):
        return EMBEDDING
    if name == "model.norm.weight":
        return FINAL_NORM
    if name == "lm_head.weight":
        return HEAD
    prefix, layer, rest = name.split(".", 3)[1:]  # "model.layers.<i>.<rest>"
    assert prefix == "layers", name
    return family(config).op_kind(rest)


def main() -> None:
    configs = {name: count(raw, with_shapes="small" in name) for name, raw in CONFIGS.items()}
    body = {"generated_by": "scripts/count_params.py", "transformers": transformers.__version__, "configs": configs}
    OUT.write_text(json.dumps(body, indent=1) + "\n")
    for name, c in configs.items():
        print(f"{name}: {c['total']:,} parameters, {c['active']:,} active")


if __name__ == "__main__":
    main()
