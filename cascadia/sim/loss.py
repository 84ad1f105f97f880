"""A lost node in the simulator (`cascadia simulate --fail NODE@SECONDS`): when it goes, and what recovery costs.

The model follows `cascadia serve`: frames that had not passed the lost node by then are lost, and so are those
sent before the coordinator knows (`detect_s`: the stall timeout for a node that stops answering); then a node
started in its place loads the stage (`restart_s`); then every stream is rebuilt by prefilling its prompt and its
tokens so far (`Policy.replay`), through the pipeline, and decoding goes on.
"""

from __future__ import annotations

import attrs

from cascadia.graph.plan import Stage
from cascadia.metrics import level_label, load_heading
from cascadia.sim.calibration import Calibration, CalibrationError
from cascadia.spec.types import Spec
from cascadia.table import format_rows

DETECT_S = 2.0  # `cascadia serve --stall-timeout`'s default: a node that stops answering is lost after it


@attrs.frozen
class Loss:
    node: str
    at_s: float  # seconds into each level's measured phase


@attrs.frozen
class Recovery:
    stage: int  # the lost node's stage
    detect_s: float  # from the loss until the coordinator knows
    restart_s: float  # then until a node in its place is ready


def recovery(loss: Loss, spec: Spec, stages: tuple[Stage, ...], calibration: Calibration,
             detect_s: float = DETECT_S) -> Recovery:
    """A loss's recovery on this plan: the restart a measured calibration timed, else the stage's weights read at
    the node's `disk_bandwidth` (process start and graph compilation not counted)."""
    index = next((i for i, stage in enumerate(stages) if stage.node == loss.node), None)
    if index is None:
        raise CalibrationError(f"--fail {loss.node}: the plan has no stage on that node (its stages are on "
                               f"{', '.join(stage.node for stage in stages)})")
    measured = calibration.nodes[loss.node].restart_s
    if measured is not None:
        return Recovery(index, detect_s, measured)
    bandwidth = spec.cluster.node(loss.node).disk_bandwidth
    if bandwidth is None:
        raise CalibrationError(f"--fail {loss.node}: the calibration has no restart time for it and the spec no "
                               f"disk_bandwidth, one of which a simulated loss needs")
    return Recovery(index, detect_s, stages[index].weight_bytes / bandwidth)


def format_losses(losses: list[dict]) -> str:
    """What each level's loss cost, in seconds from the loss: found, the stage back, the first token after."""
    rows = [(load_heading(losses), "lost", "at s", "found after s", "back after s", "first token after s")]
    for loss in losses:
        first = loss["first_token_s"]
        rows.append((level_label(loss), loss["node"], f"{loss['at_s']:g}", f"{loss['detected_s']:.2f}",
                     f"{loss['back_s']:.2f}", "-" if first is None else f"{first:.2f}"))
    return format_rows(rows, left={1})
