"""The single-process engine: `generate` and `score` (which can also score on a spec's pipeline)."""

from __future__ import annotations

import click

from cascadia.cli.common import OutputPath, chosen_plan, report_to, sampling_options, with_sampling, writing
from cascadia.spec.load import load_spec

MAX_IDS_FILE_BYTES = 64 * 1024**2  # `score --ids`: a few million token ids
MAX_SCHEMA_FILE_BYTES = 1024**2  # `generate --json-schema`


def _engine_options(func):
    """Options shared by the commands that run the single-process engine."""
    for option in reversed([
        click.option("--precision", type=click.Choice(["f32", "bf16", "f16"]), default="bf16", show_default=True,
                     help="compute precision (f32: exact; f16 runs as bf16 on a CPU)"),
        click.option("--compressed", is_flag=True,
                     help="the paper's weight formats: experts and dense MLP int4 in groups of 32, attention and head "
                     "int8, embedding bf16"),
        click.option("--device", type=click.Choice(["auto", "GPU", "CPU"]), default="auto", show_default=True),
        click.option("--threads", type=click.IntRange(min=1), help="inference threads (default: OpenVINO's choice)"),
    ]):
        func = option(func)
    return func


def open_engine(checkpoint: str, ids: list[int], new_tokens: int, precision: str, compressed: bool, device: str,
                 threads: int | None):
    """The engine for one stream of `ids` and `new_tokens` more, once the model and this machine can hold them."""
    from cascadia.engine.checkpoint import Checkpoint
    from cascadia.engine.engine import Engine
    from cascadia.engine.generate import check_request
    from cascadia.spec.types import PAPER_FORMATS, RuntimeSpec, WeightFormats

    opened = Checkpoint.open(checkpoint)
    runtime = RuntimeSpec(precision=precision, max_streams=1, context_budget=len(ids) + new_tokens)
    formats = PAPER_FORMATS if compressed else WeightFormats()
    check_request(opened, ids, new_tokens, formats, runtime)
    return Engine(opened, runtime, formats=formats, device=device, threads=threads)


def _prefill_progress():
    """A prefill's progress on standard error, at most every tenth of the prompt: a long prompt takes a while."""
    tenths = 0

    def progress(done: int, total: int) -> None:
        nonlocal tenths
        if done * 10 // total > tenths:
            tenths = done * 10 // total
            click.echo(f"prefill: {done}/{total} tokens", err=True)
    return progress


def _adjustments(checkpoint: str, prompt_tokens: int, logit_bias: tuple[str, ...], schema_path: str | None,
                 json_object: bool, **penalties):
    """How the logits change before each token (`LogitAdjustments`, None: they do not), and the vocabulary a
    grammar is matched over (None without one), checked before any work: token ids within the vocabulary, a schema
    that can hold a reply, a tokenizer for it."""
    from pathlib import Path

    from cascadia.engine.checkpoint import Checkpoint
    from cascadia.files import UnreadableFile, read_json
    from cascadia.grammar import GrammarError, json_grammar, vocabulary
    from cascadia.sampling import LogitAdjustments

    config = Checkpoint.open(checkpoint).config
    biases = [_bias(text, config.output_vocab_size) for text in logit_bias]
    if schema_path and json_object:
        raise click.UsageError("give --json-schema or --json-object, not both")
    grammar = tokens = None
    if schema_path or json_object:
        try:
            schema = read_json(schema_path, MAX_SCHEMA_FILE_BYTES, "a JSON schema") if schema_path else None
            if schema is not None and not isinstance(schema, dict):
                raise UnreadableFile("a JSON schema is an object")
            grammar = json_grammar(schema)
        except (UnreadableFile, GrammarError) as e:
            raise click.ClickException(f"{schema_path}: {e}") from None
        try:
            tokens = vocabulary(Path(checkpoint), config.output_vocab_size, config.eos_ids)
        except GrammarError as e:
            raise click.ClickException(str(e)) from None
    return LogitAdjustments.of(prompt_tokens, stop_ids=tuple(sorted(config.eos_ids)), logit_bias=sorted(biases),
                               grammar=grammar, **penalties), tokens


def _bias(text: str, vocab_size: int) -> tuple[int, float]:
    """`--logit-bias ID=BIAS` as (id, bias)."""
    token, _, bias = text.partition("=")
    try:
        token_id, value = int(token), float(bias)
    except ValueError:
        token_id = value = None
    if token_id is None or not 0 <= token_id < vocab_size or not -100 <= value <= 100:
        raise click.BadParameter(f"{text!r}: give ID=BIAS, a token id in 0..{vocab_size - 1} and a bias in -100..100",
                                 param_hint="--logit-bias")
    return token_id, value


def _token_ids(text: str) -> list[int]:
    try:
        ids = [int(part) for part in text.split(",")]
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a comma-separated list of token ids", param_hint="--ids") from None
    if not ids or min(ids) < 0:
        raise click.BadParameter(f"{text!r}: token ids are integers >= 0", param_hint="--ids")
    return ids


@click.command()
@click.argument("checkpoint", type=click.Path(exists=True, file_okay=False))
@click.option("--prompt", help="prompt text (needs CHECKPOINT/tokenizer.json)")
@click.option("--ids", "ids_text", help="prompt token ids, e.g. 1,2,3")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=16, show_default=True)
@sampling_options
@click.option("--presence-penalty", type=click.FloatRange(-2, 2), default=0.0, show_default=True,
              help="subtracted from the logit of each token the reply holds (OpenAI's)")
@click.option("--frequency-penalty", type=click.FloatRange(-2, 2), default=0.0, show_default=True,
              help="subtracted from a token's logit once per time the reply holds it (OpenAI's)")
@click.option("--repetition-penalty", type=click.FloatRange(0, 10, min_open=True), default=1.0, show_default=True,
              help="divides the positive logit (multiplies the negative) of each token in the prompt or reply")
@click.option("--min-tokens", type=click.IntRange(min=0), default=0, show_default=True,
              help="hold the end-of-sequence tokens back until the reply has this many tokens")
@click.option("--logit-bias", "logit_bias", multiple=True, metavar="ID=BIAS",
              help="add BIAS (-100 to 100) to token ID's logit; repeatable")
@click.option("--json-schema", "schema_path", type=click.Path(exists=True, dir_okay=False),
              help="hold the reply to JSON that this schema (a JSON file) validates")
@click.option("--json-object", is_flag=True, help="hold the reply to a JSON object")
@click.option("--ignore-eos", is_flag=True, help="keep going past the end-of-sequence token")
@click.option("--json", "json_path", type=OutputPath(), help="write ids, text and timings as JSON")
@_engine_options
def generate(checkpoint: str, prompt: str | None, ids_text: str | None, max_new_tokens: int, greedy: bool | None,
             temperature: float | None, top_p: float | None, top_k: int | None, min_p: float | None, seed: int | None,
             presence_penalty: float, frequency_penalty: float, repetition_penalty: float, min_tokens: int,
             logit_bias: tuple[str, ...], schema_path: str | None, json_object: bool, ignore_eos: bool,
             json_path: str | None, precision: str, compressed: bool, device: str, threads: int | None) -> None:
    """Generate text (or token ids) from a prompt with the single-process OpenVINO engine (greedy unless sampling
    options say otherwise; a workload's defaults: temperature 1, top-p 1, seed 0). Penalties, biases, `--min-tokens`
    and a JSON schema change the logits before each token is chosen, as `cascadia serve` changes them."""
    import attrs

    import json
    from pathlib import Path

    from cascadia.engine.generate import generate as run_generation
    from cascadia.sampling import Sampling
    from cascadia.spec.types import WorkloadSpec
    from cascadia.tokenizer import TOKENIZER_FILE, load_tokenizer

    report = report_to(json_path)
    if (prompt is None) == (ids_text is None):
        raise click.UsageError("give --prompt or --ids (one of them)")
    sampling = Sampling.of(with_sampling(WorkloadSpec(), greedy, temperature, top_p, seed, top_k, min_p))
    tokenizer_file = Path(checkpoint) / TOKENIZER_FILE
    tokenizer = load_tokenizer(tokenizer_file) if tokenizer_file.is_file() else None
    if prompt is not None and tokenizer is None:
        raise click.UsageError(f"--prompt needs {tokenizer_file}; give --ids instead")
    prompt_ids = tokenizer.encode(prompt).ids if prompt is not None else _token_ids(ids_text)
    if not prompt_ids:
        raise click.UsageError("the prompt has no tokens")
    adjust, tokens = _adjustments(checkpoint, len(prompt_ids), min_tokens=min_tokens,
                                  repetition_penalty=repetition_penalty, frequency_penalty=frequency_penalty,
                                  presence_penalty=presence_penalty, logit_bias=logit_bias, schema_path=schema_path,
                                  json_object=json_object)
    engine = open_engine(checkpoint, prompt_ids, max_new_tokens, precision, compressed, device, threads)
    stop = () if ignore_eos else engine.config.eos_ids
    several_calls = len(prompt_ids) > engine.stage.max_rows
    result = run_generation(engine, prompt_ids, max_new_tokens, attrs.evolve(sampling, adjust=adjust), stop,
                            progress=_prefill_progress() if several_calls else None, vocabulary=tokens)
    text = tokenizer.decode(list(result.ids)) if tokenizer else None
    if text is not None:
        report(text)
    report(f"ids: {','.join(map(str, result.ids))}")
    report(f"{len(result.ids)} tokens ({'stop token' if result.stopped else 'token limit'}); prefill "
               f"{len(prompt_ids)} tokens in {result.prefill_s * 1e3:.1f} ms; decode {result.decode_tokens_per_s:.1f} "
               f"tokens/s; {engine.stage.precision} on {engine.stage.device}")
    if json_path:
        body = result.to_json() | {"text": text, "precision": engine.stage.precision, "device": engine.stage.device}
        with writing(json_path) as f:
            json.dump(body, f, indent=1)


@click.command()
@click.argument("checkpoint", type=click.Path(exists=True, file_okay=False))
@click.option("--ids", "ids_path", type=click.Path(exists=True, dir_okay=False), required=True,
              help='JSON file: a list of token ids, or {"ids": [...]}')
@click.option("--prefill", type=click.IntRange(min=1), help="tokens fed by prefill; the rest go one decode step at a "
                                                            "time (default: all by prefill)")
@click.option("--out", type=OutputPath(), required=True, help="write the logits [N, vocab] (.npy)")
@_engine_options
@click.option("--spec", "spec_path", type=click.Path(exists=True, dir_okay=False),
              help="score on this spec's pipeline (its nodes and runtime; local nodes are started here) instead of "
                   "in one process; the engine options above are then the spec's")
@click.option("--plan", "plan_path", type=click.Path(exists=True, dir_okay=False),
              help="with --spec: a plan saved by `cascadia plan -o` (default: plan now)")
def score(checkpoint: str, ids_path: str, prefill: int | None, out: str, precision: str, compressed: bool,
          device: str, threads: int | None, spec_path: str | None, plan_path: str | None) -> None:
    """Teacher-forced logits for every position of a token sequence, with its mean log-prob and perplexity."""
    report = report_to(out)
    import numpy as np

    from cascadia.engine.generate import score_logits
    from cascadia.files import UnreadableFile, read_json

    try:
        body = read_json(ids_path, MAX_IDS_FILE_BYTES, "a file of token ids")
    except UnreadableFile as e:
        raise click.ClickException(f"{ids_path}: {e}") from None
    ids = body.get("ids") if isinstance(body, dict) else body
    if not isinstance(ids, list) or not all(type(i) is int and i >= 0 for i in ids):
        raise click.ClickException(f"{ids_path}: expected a JSON list of token ids (integers >= 0) or "
                                   "{\"ids\": [...]}")
    if len(ids) < 2:
        raise click.ClickException(f"{ids_path}: scoring needs at least two tokens, got {len(ids)}")
    if spec_path:
        logits = _score_on_pipeline(spec_path, plan_path, checkpoint, ids, prefill)
    else:
        engine = open_engine(checkpoint, ids, 0, precision, compressed, device, threads)
        logits = engine.score(ids, prefill=prefill)
    result = score_logits(logits, ids)
    with writing(out, binary=True) as f:
        np.save(f, logits)
    report(f"scored {result.tokens} tokens ({prefill or len(ids)} by prefill): mean log-prob "
               f"{result.mean_log_prob:.4f} nats, perplexity {result.perplexity:.2f}; logits {logits.shape} -> {out}")


def _score_on_pipeline(spec_path: str, plan_path: str | None, checkpoint: str, ids: list[int],
                       prefill: int | None):
    """`cascadia score --spec`: the logits as the plan's nodes compute them, with their start-up on stderr."""
    from pathlib import Path

    from cascadia.pipeline.run import describe, score_on_pipeline

    loaded = load_spec(spec_path)
    return score_on_pipeline(loaded, chosen_plan(loaded, plan_path), ids, prefill, checkpoint=Path(checkpoint),
                             on_message=lambda node, message: click.echo(describe(node, message), err=True))
