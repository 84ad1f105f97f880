"""The benches' random mid-size Inkling: the sizes and weight formats they share, and its checkpoint, written once.

The benches import it as `random_model`: `python bench/engine.py` puts bench/ first on the module path.
"""

from __future__ import annotations

from pathlib import Path

from cascadia.engine.init_model import init_model
from cascadia.models import read_config
from cascadia.models.inkling import InklingConfig
from cascadia.spec.types import WeightFormat, WeightFormats

# config.json keys over specs/tiny's config: hidden 1024; 8 layers, the first dense, the others 64 experts top-6 plus
# 2 shared of width 512; vocabulary 32k. Each bench adds its own layer types and dense MLP width.
MID_SIZES = {"hidden_size": 1024, "num_hidden_layers": 8, "n_routed_experts": 64, "num_experts_per_tok": 6,
             "n_shared_experts": 2, "moe_intermediate_size": 512, "vocab_size": 32000,
             "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 64, "swa_num_attention_heads": 16,
             "swa_num_key_value_heads": 4, "swa_head_dim": 64, "sliding_window_size": 128, "d_rel": 16,
             "rel_extent": 256, "log_scaling_n_floor": 64, "mlp_layer_types": ["dense"] + ["sparse"] * 7}
QUICK_SIZES = {"hidden_size": 256, "n_routed_experts": 16, "moe_intermediate_size": 128, "vocab_size": 4096}  # --quick
# The paper's formats: experts int4 in groups of 32, the rest int8.
FORMATS = WeightFormats(routed_experts=WeightFormat("int4", 32), shared_experts=WeightFormat("int4", 32),
                        attention=WeightFormat("int8"), dense_mlp=WeightFormat("int8"),
                        embedding=WeightFormat("int8"), head=WeightFormat("int8"))


# The pipeline benches' model, as specs/mid-pinned.yaml serves it: MID_SIZES, three sliding layers to one global
# twice, a dense MLP of width 2048.
MID_CONFIG = Path(__file__).parent.parent / "specs" / "mid" / "config.json"
QUICK_MID = QUICK_SIZES | {"intermediate_size": 512}


def mid_config(quick: bool) -> InklingConfig:
    """specs/mid's config; with `quick` at QUICK_SIZES."""
    config = read_config(MID_CONFIG)
    return InklingConfig.from_hf_dict(config.to_hf_dict() | QUICK_MID) if quick else config


def model_config(sizes: dict) -> InklingConfig:
    """specs/tiny's config with `sizes` (config.json keys) over it."""
    base = read_config(Path(__file__).parent.parent / "specs" / "tiny" / "config.json").to_hf_dict()
    return InklingConfig.from_hf_dict(base | sizes)


def random_checkpoint(config: InklingConfig, folder: Path, quick: bool, seed: int) -> Path:
    """A random bf16 checkpoint of `config` in `folder` (with --quick, `folder`-quick), written on first use and
    again when the config changes."""
    path = folder.with_name(folder.name + ("-quick" if quick else ""))
    if not (path / "config.json").is_file() or read_config(path / "config.json") != config:
        print(f"writing a random checkpoint to {path} ...", flush=True)
        init_model(config, path, seed=seed, dtype="bf16")
    return path
