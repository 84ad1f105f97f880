"""The fleets a search weighs: each machine type of a catalogue, from the fewest that hold the model up to a most,
in each of the weight-format presets asked for.

Presets: "spec" (the spec's own formats), "paper" (the Cascadia paper's: experts and dense MLP int4 in groups of 32,
attention and head int8 per row, embedding bf16), "int8" (every matrix int8 per row) and "int4" (every matrix int4
in groups of 32, the embedding and head int8 per row, as llama.cpp's Q4_0 files keep them).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import attrs

from cascadia.graph.planner import fewest_nodes
from cascadia.spec.types import PAPER_FORMATS, Catalogue, ClusterSpec, MachineType, Spec, WeightFormat, WeightFormats

_INT8 = WeightFormat("int8", symmetric=False)
_INT4 = WeightFormat("int4", 32, symmetric=False)
PRESETS: dict[str, WeightFormats | None] = {
    "spec": None,
    "paper": PAPER_FORMATS,
    "int8": WeightFormats(*(_INT8,) * 6),
    "int4": WeightFormats(routed_experts=_INT4, shared_experts=_INT4, attention=_INT4, dense_mlp=_INT4,
                          embedding=_INT8, head=_INT8),
}


def with_formats(spec: Spec, preset: str) -> Spec:
    """`spec` with its weights in the formats of `preset`."""
    formats = PRESETS[preset]
    return spec if formats is None else attrs.evolve(spec, model=attrs.evolve(spec.model, formats=formats))


@attrs.frozen
class Candidate:
    """`count` machines of one type, linked through a switch at each one's port speed, with the weights in the
    formats of a preset."""

    machine: MachineType
    count: int
    formats: str = "spec"

    @property
    def price(self) -> float:
        return self.machine.price * self.count

    @property
    def power_w(self) -> float | None:
        return None if self.machine.power_w is None else self.machine.power_w * self.count

    def describe(self) -> str:
        return f"{self.count} x {self.machine.name}" + ("" if self.formats == "spec" else f", {self.formats}")

    def spec(self, base: Spec) -> Spec:
        """`base` (model, runtime, workload, reserve) on this fleet, nodes NAME0..NAME{count-1}, in its formats."""
        nodes = tuple(self.machine.node(f"{self.machine.name}{i}") for i in range(self.count))
        cluster = ClusterSpec(nodes, default_link=self.machine.link, reserve_bytes=base.cluster.reserve_bytes)
        return with_formats(attrs.evolve(base, cluster=cluster), self.formats)


@attrs.frozen
class Unfit:
    """A machine type that holds no layer of the model in a preset's formats, whatever their number."""

    machine: MachineType
    formats: str


def space(spec: Spec, catalogue: Catalogue, machines: Sequence[str] = (), presets: Sequence[str] = ("spec",),
          most: int | None = None) -> Iterator[Candidate | Unfit]:
    """For each machine type (of `machines`, or every one) and preset: the fleets from the fewest machines that hold
    the model to `most` (default: twice the fewest), never more than the model's layers."""
    layers = spec.model.config.num_hidden_layers
    for machine in [catalogue.machine(name) for name in machines] if machines else catalogue.machines:
        for preset in presets:
            fewest = fewest_nodes(with_formats(spec, preset), machine.node(machine.name))
            if fewest is None:
                yield Unfit(machine, preset)
                continue
            for count in range(fewest, max(fewest, min(2 * fewest if most is None else most, layers)) + 1):
                yield Candidate(machine, count, preset)
