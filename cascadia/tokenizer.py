"""A small byte-level BPE tokenizer for random checkpoints, trained on a short embedded English text.

Byte-level, so every string round-trips whatever the merges. The special tokens come first so that their ids match
the model config (bos, eos, pad); the rest of the vocabulary is the 256 bytes and as many merges as the text allows,
up to the model's output vocabulary.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from cascadia.errors import CheckpointError
from cascadia.files import UnreadableFile, read_text
from cascadia.models.base import ModelConfig
from cascadia.spec.types import WorkloadSpec
from cascadia.workload import load_prompts

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"  # the Hugging Face place of the special tokens and chat template
# A chat as text, in the Hugging Face convention (Jinja2 over `messages`, `tools`, `add_generation_prompt` and the
# special tokens): the functions offered first, under the system's marker; each message under its role's marker,
# an assistant's calls after its text in Hermes' form (cascadia/serve/tools.py), ended by EOS; then the assistant's
# marker for the reply.
CHAT_TEMPLATE = ("{{ bos_token }}{% if tools %}<|system|>\nYou may call these functions, each call as <tool_call>"
                 "{\"name\": ..., \"arguments\": {...}}</tool_call>:\n{% for tool in tools %}{{ tool | tojson }}\n"
                 "{% endfor %}{{ eos_token }}\n{% endif %}{% for message in messages %}<|{{ message['role'] }}|>\n"
                 "{{ message['content'] }}{% for call in message['tool_calls'] or [] %}<tool_call>"
                 "{{ {'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson }}"
                 "</tool_call>{% endfor %}{{ eos_token }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
BYTES = 256
MAX_SPECIAL_ID = 255  # special ids beyond this are not placed: the ids below them would all need reserved tokens
MAX_TOKENIZER_FILE_BYTES = 256 * 1024**2  # a 200k-entry vocabulary with its merges takes tens of MiB

TEXT = """\
A fleet of ordinary computers can hold a model that none of them could hold alone. Each machine keeps a run of
consecutive layers in its memory, and the hidden state of every token travels from one machine to the next, like a
note passed along a row of desks. The first machine turns words into vectors, the last one turns vectors back into
words, and the machines in between refine what they receive before they hand it on.

The work is not free. Every hop across the network costs time, and every machine must wait when the one before it is
slow. So the planner weighs memory, bandwidth and arithmetic together: it places layers where they fit, keeps the
busiest links short, and lets many conversations share the pipeline at once, so that no machine sits idle while
another is working. When a new request arrives, its prompt is read in one large step; after that, each new word needs
only a small step through every layer, using the keys and values that each layer remembered from before.

Experts make the model large but each token cheap. A router looks at the token and picks a few experts out of many;
only those experts do any work for it, while the shared experts see every token. The experts that are rarely chosen
still need memory, which is why the weights are stored compactly and why a careful plan matters more than a fast disk.

Measure first, then predict. A simulator that follows the same rules as the real system can tell, before anything is
bought or wired, how many words per second a fleet will produce and how long a person will wait for the first word.
"""


class TokenizerError(CheckpointError):
    """A tokenizer that cannot be built for a model, or a tokenizer file that cannot be read."""


def special_tokens(cfg: ModelConfig) -> list[str]:
    """Special tokens in id order: bos, eos and pad at their config ids, reserved tokens filling the gaps."""
    eos = cfg.eos_token_id if isinstance(cfg.eos_token_id, list) else [cfg.eos_token_id]
    named = {cfg.bos_token_id: "<|bos|>", cfg.pad_token_id: "<|pad|>"}
    named |= {token_id: "<|eos|>" if i == 0 else f"<|eos_{i}|>" for i, token_id in enumerate(eos)}
    placed = {i: name for i, name in named.items() if i is not None and 0 <= i <= MAX_SPECIAL_ID}
    count = max(placed, default=-1) + 1
    return [placed.get(i, f"<|reserved_{i}|>") for i in range(count)]


def tokenizer_config(cfg: ModelConfig) -> dict[str, str]:
    """The `tokenizer_config.json` of a random checkpoint: its special tokens and `CHAT_TEMPLATE`."""
    specials = special_tokens(cfg)
    eos = cfg.eos_token_id[0] if isinstance(cfg.eos_token_id, list) and cfg.eos_token_id else cfg.eos_token_id
    named = {"bos_token": cfg.bos_token_id, "eos_token": eos}
    return {key: specials[i] for key, i in named.items() if i is not None and i < len(specials)} | {
        "chat_template": CHAT_TEMPLATE}


def build_tokenizer(cfg: ModelConfig, texts: Iterable[str] | None = None) -> Tokenizer:
    """Train the tokenizer for a model on `texts` (default: `TEXT`'s paragraphs); at most `cfg.output_vocab_size`
    entries (fewer when the text runs out of merges). Raises TokenizerError when the vocabulary cannot even hold the
    bytes and the special tokens."""
    specials = special_tokens(cfg)
    if cfg.output_vocab_size < BYTES + len(specials):
        raise TokenizerError(f"a byte-level tokenizer needs {BYTES + len(specials)} entries ({len(specials)} special "
                             f"+ {BYTES} bytes), the model has only {cfg.output_vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=cfg.output_vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(TEXT.split("\n\n") if texts is None else texts, trainer)
    return tokenizer


def load_tokenizer(path: str | Path) -> Tokenizer:
    """A tokenizer from `tokenizer.json` or from the checkpoint directory holding it."""
    path = Path(path)
    if path.is_dir():
        path = path / TOKENIZER_FILE
    try:
        return Tokenizer.from_str(read_text(path, MAX_TOKENIZER_FILE_BYTES, "a tokenizer file"))
    except UnreadableFile as e:
        raise TokenizerError(f"{path}: cannot read a tokenizer: {e}") from None
    except Exception as e:  # the tokenizers library raises a bare Exception for a malformed file
        raise TokenizerError(f"{path}: cannot read a tokenizer ({e})") from None


def workload_prompts(workload: WorkloadSpec, checkpoint: Path | None, config: ModelConfig
                     ) -> list[tuple[int, ...]] | None:
    """The prompts of the workload's file (None without one), their ids checked against the model's vocabulary;
    {"text": ...} lines are encoded with the checkpoint's tokenizer.json, read at the first such line."""
    if workload.prompts_file is None:
        return None

    @functools.cache
    def tokenizer() -> Tokenizer:
        if checkpoint is None:
            raise TokenizerError("a 'text' prompt needs the checkpoint's tokenizer.json, and the model names no "
                                 "checkpoint")
        return load_tokenizer(checkpoint)

    def encode(text: str) -> Sequence[int]:
        return tokenizer().encode(text).ids

    return load_prompts(workload.prompts_file, encode, config.vocab_size)
