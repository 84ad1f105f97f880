"""The fleets a search weighs: each machine type of a catalogue, from the fewest that hold the model up to a most,
and mixes of two types that just hold it, in each of the weight-format presets and runtime settings asked for, with
the spares asked for.

Presets: "spec" (the spec's own formats), "paper" (the Cascadia paper's: experts and dense MLP int4 in groups of 32,
attention and head int8 per row, embedding bf16), "int8" (every matrix int8 per row) and "int4" (every matrix int4
in groups of 32, the embedding and head int8 per row, as llama.cpp's Q4_0 files keep them).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

import attrs

from cascadia.errors import CalibrationError, SpecError
from cascadia.graph.plan import ring_pairs
from cascadia.graph.planner import fewest_nodes
from cascadia.models.base import LayerKind
from cascadia.sim.analytic import analytic_calibration
from cascadia.sim.calibration import Calibration, weight_formats
from cascadia.spec.types import (PAPER_FORMATS, Catalogue, ClusterSpec, LinkSpec, MachineType, Spec, WeightFormat,
                                 WeightFormats)
from cascadia.workload import misfits

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
class Settings:
    """Runtime settings a fleet is weighed with, where they are not the spec's (None: the spec's)."""

    max_streams: int | None = None
    prefill_window: int | None = None
    speculate: str | None = None  # "off", or as `runtime.speculate` ("ngram:4")
    row_buckets: tuple[int, ...] | None = None
    pipeline_groups: int | None = None

    def apply(self, spec: Spec) -> Spec:
        """`spec` with these settings in its runtime."""
        given = {key: value for key, value in attrs.asdict(self, recurse=False).items()
                 if value is not None}
        if given.get("speculate") == "off":
            given["speculate"] = None
        return attrs.evolve(spec, runtime=attrs.evolve(spec.runtime, **given)) if given else spec

    def describe(self) -> str:
        """The settings given, in words ("" for none): "max_streams 8, row_buckets 1,8,32"."""
        return ", ".join(f"{key} {','.join(map(str, value)) if isinstance(value, tuple) else value}"
                         for key, value in attrs.asdict(self, recurse=False).items()
                         if value is not None)


def settings_grid(max_streams: Sequence[int] = (), prefill_windows: Sequence[int] = (),
                  speculate: Sequence[str] = (), row_buckets: Sequence[tuple[int, ...]] = (),
                  pipeline_groups: Sequence[int] = ()) -> list[Settings]:
    """Every combination of the values given for each setting (none given: the spec's)."""
    axes = (max_streams, prefill_windows, speculate, row_buckets, pipeline_groups)
    return [Settings(*values) for values in itertools.product(*(axis or (None,) for axis in axes))]


def _slower(a: LinkSpec, b: LinkSpec) -> LinkSpec:
    """What a switch gives between two ports: the lower bandwidth and the longer latency."""
    return LinkSpec(min(a.bandwidth, b.bandwidth), max(a.latency, b.latency))


@attrs.frozen
class Candidate:
    """`count` machines of one type, then `mix`'s count of a second type if given, linked through a switch at each
    one's port speed (the slower port of two between types), with the weights in the formats of a preset, running
    with `settings`."""

    machine: MachineType
    count: int
    formats: str = "spec"
    settings: Settings = Settings()
    mix: tuple[MachineType, int] | None = None  # the second type and how many, after the first's
    spares: int = 0  # machines standing by to take a lost one's stage, of the type with the most memory

    @property
    def spare(self) -> MachineType:
        """The type its spares are: the one with the most memory, so that any stage fits one."""
        return max((machine for machine, _ in self.parts), key=lambda machine: machine.memory_bytes)

    @property
    def parts(self) -> tuple[tuple[MachineType, int], ...]:
        """Each machine type and how many of it, in the fleet's order."""
        return ((self.machine, self.count),) + ((self.mix,) if self.mix else ())

    @property
    def machines(self) -> list[MachineType]:
        """Each node's machine type, in the fleet's order."""
        return [machine for machine, count in self.parts for _ in range(count)]

    @property
    def size(self) -> int:
        """Machines in all."""
        return sum(count for _, count in self.parts)

    @property
    def price(self) -> float:
        """What its machines cost, spares included."""
        return sum(machine.price * count for machine, count in self.parts) + self.spare.price * self.spares

    @property
    def power_w(self) -> float | None:
        """What its machines serving draw (spares stand by)."""
        if any(machine.power_w is None for machine, _ in self.parts):
            return None
        return sum(machine.power_w * count for machine, count in self.parts)

    @property
    def types(self) -> str:
        """Its machine types: "a", or "a + b" for a mix."""
        return " + ".join(machine.name for machine, _ in self.parts)

    def fleet(self) -> str:
        """Its machines: "3 x a", "2 x a + 1 x b", or with spares "3 x a + 1 spare"."""
        spares = f" + {self.spares} spare{'s' if self.spares > 1 else ''}" if self.spares else ""
        return " + ".join(f"{count} x {machine.name}" for machine, count in self.parts) + spares

    def describe(self) -> str:
        return ", ".join([self.fleet(), *([self.formats] if self.formats != "spec" else []),
                          *filter(None, [self.settings.describe()])])

    def spec(self, base: Spec) -> Spec:
        """`base` (model, runtime, workload, reserve) on this fleet, nodes NAME0..NAME{count-1} of each type, in its
        formats and with its settings."""
        nodes = tuple(machine.node(f"{machine.name}{i}") for machine, count in self.parts for i in range(count))
        links = {}
        if self.mix:  # between the types, and so by default, the slower port; within the faster type, its own
            default = _slower(self.machine.link, self.mix[0].link)
            kinds = self.machines
            links = {tuple(sorted((a.name, b.name))): kind.link
                     for a, b, kind, after in zip(nodes, nodes[1:], kinds, kinds[1:])
                     if kind is after and kind.link != default}
        else:
            default = self.machine.link
        spares = tuple(self.spare.node(f"{self.spare.name}-spare{i}") for i in range(self.spares))
        cluster = ClusterSpec(nodes, default_link=default, links=links, reserve_bytes=base.cluster.reserve_bytes,
                              spares=spares)
        return self.settings.apply(with_formats(attrs.evolve(base, cluster=cluster), self.formats))

    def calibration(self, fleet: Spec) -> Calibration:
        """What the simulator takes each layer of `fleet` (this fleet's `spec`) to cost, for any load: the times
        measured on one machine of each type, on each of that type, or the roofline of their figures (a fleet's
        types are all measured or none is); links as listed."""
        if self.machine.calibration is None:
            return analytic_calibration(fleet, open_loop=True)
        names = [node.name for node in fleet.cluster.nodes]
        return attrs.evolve(self.machine.calibration,
                            nodes={name: next(iter(machine.calibration.nodes.values()))
                                   for name, machine in zip(names, self.machines)},
                            links={(a, b): fleet.cluster.link(a, b) for a, b in ring_pairs(names) if a != b})


@attrs.frozen
class Unfit:
    """A machine type that holds no layer of the model in a preset's formats with some settings, whatever their
    number."""

    machine: MachineType
    formats: str
    settings: Settings = Settings()


def space(spec: Spec, catalogue: Catalogue, machines: Sequence[str] = (), presets: Sequence[str] = ("spec",),
          most: int | None = None, settings: Sequence[Settings] = (Settings(),),
          mixes: bool = False, spares: int = 0) -> Iterator[Candidate | Unfit]:
    """For each machine type (of `machines`, or every one), preset and settings: the fleets from the fewest machines
    that hold the model to `most` (default: twice the fewest), never more than the model's layers, each with
    `spares` more standing by (not counted in `most`). With `mixes`,
    then for each two types (both measured, or neither) the mixes that just hold the model: k of the first (k short
    of the fewest that hold it alone) and the fewest of the second that make up the rest, at most `most` in all. A
    SpecError for a machine measured on another model, in other weight formats or at another precision than a
    preset's fleets run, and for settings the spec's runtime and workload cannot take."""
    layers = spec.model.config.num_hidden_layers
    for each in settings:
        _check_settings(each.apply(spec), each)
    chosen = [catalogue.machine(name) for name in machines] if machines else list(catalogue.machines)
    for preset, each in itertools.product(presets, settings):
        weighed = each.apply(with_formats(spec, preset))
        fewest = {}
        for machine in chosen:
            if machine.calibration is not None:
                _check_measured(weighed, machine, preset)
            fewest[machine.name] = fewest_nodes(weighed, machine.node(machine.name))
        for machine in chosen:
            least = fewest[machine.name]
            if least is None:
                yield Unfit(machine, preset, each)
                continue
            for count in range(least, max(least, min(2 * least if most is None else most, layers)) + 1):
                yield Candidate(machine, count, preset, each, spares=spares)
        if not mixes:
            continue
        for first, second in itertools.permutations([m for m in chosen if fewest[m.name] is not None], 2):
            if (first.calibration is None) != (second.calibration is None):
                continue
            for count in range(1, fewest[first.name]):
                beside = tuple(first.node(f"{first.name}{i}") for i in range(count))
                rest = fewest_nodes(weighed, second.node(second.name), beside)
                if rest is not None and count + rest <= min(most or layers, layers):
                    yield Candidate(first, count, preset, each, (second, rest), spares)


def _check_settings(spec: Spec, settings: Settings) -> None:
    """Raise where `settings` leave the spec's runtime or its workload's requests (arriving at a rate, as a
    search's probes do) unable to run, as the spec's loader would."""
    problems = [spec.runtime.window_misfit(), *(message for _, message in misfits(
        attrs.evolve(spec.workload, rate=(1.0,)), spec.runtime))]
    if problems := [problem for problem in problems if problem]:
        raise SpecError(f"{settings.describe()}: {'; '.join(problems)}")


def _check_measured(fleet: Spec, machine: MachineType, preset: str) -> None:
    """Raise unless `machine`'s measured times are those of `fleet`'s model, weight formats and precision, for
    every kind of layer a node of its fleets may hold."""
    measured = machine.calibration
    config = fleet.model.config
    kinds = {LayerKind.EMBEDDING, LayerKind.HEAD} | {kind(i) for i in range(config.num_hidden_layers)
                                                     for kind in (config.attention_kind, config.mlp_kind)}
    ((name, node),) = measured.nodes.items()
    if missing := sorted(kinds - set(node.tables)):
        raise SpecError(f"machine {machine.name}: node {name} of {measured.source} has no times for "
                        f"{', '.join(missing)}, which a node of its fleets may hold: calibrate a spec whose one "
                        "node holds the whole model, or name the nodes of a pipeline of this type that together "
                        "hold it (calibration: {nodes: [...]})")
    try:
        measured.check_model(fleet)  # the notes are of the machine measuring, not of the one searching: not ours
    except CalibrationError as e:
        raise SpecError(f"machine {machine.name}: {e}") from None
    formats, ours = measured.meta.weight_formats, weight_formats(fleet)
    if differ := [f"{group} {formats.get(group)} (not {wanted})" for group, wanted in ours.items()
                  if formats.get(group) != wanted]:
        raise SpecError(f"machine {machine.name}: {measured.source} was measured with {', '.join(differ)}, unlike "
                        f"the {preset!r} formats: calibrate it in those, or weigh it in its own (--formats)")
    if measured.meta.precision != fleet.runtime.precision:
        raise SpecError(f"machine {machine.name}: {measured.source} was measured at precision "
                        f"{measured.meta.precision}; the spec runs {fleet.runtime.precision}")
