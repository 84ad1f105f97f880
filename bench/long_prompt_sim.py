"""One stream's first-token time and decode time per token against prompt length, predicted by the simulator.

Scenario: the spec's deployment (default: the paper's, specs/inkling-975b-11pc.yaml) serving one request alone (one
slot, a context budget of the prompt plus OUTPUT_TOKENS; `cascadia.sim.long_prompt`), prompts of each length,
simulated with the calibration given, or analytically from the spec's hardware figures (a lone stream's K/V read once
per frame, as the engine reads it). For the paper's spec, its measured figures beside (11 PCs: decode 54 ms/token at
4k, 216 at 64k, 1,496 at 512k; TTFT 22 s at 1k, 110 min at 64k). Not a test: it prints a table and writes it to
bench/results/long_prompt_sim-SPEC.json (SPEC: the spec's file name).

    python bench/long_prompt_sim.py [--spec SPEC] [--calibration CAL | --calibrate] [--prompts 1024,4096,...]

`--calibrate` measures the spec's calibration first (`cascadia calibrate --layers-only`: its nodes on this machine).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from record import Table, calibrate, now, shown, write

from cascadia.errors import CascadiaError
from cascadia.sim.calibration import Calibration
from cascadia.sim.long_prompt import simulate_long_prompt
from cascadia.spec.load import load_spec

PAPER_SPEC = Path(__file__).parent.parent / "specs" / "inkling-975b-11pc.yaml"
PROMPTS = (1024, 4096, 16384, 65536, 131072, 262144, 524288)
OUTPUT_TOKENS = 8
PAPER_DECODE_MS = {4096: 54, 65536: 216, 524288: 1496}
PAPER_TTFT_S = {1024: 22, 65536: 110 * 60}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", type=Path, default=PAPER_SPEC)
    given = parser.add_mutually_exclusive_group()
    given.add_argument("--calibration", type=Path, help="a calibration JSON (default: analytic)")
    given.add_argument("--calibrate", action="store_true", help="measure the spec's calibration first")
    parser.add_argument("--prompts", default=",".join(map(str, PROMPTS)), help="prompt lengths, comma-separated")
    parser.add_argument("--out", type=Path, help="default bench/results/long_prompt_sim-SPEC.json")
    args = parser.parse_args()
    started = now()
    spec = load_spec(args.spec)
    with tempfile.TemporaryDirectory(prefix="cascadia-long-prompt-") as folder:
        calibration = (Calibration.load(calibrate(args.spec, Path(folder), "--layers-only")) if args.calibrate else
                       Calibration.load(args.calibration) if args.calibration else None)
    paper = args.spec.resolve() == PAPER_SPEC.resolve()
    table = Table(f"{shown(args.spec)}: one request alone, {OUTPUT_TOKENS} output tokens, calibration "
                  f"{'measured now' if args.calibrate else 'given' if calibration else 'analytic'}",
                  ["prompt tokens", "TTFT s", "decode ms/token", *(("paper TTFT s", "paper decode ms/token")
                                                                     if paper else ())])
    notes = {}
    for n in sorted(int(p) for p in args.prompts.split(",")):
        predicted = simulate_long_prompt(spec, calibration, n, OUTPUT_TOKENS)
        notes.update(dict.fromkeys(predicted.notes))
        table.add(n, predicted.ttft_s, predicted.decode_s * 1e3,
                  *((PAPER_TTFT_S.get(n), PAPER_DECODE_MS.get(n)) if paper else ()))
    table.note = "; ".join(notes) + "." if notes else ""
    print(table.text())
    write(f"long_prompt_sim-{args.spec.stem}",
          "One stream's first-token time and decode time against prompt length, simulated", started, [table],
          args.out, spec=shown(args.spec),
          calibration="measured now" if args.calibrate else shown(args.calibration) if args.calibration else None)


if __name__ == "__main__":
    try:
        main()
    except CascadiaError as e:  # a spec or calibration that cannot be read, a spec without hardware figures
        sys.exit(f"error: {e}")
