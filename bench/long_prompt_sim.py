"""One stream's first-token time and decode time per token against prompt length, predicted by the simulator.

Scenario: the spec's deployment (default: the paper's, specs/inkling-975b-11pc.yaml) serving one request alone (one
slot, a context budget of the prompt plus OUTPUT_TOKENS; `cascadia.sim.long_prompt`), prompts of each length,
simulated with the calibration given, or analytically from the spec's hardware figures (a lone stream's K/V read once
per frame, as the engine reads it). For the paper's spec, its measured figures beside (11 PCs: decode 54 ms/token at
4k, 216 at 64k, 1,496 at 512k; TTFT 22 s at 1k, 110 min at 64k). Not a test: it prints a table.

    python bench/long_prompt_sim.py [--spec SPEC] [--calibration CAL] [--prompts 1024,4096,...]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from cascadia.errors import CascadiaError
from cascadia.sim.calibration import Calibration
from cascadia.sim.long_prompt import simulate_long_prompt
from cascadia.spec.load import load_spec
from cascadia.table import format_rows

PAPER_SPEC = Path(__file__).parent.parent / "specs" / "inkling-975b-11pc.yaml"
PROMPTS = (1024, 4096, 16384, 65536, 131072, 262144, 524288)
OUTPUT_TOKENS = 8
PAPER_DECODE_MS = {4096: 54, 65536: 216, 524288: 1496}
PAPER_TTFT_S = {1024: 22, 65536: 110 * 60}


def seconds(s: float) -> str:
    return f"{s:,.1f} s" if s < 600 else f"{s / 60:,.0f} min" if s < 36000 else f"{s / 3600:,.1f} h"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", type=Path, default=PAPER_SPEC)
    parser.add_argument("--calibration", type=Path, help="a calibration JSON (default: analytic)")
    parser.add_argument("--prompts", default=",".join(map(str, PROMPTS)), help="prompt lengths, comma-separated")
    args = parser.parse_args()
    spec = load_spec(args.spec)
    calibration = Calibration.load(args.calibration) if args.calibration else None
    paper = args.spec.resolve() == PAPER_SPEC.resolve()
    header = ("prompt tokens", "TTFT", "decode ms/token", *(("paper TTFT", "paper decode ms/token") if paper else ()))
    rows, notes = [header], {}
    for n in sorted(int(p) for p in args.prompts.split(",")):
        predicted = simulate_long_prompt(spec, calibration, n, OUTPUT_TOKENS)
        notes.update(dict.fromkeys(predicted.notes))
        rows.append((f"{n:,}", seconds(predicted.ttft_s), f"{predicted.decode_s * 1e3:,.1f}",
                     *((seconds(PAPER_TTFT_S[n]) if n in PAPER_TTFT_S else "-",
                        f"{PAPER_DECODE_MS[n]:,}" if n in PAPER_DECODE_MS else "-") if paper else ())))
    print(f"{spec.source}: one request alone, {OUTPUT_TOKENS} output tokens; calibration "
          f"{args.calibration or 'analytic'}\n")
    print(format_rows(rows))
    for note in notes:
        print(f"note: {note}")


if __name__ == "__main__":
    try:
        main()
    except CascadiaError as e:  # a spec or calibration that cannot be read, a spec without hardware figures
        sys.exit(f"error: {e}")
