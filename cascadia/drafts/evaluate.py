"""What `cascadia draft-eval` measures: capture the deployed path of a spec's model on some prompts, then feed the
captured states to draft heads: the LM head in f32, in the deployed format and in int4, each over the full
vocabulary and over a reduced one. The f32 and int4 heads make the 2x2 view (full or reduced vocabulary x full or
reduced precision) that separates vocabulary selection from quantisation; the deployed-format head over the full
vocabulary is the deployed head itself, and agrees everywhere.

The deployed path is the spec's: its runtime precision and weight formats, on the single-process engine (the
pipeline's stages run the same engine code in the same formats), or on the spec's pipeline itself: its last node
sends back what its head read with each token. The deployed token at a position is the argmax of its logits
(greedy). The reduced vocabulary is the N tokens a reference corpus holds most often; by default the
prompts (not the generated tokens: those are what the heads are measured on).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs
import numpy as np

from cascadia import host_cpus
from cascadia.drafts.acceptance import expected_accepted, most_frequent_tokens
from cascadia.drafts.capture import Captured, capture
from cascadia.drafts.heads import DEPLOYED, F32, FULL, INT4, REDUCED, CompiledHead, DraftHead
from cascadia.engine.checkpoint import Checkpoint
from cascadia.engine.device import pick_device, runs_as
from cascadia.engine.engine import Engine
from cascadia.engine.generate import check_request
from cascadia.errors import CheckpointError, RequestError
from cascadia.graph.plan import Plan
from cascadia.models.base import config_differences
from cascadia.pipeline.run import Pipeline
from cascadia.spec.types import Spec, WeightFormat
from cascadia.workload import stop_ids

F32_FORMAT = WeightFormat("f32")
INT4_FORMAT = WeightFormat("int4", 32, symmetric=False)  # the paper's expert format: the smallest it deploys
PROMPTS = "prompts"


@attrs.frozen
class HeadResult:
    name: str
    vocabulary: str  # FULL or REDUCED
    weights: str  # F32, DEPLOYED or INT4
    tokens: int  # the vocabulary it scores
    format: str
    precision: str  # what the plugin ran
    weight_bytes: int
    expected_accepted: tuple[float, ...]  # chains of 1..K; the first is the top-1 agreement

    @property
    def agreement(self) -> float:
        return self.expected_accepted[0]

    def to_json(self) -> dict:
        return attrs.asdict(self) | {"agreement": self.agreement, "expected_accepted": list(self.expected_accepted)}


@attrs.frozen
class DraftEvaluation:
    captured: tuple[Captured, ...]
    deployed: dict  # precision (as run), device, head format, CPU
    reduced_tokens: int
    reduced_seen: int  # of them, those the corpus holds (the others, that it never holds, are the lowest ids)
    vocabulary_source: str  # PROMPTS or the corpus file
    coverage: float  # share of the deployed tokens inside the reduced vocabulary: no reduced head agrees more often
    heads: tuple[HeadResult, ...]

    @property
    def positions(self) -> int:
        return sum(len(c.tokens) for c in self.captured)

    @property
    def chain(self) -> int:
        return len(self.heads[0].expected_accepted)

    def head(self, vocabulary: str, weights: str) -> HeadResult:
        return next(h for h in self.heads if (h.vocabulary, h.weights) == (vocabulary, weights))

    def view(self) -> dict:
        """The 2x2 view (vocabulary x precision) and the effects it separates, on the top-1 agreement and on the
        expected accepted drafts of the longest chain: vocabulary selection at full precision, quantisation at the
        full vocabulary, and what the two do together beyond the sum of both (interaction)."""
        cells = {vocabulary: {weights: self.head(vocabulary, weights) for weights in (F32, INT4)}
                 for vocabulary in (FULL, REDUCED)}

        def effects(value: Callable[[HeadResult], float]) -> dict:
            full, full_int4 = value(cells[FULL][F32]), value(cells[FULL][INT4])
            reduced, reduced_int4 = value(cells[REDUCED][F32]), value(cells[REDUCED][INT4])
            return {"vocabulary": reduced - full, "quantisation": full_int4 - full,
                    "interaction": reduced_int4 - reduced - full_int4 + full}

        return {"cells": {vocabulary: {weights: {"head": h.name, "agreement": h.agreement,
                                                 "expected_accepted": list(h.expected_accepted)}
                                       for weights, h in row.items()} for vocabulary, row in cells.items()},
                "effects": {"agreement": effects(lambda h: h.agreement),
                            "expected_accepted": effects(lambda h: h.expected_accepted[-1])}}

    def to_json(self) -> dict:
        return {"kind": "draft-eval", "deployed": self.deployed, "positions": self.positions, "chain": self.chain,
                "reduced_vocabulary": {"tokens": self.reduced_tokens, "seen": self.reduced_seen,
                                       "from": self.vocabulary_source, "coverage": self.coverage},
                "heads": [h.to_json() for h in self.heads], "view": self.view(),
                "sequences": [c.to_json() for c in self.captured]}


def draft_heads(output_vocabulary: int, reduced_ids: np.ndarray, deployed_format: WeightFormat,
                deployed_precision: str) -> list[DraftHead]:
    """Per vocabulary (full, reduced): the head in f32 (computed in f32: the exact reference), in the deployed
    format and in int4 (both computed at the deployed precision)."""
    return [head for vocabulary, ids in ((FULL, np.arange(output_vocabulary)), (REDUCED, reduced_ids))
            for head in (DraftHead(vocabulary, F32, ids, F32_FORMAT, "f32"),
                         DraftHead(vocabulary, DEPLOYED, ids, deployed_format, deployed_precision),
                         DraftHead(vocabulary, INT4, ids, INT4_FORMAT, deployed_precision))]


def draft_eval(spec: Spec, checkpoint: Checkpoint, prompts: Sequence[tuple[int, ...]], reduced_tokens: int,
               chain: int, max_new_tokens: int, corpus: Sequence[tuple[int, ...]] | None = None,
               corpus_name: str = PROMPTS, threads: int | None = None,
               progress: Callable[[str], None] = lambda message: None, plan: Plan | None = None) -> DraftEvaluation:
    """Capture the deployed path for each prompt (`capture_deployed`; on the pipeline of `plan` where one is given,
    `capture_pipeline`), then measure the `draft_heads` on the captured states for chains of 1..`chain`, the
    reduced vocabulary being the `reduced_tokens` most frequent in `corpus` (default: the prompts)."""
    cfg = checkpoint.config
    corpus = prompts if corpus is None else corpus
    reduced_ids = most_frequent_tokens(corpus, reduced_tokens, cfg.output_vocab_size)
    captured, deployed = capture_deployed(spec, checkpoint, prompts, max_new_tokens, threads, progress) \
        if plan is None else capture_pipeline(spec, plan, checkpoint, prompts, max_new_tokens, progress)
    head_inputs = np.concatenate([c.head_inputs for c in captured])
    tokens = np.concatenate([c.tokens for c in captured])
    ends = np.cumsum([len(c.tokens) for c in captured])[:-1]  # where each sequence's positions begin
    results = []
    for head in draft_heads(cfg.output_vocab_size, reduced_ids, spec.model.formats.head, spec.runtime.precision):
        progress(f"draft head {head.name}: {head.fmt}, {len(head.ids)} tokens")
        compiled = CompiledHead(head, checkpoint, deployed["device"], spec.runtime.row_buckets, threads)
        agree = np.split(compiled.tokens(head_inputs) == tokens, ends)
        results.append(HeadResult(head.name, head.vocabulary, head.weights, len(head.ids), str(head.fmt),
                                  compiled.precision, compiled.weight_bytes,
                                  tuple(expected_accepted(agree, chain).tolist())))
    return DraftEvaluation(tuple(captured), deployed, reduced_tokens,
                           int(np.isin(reduced_ids, np.concatenate(corpus)).sum()), corpus_name,
                           float(np.isin(tokens, reduced_ids).mean()), tuple(results))


def capture_deployed(spec: Spec, checkpoint: Checkpoint, prompts: Sequence[tuple[int, ...]], max_new_tokens: int,
                     threads: int | None = None, progress: Callable[[str], None] = lambda message: None
                     ) -> tuple[list[Captured], dict]:
    """Each prompt through the engine of the spec's runtime precision and weight formats, greedy, up to
    `max_new_tokens` (ending at EOS when the spec's workload says `stop_at_eos`), with what its head reads; and
    the deployed path as it ran (precision, device, head format, CPU)."""
    cfg = checkpoint.config
    _check_model(spec, checkpoint)
    runtime = attrs.evolve(spec.runtime, max_streams=1, context_budget=max(map(len, prompts)) + max_new_tokens)
    formats = spec.model.formats
    check_request(checkpoint, max(prompts, key=len), max_new_tokens, formats, runtime)
    progress("compiling the deployed engine")
    engine = Engine(checkpoint, runtime, formats=formats, threads=threads)
    captured = []
    for number, prompt in enumerate(prompts, 1):
        captured.append(capture(engine, prompt, max_new_tokens, stop_ids(spec.workload, cfg)))
        progress(f"captured prompt {number}/{len(prompts)}: {len(prompt)} + {len(captured[-1].tokens)} tokens")
    return captured, {"path": "one process", "precision": engine.stage.precision, "device": engine.stage.device,
                      "head_format": str(formats.head), "cpu": host_cpus.describe(host_cpus.identity())}


def capture_pipeline(spec: Spec, plan: Plan, checkpoint: Checkpoint, prompts: Sequence[tuple[int, ...]],
                     max_new_tokens: int, progress: Callable[[str], None] = lambda message: None
                     ) -> tuple[list[Captured], dict]:
    """As `capture_deployed`, on the plan's nodes (local ones started here, reading `checkpoint`; remote ones
    started with --logits): their last node sends back what its head read with each token. The precision and
    device are those this machine's nodes run."""
    _check_model(spec, checkpoint)
    longest = max(map(len, prompts)) + max_new_tokens
    if longest > spec.runtime.context_budget:
        raise RequestError(f"the longest prompt plus {max_new_tokens} tokens is {longest} positions, beyond "
                           f"{spec.source}'s context budget of {spec.runtime.context_budget}")
    nodes = ", ".join(stage.node for stage in plan.stages)
    progress(f"starting the pipeline: {nodes}")
    captured = []
    with Pipeline.start(spec, plan, checkpoint=checkpoint.path, with_logits=True) as pipeline:
        for number, prompt in enumerate(prompts, 1):
            tokens, head_inputs = pipeline.greedy(prompt, max_new_tokens, stop_ids(spec.workload, checkpoint.config))
            captured.append(Captured(tuple(prompt), head_inputs, np.array(tokens, np.int64)))
            progress(f"captured prompt {number}/{len(prompts)}: {len(prompt)} + {len(tokens)} tokens")
    device = pick_device()
    return captured, {"path": f"pipeline ({nodes})", "precision": runs_as(spec.runtime.precision, device),
                      "device": device, "head_format": str(spec.model.formats.head),
                      "cpu": host_cpus.describe(host_cpus.identity())}


def _check_model(spec: Spec, checkpoint: Checkpoint) -> None:
    if differences := config_differences(checkpoint.config, spec.model.config):
        more = f" and {len(differences) - 3} more" if len(differences) > 3 else ""
        raise CheckpointError(f"{checkpoint.path}: its config.json describes another model than {spec.source}'s: "
                              f"{', '.join(differences[:3])}{more} (checkpoint vs spec)")
