"""What holding replies to a JSON schema costs at the last stage: compiling the schema, and the mask each token is
drawn under, on a vocabulary of a real model's size.

Scenario: a stand-in byte-level vocabulary of Qwen3's size (151,936 tokens: the 256 bytes as GPT-2's alphabet writes
them, every run of 2-8 characters of the tokenizer's embedded English text, then random lowercase words with and
without a leading space), since no real tokenizer can be downloaded here; its tokens are not Qwen3's, its size and
byte-level form are. Three formats: a small schema (a boolean, an enum, a short array), a larger one (nested
objects, strings, numbers, arrays of objects), and any JSON object. For each, in alternating rounds:
  compile ms      the grammar from the schema, a matcher over the vocabulary and its first mask
                  (`cascadia.grammar.json_grammar`, `Constraint`), as a request's first row pays it
  mask us/row     following a reply one token further and masking its next row (`Constraint.allowed` and the
                  -inf it puts on the logits: what `RowSampler` adds to a row held to a grammar), the median over
                  the reply's tokens
  ms per 32 rows  the mask of a decode step of 32 streams held to the format (rows are masked one after another)
The share of a decode step is set against the race's Qwen3-MoE at 32 streams (bench/results/peers.json, another
run on this machine: `share of step`), whose vocabulary is far smaller than this one; a model of this vocabulary
takes longer a step, so the share is an upper bound.

With `--xgrammar` (the dev extra's environment: xgrammar needs torch, transformers and triton, which Cascadia keeps
out of its runtime), the other well-kept grammar engine does the same on the same vocabulary, schemas and replies,
beside llguidance, in alternating rounds: its compile (the schema's grammar without its cache, a matcher, the first
bitmask) and its mask per row (accepting the token, filling the bitmask, unpacking it and masking the logits).

    python bench/structured.py [--rounds 3] [--xgrammar]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
from llguidance import LLTokenizer
from record import RESULTS, Table, now, spread, write
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from cascadia.grammar import Constraint, json_grammar
from cascadia.sampling import held
from cascadia.serve.logprobs import gpt2_alphabet
from cascadia.tokenizer import TEXT

VOCAB = 151_936  # Qwen3's
EOS = 0
STEP_ROWS = 32
SMALL = {"type": "object", "properties": {"ok": {"type": "boolean"}, "size": {"enum": ["S", "M", "L"]},
                                          "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}},
         "required": ["ok", "size", "tags"], "additionalProperties": False}
LARGE = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"}, "score": {"type": "number"},
    "address": {"type": "object", "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["street", "city", "zip"]},
    "orders": {"type": "array", "items": {"type": "object", "properties": {
        "id": {"type": "integer"}, "item": {"type": "string"}, "paid": {"type": "boolean"}},
        "required": ["id", "item", "paid"]}}},
    "required": ["name", "age", "score", "address", "orders"]}
REPLIES = {"small schema": (SMALL, '{"ok":true,"size":"M","tags":[false,true]}'),
           "larger schema": (LARGE, '{"name":"Ada Lovelace","age":36,"score":9.5,"address":{"street":"12 Hill '
                                    'Road","city":"London","zip":"10001"},"orders":[{"id":1,"item":"an engine",'
                                    '"paid":true},{"id":2,"item":"notes on it","paid":false}]}'),
           "any JSON object": (None, '{"fleet":["pc0","pc1"],"layers":66,"note":"experts make the model large"}')}


def stand_in_tokenizer(size: int, seed: int = 0) -> str:
    """tokenizer.json of a byte-level vocabulary of `size` tokens (see the module's text)."""
    alphabet = gpt2_alphabet()  # the character standing for each byte
    vocab = {char: i for i, char in enumerate(alphabet)}

    def add(text: str) -> None:
        token = "".join(alphabet[b] for b in text.encode())
        vocab.setdefault(token, len(vocab))

    text = " ".join(TEXT.split())
    for length in range(2, 9):
        for start in range(len(text) - length):
            add(text[start:start + length])
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    while len(vocab) < size:
        word = "".join(rng.choice(letters, rng.integers(2, 10)))
        add(word if rng.random() < 0.5 else " " + word)
    tokenizer = Tokenizer(models.BPE(vocab=dict(list(vocab.items())[:size]), merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer.to_str()


def compile_ms(vocabulary: LLTokenizer, schema: dict | None) -> float:
    start = time.perf_counter()
    Constraint(vocabulary, json_grammar(schema)).allowed([])
    return (time.perf_counter() - start) * 1e3


def mask_us(vocabulary: LLTokenizer, schema: dict | None, reply: list[int], logits: np.ndarray) -> float:
    """The median time to follow the reply one token further and mask the next row, over its tokens."""
    constraint = Constraint(vocabulary, json_grammar(schema))
    times = []
    for i in range(len(reply) + 1):
        start = time.perf_counter()
        held(logits, logits, constraint.allowed(reply[:i]))
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e6


class Xgrammar:
    """xgrammar over the same stand-in vocabulary (its tokenizer read through transformers, as xgrammar reads one)."""

    def __init__(self, text: str):
        import xgrammar
        from transformers import PreTrainedTokenizerFast

        self.xgr = xgrammar
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(text))
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=VOCAB, stop_token_ids=[EOS])
        self.compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)

    def matcher(self, schema: dict | None):
        """The schema's grammar, compact as Cascadia's (no whitespace between tokens), and a matcher over it."""
        compiled = self.compiler.compile_json_schema(json.dumps(schema or {"type": "object"}), any_whitespace=False,
                                                    separators=(",", ":"))
        return self.xgr.GrammarMatcher(compiled)

    def allowed(self, matcher, bitmask) -> np.ndarray:
        matcher.fill_next_token_bitmask(bitmask)
        return np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")[:VOCAB].astype(bool)

    def compile_ms(self, schema: dict | None) -> float:
        start = time.perf_counter()
        self.allowed(self.matcher(schema), self.xgr.allocate_token_bitmask(1, VOCAB))
        return (time.perf_counter() - start) * 1e3

    def mask_us(self, schema: dict | None, reply: list[int], logits: np.ndarray) -> float:
        matcher, bitmask, times = self.matcher(schema), self.xgr.allocate_token_bitmask(1, VOCAB), []
        for i in range(len(reply) + 1):
            start = time.perf_counter()
            if i and not matcher.accept_token(reply[i - 1]):
                raise SystemExit(f"xgrammar refused token {i - 1} of a reply its schema validates")
            held(logits, logits, self.allowed(matcher, bitmask))
            times.append(time.perf_counter() - start)
        return float(np.median(times)) * 1e6


def race_step_ms() -> float | None:
    """The 32-stream decode step of the race's Qwen3-MoE (int8), from bench/results/peers.json."""
    path = RESULTS / "peers.json"
    if not path.exists():
        return None
    for table in json.loads(path.read_text())["tables"]:
        if table["title"].startswith("Decode tokens a second (bf16 compute) on the same weights"):
            for row in table["rows"]:
                if row[:3] == ["qwen3_moe", "int8", STEP_ROWS]:
                    return STEP_ROWS / row[table["columns"].index("Cascadia")]["median"] * 1e3
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--xgrammar", action="store_true", help="xgrammar beside llguidance (see above)")
    args = parser.parse_args()
    started = now()
    text = stand_in_tokenizer(VOCAB)
    vocabulary = LLTokenizer(text, n_vocab=VOCAB, eos_token=EOS)
    tokenizer = Tokenizer.from_str(text)
    logits = np.random.default_rng(0).standard_normal(VOCAB).astype(np.float32)
    replies = {name: (schema, tokenizer.encode(reply).ids) for name, (schema, reply) in REPLIES.items()}
    compiled: dict[str, list[float]] = {name: [] for name in replies}
    masked: dict[str, list[float]] = {name: [] for name in replies}
    other = Xgrammar(text) if args.xgrammar else None
    other_compiled: dict[str, list[float]] = {name: [] for name in replies}
    other_masked: dict[str, list[float]] = {name: [] for name in replies}
    for _ in range(args.rounds):
        for name, (schema, reply) in replies.items():
            compiled[name].append(compile_ms(vocabulary, schema))
            masked[name].append(mask_us(vocabulary, schema, reply, logits))
            if other is not None:
                other_compiled[name].append(other.compile_ms(schema))
                other_masked[name].append(other.mask_us(schema, reply, logits))
    step = race_step_ms()
    table = Table(f"Holding a reply to a format, on a vocabulary of {VOCAB:,} tokens",
                  ["format", "reply tokens", "compile ms", "mask us/row", f"ms per {STEP_ROWS} rows",
                   "share of step"],
                  note=f"share of step: the mask of {STEP_ROWS} rows over the race's Qwen3-MoE (int8) decode step at "
                       f"{STEP_ROWS} streams, {step:.0f} ms (bench/results/peers.json)" if step else "")
    for name, (_, reply) in replies.items():
        per_step = STEP_ROWS * spread(masked[name])["median"] / 1e3
        table.add(name, len(reply), spread(compiled[name]), spread(masked[name]), per_step,
                  f"{per_step / step:.1%}" if step else None)
    print(table.text())
    tables = [table]
    if other is not None:
        against = Table("llguidance against xgrammar on the same vocabulary, schemas and replies",
                        ["format", "llguidance compile ms", "xgrammar compile ms", "llguidance mask us/row",
                         "xgrammar mask us/row"],
                        note="Each engine as a request pays it: compiling without a cache, and masking each row of "
                             "the reply in numpy (xgrammar's bitmask unpacked, llguidance's through Cascadia's "
                             "`Constraint`).")
        for name in replies:
            against.add(name, spread(compiled[name]), spread(other_compiled[name]), spread(masked[name]),
                        spread(other_masked[name]))
        print(against.text())
        tables.append(against)
    write("structured", "Structured outputs: the cost of the mask", started, tables)


if __name__ == "__main__":
    main()
