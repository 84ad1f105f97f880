"""The simulator's entry point: a spec's workload through the SimPy model, in the metrics schema of `cascadia run`."""

from __future__ import annotations

from pathlib import Path
from typing import BinaryIO

from cascadia import metrics
from cascadia.driver import Served, serve_workload
from cascadia.errors import CascadiaError
from cascadia.graph.plan import Plan
from cascadia.policy import Policy
from cascadia.sim.calibration import Calibration
from cascadia.sim.drafts import DEFAULT_ACCEPTANCE, RateDrafter, Step, TraceDrafter
from cascadia.sim.fit import replayed_handling
from cascadia.sim.loss import DETECT_S, Loss, recovery
from cascadia.sim.model import PipelineModel
from cascadia.sim.replay import ReplayTimes
from cascadia.spec.types import Spec
from cascadia.tokenizer import workload_prompts
from cascadia.trace import FrameTiming
from cascadia.workload import MEASURED, prompt_length_notes


def simulate(spec: Spec, calibration: Calibration, plan: Plan | None = None,
             timings: list[FrameTiming] | None = None, loss: Loss | None = None, detect_s: float = DETECT_S,
             acceptance: float = DEFAULT_ACCEPTANCE, acceptance_trace: dict[int, list[Step]] | None = None,
             warm_up: bool = True, proposing: float = 1.0, replay: ReplayTimes | None = None) -> dict:
    """Simulate every concurrency level of `spec.workload` (warm-up and measured phase) on `plan`.

    `plan` defaults to the planner's. Prompts come from the workload's
    prompts file (text encoded by the checkpoint's tokenizer), or are seeded random ones without one. `timings`: a
    list that takes every frame's way round the pipeline, for a trace. `loss`: a node lost in each level's measured
    phase, found `detect_s` later (`cascadia.sim.loss`); the result then says, per level, what it cost ("losses").
    With `spec.runtime.speculate`, drafts are proposed at a share `proposing` of the steps where the policy asks,
    each accepted with probability `acceptance`, or as in a run's `acceptance_trace` (`cascadia.sim.drafts`).
    Without `warm_up`, each level's warm-up phase is not simulated: a phase starts from an idle pipeline and draws
    its own arrivals either way, so the measured phases come out the same (to the rounding of the clock's later
    start), unless drafts are accepted at random (the draws run on through the phases). `replay`: each frame's
    compute from a run's trace (`cascadia.sim.replay`), for a plan on the trace's nodes; the result then says how
    many frames it replayed ("replay").
    """
    if plan is None:
        from cascadia.graph.planner import plan as make_plan

        plan = make_plan(spec)
    prompts = workload_prompts(spec.workload, spec.model.checkpoint, spec.model.config)
    notes = [*calibration.check_model(spec), *(prompt_length_notes(prompts, spec.workload, spec.runtime)
                                               if prompts else [])]
    if replay is not None:
        calibration = replayed_handling(spec, plan, calibration, replay)
    model = PipelineModel(spec, plan, calibration, replay)
    model.timings = timings
    how = recovery(loss, spec, plan.stages, calibration, detect_s) if loss else None
    drafter = TraceDrafter(acceptance_trace) if acceptance_trace else \
        RateDrafter(acceptance, spec.workload.seed, proposing)
    policy = Policy.for_runtime(spec.runtime, len(plan.stages), plan.kv_pools, drafter)

    def run_phase(level, phase, recorder):
        if not warm_up and phase.name != MEASURED:
            return {}
        if loss is None or phase.name != MEASURED:
            return model.run_phase(policy, level.arrivals(phase), phase.streams, recorder)
        start, before = model.env.now, len(model.losses)
        busy = model.run_phase(policy, level.arrivals(phase), phase.streams, recorder, (loss, how))
        if len(model.losses) == before:
            notes.append(f"{level.describe}: the measured phase was over after {model.env.now - start:.3g} s, "
                         f"before {loss.node} was lost at {loss.at_s:g} s")
        for record in model.losses[before:]:
            record.update(concurrency=level.concurrency, rate=level.rate)
        return busy

    served = serve_workload(spec, spec.workload, prompts, run_phase, Served())
    replayed = replay.notes() if replay else []
    result = metrics.result("simulate", spec, served.levels, served.records, calibration=calibration.describe(),
                            plan=plan.to_dict(), warnings=notes + model.notes + model.extrapolations.notes + replayed)
    if replay:
        result["replay"] = {"frames": replay.frames, "replayed": replay.replayed, "tabled": replay.tabled}
    return result | ({"losses": model.losses} if loss else {})


def plot(result: dict, out: str | Path | BinaryIO) -> None:
    """Throughput and first-token latency against concurrency, as a PNG image (a file's path, or a binary file)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise CascadiaError("plotting needs matplotlib, which is not installed (pip install 'cascadia[plot]')") \
            from None
    levels = result["levels"]
    streams = [level["concurrency"] for level in levels]
    fig, (rate, latency) = plt.subplots(1, 2, figsize=(11, 4))
    for key, label in (("decode_tokens_per_s", "decode"), ("phase_tokens_per_s", "whole phase")):
        rate.plot(streams, [level[key] for level in levels], marker="o", label=label)
    rate.set(xlabel="concurrent streams", ylabel="tokens/s", title="Throughput")
    for key in ("p50", "p95"):
        latency.plot(streams, [level["ttft_s"][key] for level in levels], marker="o", label=f"TTFT {key}")
    latency.set(xlabel="concurrent streams", ylabel="seconds", title="First-token latency")
    for axes in (rate, latency):
        axes.grid(alpha=0.3)
        axes.legend()
    kind = result["calibration"]["kind"] if result.get("calibration") else result["source"]
    fig.suptitle(f"{result['spec']['model']['name']}: {result['source']} ({kind})")
    fig.tight_layout()
    fig.savefig(out, dpi=120, format="png")
    plt.close(fig)
