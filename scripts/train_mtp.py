"""Train a multi-token-prediction (MTP) head for the trained tiny model, its weights frozen (needs torch and
transformers, and the corpus of scripts/train_tiny.py).

The head is DeepSeek-V3's MTP layer in Inkling's terms, and this module is its reference: at position i the
model's final hidden state (after its norm) and the embedding of token i+1 are each RMS-normed, concatenated hidden
state first (`mtp_hidden_states_first`), projected back to the model's width (`eh_proj`), and passed through one
decoder layer (global attention as `mtp_local_layer_ids: null` says, a dense MLP) and a norm; the model's own head
turns that into logits for token i+2: a draft one token further than the model's own prediction. transformers'
Inkling ignores `model.mtp.*`, so the head travels in a shard of its own (mtp.safetensors, f32) beside the model's
unchanged weights, both listed in model.safetensors.index.json, and config.json says `num_mtp_layers: 1`.

It prints the held-out loss and how often the head's top token at position i equals the model's own top token at
position i+1 (both reading the true text): the share of drafts that greedy decoding would accept, teacher-forced.

    python scripts/train_mtp.py                       # specs/tiny-chat: adds the head and its line in the card
    python scripts/train_mtp.py --steps 20 --out /tmp/tiny-try
    python scripts/train_mtp.py --reference-only      # tests/fixtures/tiny_chat/mtp_reference.npz from specs/tiny-chat
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer
from torch import nn
from transformers import InklingForCausalLM
from transformers.models.inkling.configuration_inkling import InklingTextConfig
from transformers.models.inkling.modeling_inkling import InklingRMSNorm, InklingTextModel

sys.path.insert(0, str(Path(__file__).parent))
from train_tiny import (CHECKPOINT, HELD_OUT_EVERY, REFERENCE, ROOT, batches, documents, faq_chats,  # noqa: E402
                        start, streams, training_options, windows)

from cascadia.tokenizer import TOKENIZER_CONFIG_FILE, TOKENIZER_FILE  # noqa: E402

MTP_FILE = "mtp.safetensors"
MTP_REFERENCE = REFERENCE.with_name("mtp_reference.npz")
INDEX_FILE = "model.safetensors.index.json"
PREFIX = "model.mtp.layers.0."
STEPS = 1200


class MultiTokenPrediction(nn.Module):
    """One MTP layer: normed hidden state and next token's embedding, concatenated and projected, one decoder layer
    with global attention and a dense MLP, a final norm."""

    def __init__(self, config: InklingTextConfig, fields: dict):
        """`fields`: the model's config.json."""
        super().__init__()
        fields = {key: value for key, value in fields.items()
                  if key not in ("architectures", "model_type", "dtype", "transformers_version")}
        block = InklingTextConfig(**(fields | dict(num_hidden_layers=1, layer_types=["hybrid"],
                                                   mlp_layer_types=["dense"], num_mtp_layers=None)),
                                  attn_implementation="eager")
        self.hnorm = InklingRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.enorm = InklingRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.block = InklingTextModel(block)  # its own embedding is never used, and not saved

    def forward(self, hidden: torch.Tensor, next_embeds: torch.Tensor) -> torch.Tensor:
        x = self.eh_proj(torch.cat([self.hnorm(hidden), self.enorm(next_embeds)], dim=-1))
        return self.block(inputs_embeds=x).last_hidden_state

    @classmethod
    def saved(cls, checkpoint: Path) -> MultiTokenPrediction:
        """The head stored in a checkpoint's mtp.safetensors, in f32."""
        head = cls(InklingTextConfig.from_pretrained(checkpoint), json.loads((checkpoint / "config.json").read_text()))
        own = head.state_dict()
        stored = {name.removeprefix(PREFIX): tensor for name, tensor in load_file(checkpoint / MTP_FILE).items()}
        for name in own:
            if not name.startswith("block.embed_tokens."):
                rel = name.removeprefix("block.layers.0.").removeprefix("block.")
                own[name] = stored.pop(rel)
        if stored:
            raise ValueError(f"{checkpoint / MTP_FILE}: tensors the head does not have: {sorted(stored)}")
        head.load_state_dict(own)
        return head.eval()

    def stored(self) -> dict[str, torch.Tensor]:
        """The head's tensors under the checkpoint's names (model.mtp.layers.0.*)."""
        out = {}
        for name, tensor in self.state_dict().items():
            if name.startswith("block.embed_tokens."):
                continue
            name = name.removeprefix("block.layers.0.").removeprefix("block.")
            out[PREFIX + name] = tensor.detach().float().contiguous()
        return out


def mtp_logits(model, head: MultiTokenPrediction, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the head's logits at positions 0..T-2, for tokens 2..T; the model's own logits at positions 0..T-1)."""
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
        hidden = out.hidden_states[-1]  # the final hidden state, after the model's norm
        next_embeds = model.model.embed_tokens(ids[:, 1:])
    drafted = head(hidden[:, :-1], next_embeds) / model.config.logits_mup_width_multiplier
    return model.lm_head(drafted), out.logits


def evaluate(model, head, stream: np.ndarray, length: int, batch: int) -> tuple[float, float]:
    """(held-out loss of the head, share of positions where its top token is the model's next top token)."""
    head.eval()
    starts = np.arange(0, len(stream) - length, length)
    losses, agreed, counted = [], 0, 0
    with torch.no_grad():
        for i in range(0, len(starts), batch):
            ids = windows(stream, starts[i:i + batch], length)
            drafted, own = mtp_logits(model, head, ids)
            losses.append(float(nn.functional.cross_entropy(drafted[:, :-1].flatten(0, 1), ids[:, 2:].flatten())))
            agreed += int((drafted.argmax(-1) == own[:, 1:].argmax(-1)).sum())
            counted += drafted.shape[0] * drafted.shape[1]
    head.train()
    return float(np.mean(losses)), agreed / counted


def save(out: Path, head: MultiTokenPrediction) -> None:
    """mtp.safetensors, the index listing both shards, and `num_mtp_layers: 1` in config.json."""
    tensors = head.stored()
    save_file(tensors, out / MTP_FILE, metadata={"format": "pt"})
    base = load_file(out / "model.safetensors")
    weight_map = {name: "model.safetensors" for name in sorted(base)} | {name: MTP_FILE for name in sorted(tensors)}
    size = sum(t.numel() * t.element_size() for t in [*base.values(), *tensors.values()])
    (out / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": size}, "weight_map": weight_map}, indent=2)
                                  + "\n")
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(config | {"num_mtp_layers": 1}, indent=2, sort_keys=True) + "\n")


def main() -> None:
    args = training_options(__doc__.split("\n\n")[0], STEPS, MTP_REFERENCE).parse_args()
    if args.reference_only:
        return write_reference(args.out)
    start(args)
    began = time.perf_counter()
    model = InklingForCausalLM.from_pretrained(args.out, dtype=torch.float32, attn_implementation="eager").eval()
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    tokenizer = Tokenizer.from_file(str(args.out / TOKENIZER_FILE))
    specials = json.loads((args.out / TOKENIZER_CONFIG_FILE).read_text())
    docs = documents(args.corpus)
    chats = faq_chats(args.corpus, specials["bos_token"], specials["eos_token"])
    train_stream, held_stream = streams(tokenizer, docs, chats, model.config.bos_token_id, model.config.eos_token_id)
    head = MultiTokenPrediction(model.config, json.loads((args.out / "config.json").read_text()))
    head.train()
    trained = [p for name, p in head.named_parameters() if not name.startswith("block.embed_tokens.")]
    optimizer = torch.optim.AdamW(trained, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    print(f"head: {sum(p.numel() for p in trained) / 1e6:.2f}M parameters")
    for step, ids in batches(args, train_stream, optimizer):
        drafted, _ = mtp_logits(model, head, ids)
        loss = nn.functional.cross_entropy(drafted[:, :-1].flatten(0, 1), ids[:, 2:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 100 == 0 or step == args.steps - 1:
            print(f"step {step}: loss {loss.item():.3f} ({time.perf_counter() - began:.0f} s)", flush=True)
    held_loss, agreement = evaluate(model, head, held_stream, args.length, args.batch)
    minutes = (time.perf_counter() - began) / 60
    print(f"held out (every {HELD_OUT_EVERY}th document and chat): loss {held_loss:.3f} (perplexity "
          f"{math.exp(held_loss):.1f}); top token the model's next top token at {agreement:.1%} of positions "
          f"({minutes:.1f} min)")
    save(args.out, head)
    note_in_card(args.out, f"- Multi-token prediction: one MTP layer ({sum(p.numel() for p in trained) / 1e6:.2f}M "
                           f"parameters, `mtp.safetensors`) trained on the frozen model by `scripts/train_mtp.py`, "
                           f"{args.steps:,} steps, {minutes:.0f} minutes; held out, its top token is the model's next "
                           f"one at {agreement:.0%} of positions (loss {held_loss:.3f}).")
    if args.out.resolve() == CHECKPOINT:  # the tests' reference is of the committed checkpoint only
        write_reference(args.out)


def write_reference(checkpoint: Path) -> None:
    """What the tests hold the engine's MTP layer to: the head's f32 logits at every position of the model's
    reference text (tests/fixtures/tiny_chat/reference.npz's ids), teacher-forced."""
    model = InklingForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, attn_implementation="eager").eval()
    ids = torch.from_numpy(np.load(REFERENCE)["ids"])[None]
    with torch.no_grad():
        drafted, _ = mtp_logits(model, MultiTokenPrediction.saved(checkpoint), ids)
    np.savez_compressed(MTP_REFERENCE, ids=ids[0].numpy(), mtp_logits=drafted[0].numpy())
    print(f"wrote {MTP_REFERENCE.relative_to(ROOT)}: {drafted.shape[1]} positions")


def note_in_card(out: Path, line: str) -> None:
    """Put the head's line in the model card, before its exactness line (replacing an earlier head's)."""
    card = out / "README.md"
    lines = [kept for kept in card.read_text().splitlines() if not kept.startswith("- Multi-token prediction:")]
    at = next(i for i, kept in enumerate(lines) if kept.startswith("- Exactness:"))
    card.write_text("\n".join([*lines[:at], line, *lines[at:]]) + "\n")


if __name__ == "__main__":
    main()
