"""`cascadia draft-eval`'s report for people: every head, then the 2x2 view and the effects it separates."""

from __future__ import annotations

from cascadia.drafts.evaluate import INT4_FORMAT, PROMPTS, DraftEvaluation
from cascadia.drafts.heads import F32, FULL, INT4, REDUCED
from cascadia.table import format_rows
from cascadia.units import format_bytes


def format_report(evaluation: DraftEvaluation) -> str:
    e, chain = evaluation, evaluation.chain
    deployed = e.deployed
    source = "the prompts" if e.vocabulary_source == PROMPTS else e.vocabulary_source
    lines = [f"{len(e.captured)} prompts, {e.positions} generated positions; deployed ({deployed['path']}): "
             f"{deployed['precision']} on {deployed['device']}, head {deployed['head_format']}",
             f"CPU: {deployed['cpu']}",
             f"reduced vocabulary: the {e.reduced_tokens} tokens most frequent in {source} ({e.reduced_seen} of them "
             f"occur there, the rest by id), holding {e.coverage:.1%} of the deployed tokens", ""]
    header = ["head", "tokens", "format", "runs as", "weights", "top-1", *(f"k={k}" for k in range(2, chain + 1))]
    rows = [header] + [[h.name, str(h.tokens), h.format, h.precision, format_bytes(h.weight_bytes, digits=3),
                        f"{h.agreement:.3f}", *(f"{x:.2f}" for x in h.expected_accepted[1:])] for h in e.heads]
    lines += [format_rows(rows, left={0, 2, 3}),
              "top-1: agreement with the deployed token; k=j: expected accepted drafts for a chain of j", ""]
    view = e.view()
    cells = view["cells"]
    lines.append(f"2x2 view: top-1 agreement / expected accepted drafts for a chain of {chain}")

    def cell(vocabulary: str, weights: str) -> str:
        measured = cells[vocabulary][weights]
        return f"{measured['agreement']:.3f} / {measured['expected_accepted'][-1]:.2f}"

    grid = [["", F32, str(INT4_FORMAT)]] + [[label, cell(vocabulary, F32), cell(vocabulary, INT4)] for vocabulary, label
                                            in ((FULL, f"full {e.head(FULL, F32).tokens}"),
                                                (REDUCED, f"top {e.reduced_tokens}"))]
    lines.append(format_rows(grid, left={0}))
    effects = view["effects"]
    lines.append("effects: " + "; ".join(
        f"{what} {effects['agreement'][key]:+.3f} / {effects['expected_accepted'][key]:+.2f}"
        for key, what in (("vocabulary", "vocabulary selection (at f32)"),
                          ("quantisation", "quantisation (full vocabulary)"), ("interaction", "interaction"))))
    return "\n".join(lines)
