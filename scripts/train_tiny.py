"""Train the tiny Inkling that the demo and the serving quick start speak with (needs torch and transformers).

The corpus is Python 3.11's documentation as Debian's `python3.11-doc` package ships it (the reStructuredText
sources under /usr/share/doc/python3.11/html/_sources; the PSF License, with the examples also under the Zero-Clause
BSD licence): the tutorial, the library and language references, the how-tos, the FAQs, the glossary and the guides
to using, installing and distributing Python. The markup is reduced to text (roles to their text, directives to
their signatures, headings without their underlines); code examples stay. Each FAQ question with the start of its
answer is also written as a chat in the model's template (as `cascadia serve` renders it), so that a chat gets an
answer in its turn.

The model is specs/tiny's architecture (sliding and global layers, a dense MLP layer, then routed and shared
experts) at a width of 128 with a 2,048-token byte-level BPE vocabulary trained on the same corpus. The experts'
routing is balanced without an auxiliary loss, as DeepSeek-V3 does: after each step every router's correction bias
moves a small step against its experts' excess load. Every 20th document (and chat) is held out; the held-out loss
and perplexity are printed and written into the model card. The same seed, thread count and corpus give the same
weights. Run from the repository root (about 45 minutes on a 2-core AMD EPYC):

    apt-get install python3.11-doc
    python scripts/train_tiny.py                  # writes specs/tiny-chat/
    python scripts/train_tiny.py --steps 50 --out /tmp/tiny-try   # a quick try
    python scripts/train_tiny.py --reference-only  # tests/fixtures/tiny_chat/reference.npz from specs/tiny-chat

Then `python scripts/train_mtp.py` adds the model's multi-token-prediction head.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import re
import sys
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer
from transformers import InklingForCausalLM
from transformers.models.inkling.configuration_inkling import InklingTextConfig

from cascadia.models import config_from_hf_dict
from cascadia.serve.chat import ChatTemplate
from cascadia.tokenizer import CHAT_TEMPLATE, TOKENIZER_CONFIG_FILE, TOKENIZER_FILE, build_tokenizer, tokenizer_config

sys.path.insert(0, str(Path(__file__).parent))
from make_fixtures import decode_logits, logits, save  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CHECKPOINT = ROOT / "specs" / "tiny-chat"
REFERENCE = ROOT / "tests" / "fixtures" / "tiny_chat" / "reference.npz"
CORPUS = Path("/usr/share/doc/python3.11/html/_sources")
PARTS = ("tutorial", "library", "reference", "howto", "faq", "using", "installing", "distributing", "glossary.rst.txt")
HELD_OUT_EVERY = 20
STEPS = 3000
# specs/tiny's architecture, wider, with a vocabulary of 2,048 and a window long enough for a sentence or two
SIZES = dict(vocab_size=2048, hidden_size=128, head_dim=32, swa_head_dim=32, intermediate_size=384,
             moe_intermediate_size=64, sliding_window_size=64, rel_extent=64, route_scale=2.0,
             logits_mup_width_multiplier=2.0)
CHAT_REPEATS = 3  # the chats are few: each is in the training stream this often
BALANCE_STEP = 1e-3  # how far a router's correction bias moves per step against its experts' excess load
SAMPLE_PROMPTS = ("A list is", "def fibonacci(n):")
SAMPLE_CHAT = "What is a generator?"
REFERENCE_REPLY = "A function that returns an iterator: it yields its values one at a time."

UNDERLINE = re.compile(r"^([=\-~^\"'*+#`.:_])\1{2,}\s*$")
ROLE = re.compile(r":[\w:.+-]+:`([^`]*)`")
OPTION = re.compile(r"^\s*:[\w-]+:(\s.*)?$")  # a directive's option or a file's field: not text
LINK = re.compile(r"`([^`<]*?)\s*<[^>]*>`__?")
VERSIONED = {"versionadded": "New in version", "versionchanged": "Changed in version",
             "deprecated": "Deprecated since version"}
SIGNATURES = {"function", "method", "class", "attribute", "data", "exception", "decorator", "classmethod",
              "staticmethod", "module", "opcode", "describe", "cmdoption", "envvar", "option"}


def role_text(match: re.Match) -> str:
    text = match.group(1)
    inner = re.match(r"(.*?)\s*<[^>]*>$", text)
    text = inner.group(1) if inner else text
    if text.startswith("~"):
        text = text[1:].rsplit(".", 1)[-1]
    return text.lstrip("!")


def plain(rst: str) -> str:
    """reStructuredText as the text a reader sees, code blocks kept."""
    lines = []
    for line in rst.splitlines():
        if UNDERLINE.match(line) or OPTION.match(line):
            continue
        directive = re.match(r"^(\s*)\.\.\s+([\w:-]+)::\s*(.*)$", line)
        if directive:
            indent, name, rest = directive.groups()
            name = name.rsplit(":", 1)[-1]
            if name in SIGNATURES and rest:
                lines.append(indent + rest)
            elif name in VERSIONED and rest:
                version, _, said = rest.partition(" ")
                lines.append(f"{indent}{VERSIONED[name]} {version}{':' if said else '.'} {said}".rstrip())
            elif name in ("note", "warning", "seealso") and rest:
                lines.append(indent + rest)
            else:
                lines.append("..")  # removed below with comments: one blank line, not two
            continue
        if re.match(r"^\s*\.\.(\s|$)", line):  # a comment, a target or a substitution
            lines.append("..")
            continue
        line = ROLE.sub(role_text, line)
        line = LINK.sub(lambda m: m.group(1), line)
        line = re.sub(r"``([^`]+)``", r"\1", line)
        line = re.sub(r"`([^`]+)`_", r"\1", line)
        line = re.sub(r"\|(\w+)\|", r"\1", line)
        lines.append(line.rstrip())
    text = "\n".join(line for line in lines if line != "..")
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def documents(corpus: Path) -> list[tuple[str, str]]:
    """(name, text) of every document of the corpus's chosen parts, in sorted order."""
    paths = []
    for part in PARTS:
        path = corpus / part
        paths += sorted(path.rglob("*.rst.txt")) if path.is_dir() else [path]
    return [(str(path.relative_to(corpus)), plain(path.read_text(encoding="utf-8"))) for path in paths]


def faq_chats(corpus: Path, bos: str, eos: str) -> list[str]:
    """Each FAQ question with its answer's first paragraphs (up to about 600 characters), as a chat in the template."""
    template = ChatTemplate(CHAT_TEMPLATE, {"bos_token": bos, "eos_token": eos}, "the chat template")
    chats = []
    for path in sorted((corpus / "faq").glob("*.rst.txt")):
        lines = path.read_text(encoding="utf-8").splitlines()
        headings = [i for i in range(len(lines) - 1) if lines[i].strip() and UNDERLINE.match(lines[i + 1])]
        for start, end in zip(headings, headings[1:] + [len(lines)]):
            question = lines[start].strip()
            if not question.endswith("?"):
                continue
            answer = ""
            for paragraph in plain("\n".join(lines[start + 2:end])).split("\n\n"):
                if answer and len(answer) + len(paragraph) > 600:
                    break
                answer = f"{answer}\n\n{paragraph}" if answer else paragraph
            if answer:
                messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
                chats.append(template.render(messages, add_generation_prompt=False))
    return chats


def streams(tokenizer, docs, chats, bos: int, eos: int) -> tuple[np.ndarray, np.ndarray]:
    """The training and held-out token streams: each document between BOS and EOS, each chat (its template's BOS
    first) then EOS; every HELD_OUT_EVERY-th of them held out, the chats trained on CHAT_REPEATS times."""
    encoded = [[bos, *tokenizer.encode(text).ids, eos] for _, text in docs]
    encoded += [tokenizer.encode(chat).ids + [eos] for chat in chats]
    train = [ids for i, ids in enumerate(encoded) if i % HELD_OUT_EVERY]
    train += [ids for i, ids in enumerate(encoded) if i % HELD_OUT_EVERY and i >= len(docs)] * (CHAT_REPEATS - 1)
    held = [ids for i, ids in enumerate(encoded) if not i % HELD_OUT_EVERY]
    return tuple(np.concatenate([np.array(ids, dtype=np.int32) for ids in part]) for part in (train, held))


def hf_config() -> dict:
    tiny = json.loads((ROOT / "specs" / "tiny" / "config.json").read_text())
    return {key: value for key, value in tiny.items() if key not in ("architectures", "model_type")} | SIZES


def balance(routers: list, loads: list[torch.Tensor]) -> None:
    """Move each router's correction bias a step against its experts' excess load (DeepSeek-V3's balancing)."""
    with torch.no_grad():
        for router, load in zip(routers, loads):
            router.e_score_correction_bias -= BALANCE_STEP * torch.sign(load - load.mean())


def count_load(load: torch.Tensor, router, inputs, output) -> None:
    """A router's forward hook: add how many rows chose each expert (output: logits, weights, indices, gammas)."""
    load.add_(torch.bincount(output[2].flatten(), minlength=load.numel()))


def windows(stream: np.ndarray, starts: np.ndarray, length: int) -> torch.Tensor:
    return torch.from_numpy(np.stack([stream[s:s + length] for s in starts]).astype(np.int64))


@torch.no_grad()
def held_out_loss(model, stream: np.ndarray, length: int, batch: int) -> float:
    model.eval()
    starts = np.arange(0, len(stream) - length, length)
    losses = [float(model(input_ids=(x := windows(stream, starts[i:i + batch], length)), labels=x).loss)
              for i in range(0, len(starts), batch)]
    model.train()
    return float(np.mean(losses))


def batches(args, stream: np.ndarray, optimizer):
    """(step, windows) of a training run, drawn from the seed, each step's learning rate set in the optimizer."""
    rng = np.random.default_rng(args.seed)
    warmup = max(1, args.steps // 24)
    for step in range(args.steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, args.steps, args.lr, warmup)
        yield step, windows(stream, rng.integers(0, len(stream) - args.length, args.batch), args.length)


def learning_rate(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup))))


def training_options(description: str, steps: int, reference: Path) -> argparse.ArgumentParser:
    """The options this script and scripts/train_mtp.py share (`reference`: the tests' reference each writes)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--reference-only", action="store_true",
                        help=f"only write {reference.relative_to(ROOT)} from the checkpoint in --out")
    parser.add_argument("--corpus", type=Path, default=CORPUS)
    parser.add_argument("--out", type=Path, default=CHECKPOINT)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--length", type=int, default=256, help="tokens a training window holds")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    return parser


def start(args) -> None:
    """Refuse a missing corpus; seed and pin torch, so that the same seed, threads and corpus give the same weights."""
    if not args.corpus.is_dir():
        sys.exit(f"{args.corpus}: not found (apt-get install python3.11-doc)")
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)


def main() -> None:
    args = training_options(__doc__.split("\n\n")[0], STEPS, REFERENCE).parse_args()
    if args.reference_only:
        return write_reference(args.out)
    start(args)
    began = time.perf_counter()

    hf = hf_config()
    config = config_from_hf_dict({"model_type": "inkling_text"} | hf)
    docs = documents(args.corpus)
    specials = tokenizer_config(config)
    chats = faq_chats(args.corpus, specials["bos_token"], specials["eos_token"])
    tokenizer = build_tokenizer(config, [text for _, text in docs] + chats)
    train_stream, held_stream = streams(tokenizer, docs, chats, hf["bos_token_id"], hf["eos_token_id"])
    characters = sum(len(text) for _, text in docs) + sum(len(chat) for chat in chats)
    print(f"corpus: {len(docs)} documents and {len(chats)} FAQ chats, {characters / 1e6:.1f}M characters; "
          f"tokenizer {tokenizer.get_vocab_size()} entries, {len(train_stream) / 1e6:.2f}M training tokens, "
          f"{len(held_stream) / 1e6:.2f}M held out")

    model = InklingForCausalLM(InklingTextConfig(**hf, attn_implementation="eager"))  # eager: the relative bias
    model.train()
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters")
    decay = [p for name, p in model.named_parameters() if p.ndim >= 2 and "embed" not in name]
    rest = [p for name, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in name)]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.95))
    routers = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    loads = [torch.zeros(config.n_routed_experts) for _ in routers]
    for router, load in zip(routers, loads):
        router.register_forward_hook(partial(count_load, load))
    for step, x in batches(args, train_stream, optimizer):
        for load in loads:
            load.zero_()
        loss = model(input_ids=x, labels=x).loss  # shifted inside
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        balance(routers, loads)
        if step % 100 == 0 or step == args.steps - 1:
            print(f"step {step}: loss {loss.item():.3f} ({time.perf_counter() - began:.0f} s)", flush=True)
    held_loss = held_out_loss(model, held_stream, args.length, args.batch)
    minutes = (time.perf_counter() - began) / 60
    print(f"held-out loss {held_loss:.3f}, perplexity {math.exp(held_loss):.1f} ({minutes:.1f} min)")

    save(model.float().eval(), args.out, dtype=torch.bfloat16)
    tokenizer.save(str(args.out / TOKENIZER_FILE))
    (args.out / TOKENIZER_CONFIG_FILE).write_text(json.dumps(specials, indent=2) + "\n")
    trained = InklingForCausalLM.from_pretrained(args.out, dtype=torch.float32, attn_implementation="eager").eval()
    samples = samples_of(trained, tokenizer, specials)
    for prompt, text in samples:
        print(f"{prompt!r} -> {text!r}")
    cpuinfo = dict(line.split(":", 1) for line in Path("/proc/cpuinfo").read_text().splitlines()[:12] if ":" in line)
    cpuinfo = {key.strip(): value.strip() for key, value in cpuinfo.items()}
    cpu = f"{cpuinfo.get('model name', platform.processor())} (family {cpuinfo.get('cpu family')} model " \
          f"{cpuinfo.get('model')})"
    facts = dict(parameters=sum(p.numel() for p in trained.parameters()), vocabulary=tokenizer.get_vocab_size(),
                 documents=len(docs), chats=len(chats), train_tokens=len(train_stream), held_loss=held_loss,
                 minutes=minutes, cpu=cpu) | {
        key: getattr(args, key) for key in ("steps", "batch", "length", "lr", "seed", "threads")}
    write_card(args.out, facts, samples)
    if args.out.resolve() == CHECKPOINT:  # the tests' reference is of the committed checkpoint only
        write_reference(args.out)


def write_reference(checkpoint: Path) -> None:
    """What the tests hold the engine to: transformers' f32 logits of the sample chat followed by a sentence of the
    corpus, whole and decoded one token at a time after the chat, and its greedy reply to the chat (40 tokens)."""
    model = InklingForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, attn_implementation="eager").eval()
    tokenizer = Tokenizer.from_file(str(checkpoint / TOKENIZER_FILE))
    specials = json.loads((checkpoint / TOKENIZER_CONFIG_FILE).read_text())
    chat = chat_prompt(SAMPLE_CHAT, specials)
    prompt = np.array(tokenizer.encode(chat).ids, dtype=np.int64)
    ids = np.array(tokenizer.encode(chat + REFERENCE_REPLY).ids, dtype=np.int64)
    with torch.no_grad():
        greedy = model.generate(torch.from_numpy(prompt)[None], max_new_tokens=40, do_sample=False,
                                eos_token_id=None)[0, len(prompt):].numpy()
    REFERENCE.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(REFERENCE, ids=ids, prefill_logits=logits(model, ids), prefill_len=np.int64(len(prompt)),
                        decode_logits=decode_logits(model, ids, len(prompt)), greedy_ids=greedy)
    print(f"wrote {REFERENCE.relative_to(ROOT)}: {len(ids)} positions, the chat's {len(prompt)} by prefill")


def chat_prompt(question: str, specials: dict) -> str:
    """A user's question in the chat template, up to the assistant's turn."""
    template = ChatTemplate(CHAT_TEMPLATE, {key: specials[key] for key in ("bos_token", "eos_token")}, "the template")
    return template.render([{"role": "user", "content": question}])


@torch.no_grad()
def samples_of(model, tokenizer, specials: dict) -> list[tuple[str, str]]:
    """Greedy continuations of the sample prompts and the sample chat, 40 tokens each (the saved model, f32)."""
    chat = chat_prompt(SAMPLE_CHAT, specials)
    out = []
    for prompt, text in [(p, specials["bos_token"] + p) for p in SAMPLE_PROMPTS] + [(SAMPLE_CHAT, chat)]:
        ids = torch.tensor([tokenizer.encode(text).ids])
        generated = model.generate(ids, max_new_tokens=40, do_sample=False, eos_token_id=model.config.eos_token_id)
        out.append((prompt, tokenizer.decode(generated[0, ids.shape[1]:].tolist())))
    return out


def write_card(out: Path, facts: dict, samples: list[tuple[str, str]]) -> None:
    """The model card, README.md beside the weights (the documentation site shows it too)."""
    f = facts
    tokens = f["steps"] * f["batch"] * f["length"]
    options = "".join(f" --{key} {f[key]}" for key, default in (("steps", STEPS), ("seed", 0)) if f[key] != default)
    shown = "\n\n".join(f"`{prompt}`\n```text\n{text.strip()}\n```" for prompt, text in samples)
    card = f"""# The trained tiny model

`specs/tiny-chat/` is the model `cascadia demo` and the serving quick start (`specs/tiny-serve.yaml`) speak with:
specs/tiny's Inkling architecture (6 layers of sliding and global attention; a dense MLP layer, then 8 routed
experts top-2 and 2 shared ones) at a width of 128, {f["parameters"] / 1e6:.2f}M parameters stored in bf16, with a
byte-level BPE tokenizer of {f["vocabulary"]:,} entries. Small enough to commit, trained enough to answer in words:
the manual's words, not its sense, and greedy replies soon repeat themselves.

- Corpus: Python 3.11's documentation as Debian's `python3.11-doc` package ships it (the reStructuredText sources in
  `/usr/share/doc/python3.11/html/_sources`), under the PSF License Version 2 (its examples also under the
  Zero-Clause BSD licence): {f["documents"]} documents of the tutorial, the references, the how-tos, the FAQs, the
  glossary and the guides, markup reduced to text, and {f["chats"]} FAQ questions with the start of their answers as
  chats in the model's template.
- Training: {f["steps"]:,} steps of {f["batch"]} windows of {f["length"]} tokens ({tokens / 1e6:.1f}M tokens,
  {tokens / f["train_tokens"]:.1f} passes over {f["train_tokens"] / 1e6:.2f}M), AdamW at {f["lr"]:g} with warmup and
  cosine decay, experts balanced by their routers' correction biases; seed {f["seed"]}, {f["threads"]} threads,
  {f["minutes"]:.0f} minutes on {f["cpu"]}.
- Held out (every {HELD_OUT_EVERY}th document and chat): {f["held_loss"]:.3f} nats a token, perplexity
  {math.exp(f["held_loss"]):.1f}.
- Exactness: Cascadia's f32 engine gives transformers' logits of this checkpoint within 1e-4 (relative) and its
  greedy tokens (`tests/test_tiny_chat.py`, against `tests/fixtures/tiny_chat/reference.npz`).
- Retrain: `apt-get install python3.11-doc`, then `python scripts/train_tiny.py{options}` (the script's docstring
  says more).

Greedy continuations (transformers, f32, 40 tokens or the end of the turn):

{shown}
"""
    (out / "README.md").write_text(card)


if __name__ == "__main__":
    main()
