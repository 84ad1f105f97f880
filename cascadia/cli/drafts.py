"""`draft-eval`: draft heads measured on the captured final hidden states of a spec's deployed path."""

from __future__ import annotations

import click

from cascadia.cli.common import OutputPath, chosen_plan, report_to, writing
from cascadia.spec.load import load_spec


@click.command("draft-eval")
@click.argument("spec", type=click.Path(exists=True, dir_okay=False))
@click.option("--prompts", type=click.Path(exists=True, dir_okay=False),
              help='JSONL prompts, one {"ids": [...]} or {"text": "..."} per line, as `cascadia run --prompts`; text '
                   "needs the checkpoint's tokenizer.json (default: the spec's prompts file)")
@click.option("--vocab", "reduced_tokens", type=click.IntRange(min=1), required=True,
              help="tokens of the reduced vocabulary: the most frequent in the corpus (the paper: 65536 of 200058)")
@click.option("--corpus", type=click.Path(exists=True, dir_okay=False),
              help="the reference corpus counted for the reduced vocabulary, JSONL as --prompts (default: the "
                   "prompts)")
@click.option("--chain", type=click.IntRange(min=1), default=4, show_default=True,
              help="the longest draft chain K: expected accepted drafts for chains of 1..K")
@click.option("--max-new-tokens", type=click.IntRange(min=1),
              help="tokens generated per prompt (default: the spec's workload output_tokens)")
@click.option("--checkpoint", type=click.Path(exists=True, file_okay=False), help="default: the spec's")
@click.option("--threads", type=click.IntRange(min=1), help="inference threads (default: OpenVINO's choice)")
@click.option("--pipeline", is_flag=True,
              help="capture on the spec's pipeline (its nodes; local ones are started here) instead of in one process")
@click.option("--plan", "plan_path", type=click.Path(exists=True, dir_okay=False),
              help="with --pipeline: a plan saved by `cascadia plan -o` (default: plan now)")
@click.option("--json", "json_path", type=OutputPath(), help="write the heads' results and the 2x2 view as JSON")
def draft_eval(spec: str, prompts: str | None, reduced_tokens: int, corpus: str | None, chain: int,
               max_new_tokens: int | None, checkpoint: str | None, threads: int | None, pipeline: bool,
               plan_path: str | None, json_path: str | None) -> None:
    """Draft heads on the deployed path's own hidden states: generate greedily from each prompt with the spec's
    precision and weight formats (in one process, or on its pipeline), capture what the head reads at each
    generated position, and feed it to the LM head in f32, in the spec's head format and in int4, over the full
    vocabulary and over the --vocab most frequent tokens. Prints per head the top-1 agreement with the deployed
    token and the expected accepted drafts for chains of 1..K, and a 2x2 view (vocabulary x precision) separating
    vocabulary selection from quantisation."""
    import json
    from pathlib import Path

    import attrs

    from cascadia.drafts.evaluate import PROMPTS
    from cascadia.drafts.evaluate import draft_eval as evaluate
    from cascadia.drafts.report import format_report
    from cascadia.engine.checkpoint import Checkpoint
    from cascadia.tokenizer import workload_prompts

    report = report_to(json_path)
    if plan_path and not pipeline:
        raise click.UsageError("--plan goes with --pipeline")
    loaded = load_spec(spec)
    workload = loaded.workload
    prompts_file = prompts or workload.prompts_file
    if prompts_file is None:
        raise click.UsageError(f"give --prompts: {spec}'s workload names no prompts file")
    folder = Path(checkpoint) if checkpoint else loaded.model.checkpoint
    if folder is None:
        raise click.UsageError(f"{spec}: the model names no checkpoint; give --checkpoint")
    new_tokens = max_new_tokens or workload.output_tokens
    if chain > new_tokens:
        raise click.BadParameter(f"{chain}: a chain is at most the {new_tokens} tokens generated per prompt "
                                 "(--max-new-tokens)", param_hint="--chain")
    vocabulary = loaded.model.config.output_vocab_size
    if reduced_tokens >= vocabulary:
        raise click.BadParameter(f"{reduced_tokens}: a reduced vocabulary is smaller than the model's "
                                 f"{vocabulary} tokens", param_hint="--vocab")

    def read(path) -> list[tuple[int, ...]]:
        return workload_prompts(attrs.evolve(workload, prompts_file=path), folder, loaded.model.config)

    result = evaluate(loaded, Checkpoint.open(folder), read(prompts_file), reduced_tokens, chain, new_tokens,
                      corpus=read(corpus) if corpus else None, corpus_name=corpus or PROMPTS, threads=threads,
                      progress=lambda message: click.echo(message, err=True),
                      plan=chosen_plan(loaded, plan_path) if pipeline else None)
    report(format_report(result))
    if json_path:
        with writing(json_path) as f:
            json.dump(result.to_json(), f, indent=1)
