"""The validated spec: model, cluster, runtime and workload as frozen attrs classes.

Sizes are bytes, times seconds, rates per second, everywhere. `cascadia.spec.load` builds these from YAML and reports
every problem with its file, key path and line; these classes only hold values that already passed.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import attrs

from cascadia.models import mtp_layers
from cascadia.models.base import ModelConfig
from cascadia.speculation import MTP, parse_speculate, speculate_setting

WEIGHT_DTYPES = ("int4", "int8", "f16", "bf16", "f32")
PRECISIONS = ("f32", "bf16", "f16")
DEVICES = ("auto", "GPU", "CPU")
# Tensor groups that each get a weight format.
TENSOR_GROUPS = ("routed_experts", "shared_experts", "attention", "dense_mlp", "embedding", "head")


@attrs.frozen
class WeightFormat:
    """How one group of weight matrices is stored: integer with per-group scales, or a float type."""

    dtype: str = "f32"
    group_size: int | None = None  # int4/int8: weights per scale along the input dim; None = one scale per row
    symmetric: bool = True  # asymmetric integer formats also store a zero point per group

    @property
    def bits(self) -> int:
        return {"int4": 4, "int8": 8, "f16": 16, "bf16": 16, "f32": 32}[self.dtype]

    @property
    def is_integer(self) -> bool:
        return self.dtype in ("int4", "int8")

    def matrix_bytes(self, rows: int, cols: int) -> int:
        """Bytes of a [rows, cols] matrix (cols = input dim), scales (f16) and zero points included."""
        data = math.ceil(rows * cols * self.bits / 8)
        if not self.is_integer:
            return data
        groups = rows * (math.ceil(cols / self.group_size) if self.group_size else 1)
        zero_point_bytes = 0 if self.symmetric else math.ceil(groups * self.bits / 8)
        return data + 2 * groups + zero_point_bytes

    def __str__(self) -> str:
        if not self.is_integer:
            return self.dtype
        group = f" g{self.group_size}" if self.group_size else " per-row"
        return f"{self.dtype}{group}{'' if self.symmetric else ' asym'}"


@attrs.frozen
class WeightFormats:
    routed_experts: WeightFormat = WeightFormat()
    shared_experts: WeightFormat = WeightFormat()
    attention: WeightFormat = WeightFormat()
    dense_mlp: WeightFormat = WeightFormat()
    embedding: WeightFormat = WeightFormat()
    head: WeightFormat = WeightFormat()


_INT4_G32_ASYM = WeightFormat("int4", 32, symmetric=False)
_INT8_PER_ROW_ASYM = WeightFormat("int8", symmetric=False)
# The weight formats of the Cascadia paper's deployment (specs/models/inkling-975b.yaml says why each).
PAPER_FORMATS = WeightFormats(routed_experts=_INT4_G32_ASYM, shared_experts=_INT4_G32_ASYM, dense_mlp=_INT4_G32_ASYM,
                              attention=_INT8_PER_ROW_ASYM, head=_INT8_PER_ROW_ASYM, embedding=WeightFormat("bf16"))


@attrs.frozen
class ModelSpec:
    config: ModelConfig
    formats: WeightFormats = WeightFormats()
    checkpoint: Path | None = None  # resolved against the spec file's folder
    name: str = "inkling"


_TCP_ADDRESS = re.compile(r"tcp://([A-Za-z0-9_.-]+|\[[0-9A-Fa-f:.]+\]|\*):(\d{1,5})")


def is_tcp_address(text: object, to_bind: bool = False) -> bool:
    """Whether `text` is a ZeroMQ tcp address, tcp://HOST:PORT: HOST a name, an IPv4 or [IPv6] address, or (an
    address `to_bind`) * for every interface."""
    match = _TCP_ADDRESS.fullmatch(text) if isinstance(text, str) else None
    return bool(match) and (to_bind or match.group(1) != "*") and 0 < int(match.group(2)) < 65536


@attrs.frozen
class NodeSpec:
    name: str
    address: str = "local"  # "local" (started by cascadia run on 127.0.0.1) or "tcp://HOST:PORT"
    device: str = "auto"
    memory_bytes: int = 0  # usable memory for weights, state and reserve
    memory_bandwidth: float | None = None  # bytes/s, for analytic estimates
    compute_flops: float | None = None  # FLOP/s at the compute precision, for analytic estimates
    disk_bandwidth: float | None = None  # bytes/s its checkpoint is read at, for a simulated restart (`--fail`)
    host: str | None = None  # nodes naming the same host share its cores and memory bandwidth
    threads: int | None = None  # inference threads; None = let OpenVINO decide
    reserve_bytes: int | None = None  # overrides the cluster's runtime reserve
    layers: int | None = None  # pin: this node holds exactly this many layers; None = the planner chooses
    cpus: tuple[int, ...] | None = None  # the CPUs of its machine its process may run on; None = any
    # tcp://HOST:PORT where it stands by to be invited into a run (a fleet that formed itself, `cascadia.fleet`);
    # None: a node started with the spec, which connects to the coordinator by itself
    door: str | None = None

    @property
    def is_local(self) -> bool:
        return self.address == "local"

    @property
    def host_key(self) -> str:
        """The host whose cores the node computes on: its `host`, else a host of its own, named as the node."""
        return self.host or self.name


@attrs.frozen
class LinkSpec:
    bandwidth: float = 125e6  # bytes/s (gigabit Ethernet)
    latency: float = 100e-6  # s, one way


@attrs.frozen
class ClusterSpec:
    nodes: tuple[NodeSpec, ...]
    default_link: LinkSpec = LinkSpec()
    links: dict[tuple[str, str], LinkSpec] = attrs.field(factory=dict)  # keyed by sorted node-name pair
    reserve_bytes: int = 2 * 2**30  # OS, runtime, buffers: kept free on every node
    curve_keys: Path | None = None  # folder of CurveZMQ key files; None = no encryption
    coordinator_cpus: tuple[int, ...] | None = None  # the CPUs the coordinator's thread may run on; None = any
    # Nodes the plan leaves out: they start, load nothing and stand by to take a lost node's stage (`serve`)
    spares: tuple[NodeSpec, ...] = ()
    # The fleet forms itself when served: `serve` plans over the nodes that announce themselves (`cascadia.fleet`),
    # in place of any named here
    discover: bool = False

    @property
    def members(self) -> tuple[NodeSpec, ...]:
        """Every node, the plan's and the spares, in the spec's order (the order gives each its control sender id)."""
        return self.nodes + self.spares

    def node(self, name: str) -> NodeSpec:
        """The node (or spare) of that name (a KeyError naming it and the cluster's nodes, for one it lacks)."""
        for node in self.members:
            if node.name == name:
                return node
        raise KeyError(f"no node named {name!r} (the cluster has {', '.join(n.name for n in self.members)})")

    def link(self, a: str, b: str) -> LinkSpec:
        return self.links.get(tuple(sorted((a, b))), self.default_link)

    def reserve(self, node: NodeSpec) -> int:
        return self.reserve_bytes if node.reserve_bytes is None else node.reserve_bytes


@attrs.frozen
class MachineType:
    """A machine a user can buy (`cascadia search`'s catalogue): what a node of it holds and computes (its figures for
    a roofline, or its layers' times measured on one of them), its network link, what it costs and draws, and where
    those figures come from."""

    name: str
    memory_bytes: int  # usable for weights, state and reserve, as a node's `memory`
    memory_bandwidth: float | None = None  # bytes/s, sustained: the analytic estimate's roofline
    compute_flops: float | None = None  # FLOP/s at the compute precision
    device: str = "auto"
    disk_bandwidth: float | None = None  # bytes/s
    link: LinkSpec = LinkSpec()  # its network port, to the switch
    price: float = 0.0  # what one costs, in the catalogue's currency
    power_w: float | None = None  # watts it draws under load
    source: str = ""  # where the figures come from
    # measured on one of them: a `cascadia.sim.calibration.Calibration` of that one node (not imported here: it
    # reads specs); None: the roofline of the figures above
    calibration: object | None = None

    @property
    def times(self) -> str:
        """Where a simulation of it takes its layers' times from, in words."""
        if self.calibration is None:
            return "analytic: a roofline of its memory bandwidth and compute, no host overheads"
        node, = self.calibration.nodes
        return f"measured: node {node} of {self.calibration.source}"

    def node(self, name: str) -> NodeSpec:
        """A node of this machine, named `name`."""
        return NodeSpec(name, device=self.device, memory_bytes=self.memory_bytes,
                        memory_bandwidth=self.memory_bandwidth, compute_flops=self.compute_flops,
                        disk_bandwidth=self.disk_bandwidth)


@attrs.frozen
class Catalogue:
    """The machine types `cascadia search` may buy, in the catalogue file's order."""

    machines: tuple[MachineType, ...]
    currency: str = "USD"
    source: Path | None = None  # the YAML file it came from

    def machine(self, name: str) -> MachineType:
        """The machine type of that name (a KeyError naming the catalogue's, for one it lacks)."""
        for machine in self.machines:
            if machine.name == name:
                return machine
        listed = ", ".join(machine.name for machine in self.machines)
        raise KeyError(f"no machine named {name!r} in the catalogue (it lists {listed})")


STAGE_GRAPH_FAMILIES = ("llama", "qwen3_moe")  # model types whose stages run as one graph (`runtime.stage_graph`)
PAGED_ATTENTION_BLOCK = 32  # positions a block of the CPU plugin's PagedAttention caches holds


@attrs.frozen
class RuntimeSpec:
    context_budget: int = 1024  # the most positions a stream may reach
    max_streams: int = 16  # concurrent streams (slots)
    precision: str = "bf16"  # compute precision of the engine
    kv_precision: str = "f32"  # dtype of the K/V cache and convolution states
    row_buckets: tuple[int, ...] = (1, 2, 8, 16, 24, 32)  # increasing: rows of a call are padded up to one
    prefill_window: int = 8  # most prompt rows admitted per step
    # groups the streams are split into, each with one frame in flight: None, one per stage (every stage busy)
    pipeline_groups: int | None = None
    # MoE calls of at least this many rows (their bucket) run expert-grouped, smaller ones fused; "auto": from the
    # engine's own measurement at start-up; "never": always fused.
    moe_grouped_from: int | str = "never"
    # a stream's prompt chunks of at least this many rows read a global layer's far keys through OpenVINO's fused
    # attention (a chunk of 256 rows' attention 1.4-1.9x faster at 4k-64k positions); "never": every row by the spans
    # a decode step takes, so that its result does not depend on how its prompt was cut into chunks
    fused_attention_from: int | str = "never"
    # a stage's layers as one compiled graph a call (Llama and Qwen3-MoE, on the CPU): faster steps, exact to about
    # 1e-6 in f32 but not batch-invariant (`cascadia.engine.stage_graph`)
    stage_graph: bool = False
    # positions per block of a global layer's K/V pool; with a stage graph, the blocks OpenVINO's paged attention
    # reads and writes in place on the CPU (`cascadia.engine.paged_attention`)
    kv_block: int = attrs.field(default=attrs.Factory(lambda runtime: PAGED_ATTENTION_BLOCK if runtime.stage_graph
                                                      else 64, takes_self=True))
    # "ngram", "mtp" or "ngram+mtp", each maybe ":MAX_DRAFT": speculative decoding with prompt-lookup drafts, the
    # checkpoint's multi-token-prediction layer's, or both (`cascadia.speculation`); None: off
    speculate: str | None = attrs.field(default=None, validator=lambda _, __, value: parse_speculate(value))

    @property
    def max_draft(self) -> int:
        """The most draft rows a stream's frame carries, and so the most positions a stage rewinds (0: off)."""
        return parse_speculate(self.speculate)

    @property
    def drafters(self) -> tuple[str, ...]:
        """Who proposes drafts: `cascadia.speculation.NGRAM`, `MTP`, both or none."""
        return speculate_setting(self.speculate)[0]

    def groups(self, stages: int) -> int:
        """Pipeline groups on a plan of `stages` stages."""
        return self.pipeline_groups or stages

    def window_misfit(self) -> str:
        """Why the prefill window cannot be filled ("" when it can): more prompt rows than the slots hold."""
        if self.prefill_window <= self.max_streams * self.context_budget:
            return ""
        return (f"{self.prefill_window} prompt rows exceed what max_streams ({self.max_streams}) x context_budget "
                f"({self.context_budget}) positions hold")

    def drafting_misfit(self, config) -> str:
        """Why the model cannot draft as `speculate` says ("" when it can): MTP drafts from a model without a
        multi-token-prediction layer."""
        if MTP not in self.drafters or mtp_layers(config):
            return ""
        return (f"{self.speculate} drafts with the model's multi-token-prediction layer, and Cascadia runs none of "
                f"its config's (num_mtp_layers: {getattr(config, 'num_mtp_layers', None)}; only Inkling's); use ngram")

    def stage_graph_misfit(self, config) -> str:
        """Why the model's stages cannot run as one graph as `stage_graph` asks ("" when they can, or need not)."""
        if not self.stage_graph:
            return ""
        if config.model_type not in STAGE_GRAPH_FAMILIES:
            return (f"runs the layers of {' and '.join(STAGE_GRAPH_FAMILIES)} models as one graph, not "
                    f"{config.model_type}'s")
        if any(config.is_sliding(i) for i in range(config.num_hidden_layers)):
            return "runs no sliding-window layers as one graph"
        return ""

    def blocks_for(self, positions: int) -> int:
        """K/V pool blocks a stream of `positions` positions holds."""
        return -(-positions // self.kv_block)

    @property
    def moe_paths(self) -> tuple[str, ...]:
        """The MoE graphs a stage builds: "fused" unless every call runs the expert-grouped one (`moe_grouped_from`
        a row count at or below the smallest bucket), "grouped" where some call may run it ("auto", or a row count
        up to the largest bucket)."""
        setting = self.moe_grouped_from
        if setting == "never" or (isinstance(setting, int) and setting > self.largest_bucket):
            return ("fused",)
        if isinstance(setting, int) and setting <= self.row_buckets[0]:
            return ("grouped",)
        return ("fused", "grouped")

    @property
    def largest_bucket(self) -> int:
        """The most rows of one engine call (a larger frame runs as several calls of this many)."""
        return self.row_buckets[-1]


@attrs.frozen
class LengthSpec:
    """A token count: fixed, or drawn uniformly from [low, high] with the workload's seed."""

    low: int
    high: int

    @classmethod
    def fixed(cls, n: int) -> LengthSpec:
        return cls(n, n)


@attrs.frozen
class SloSpec:
    """What a request must meet to count towards goodput."""

    ttft: float  # seconds to its first token, at most
    tpot: float  # mean seconds per later token, at most


@attrs.frozen
class WorkloadSpec:
    concurrency: tuple[int, ...] = (1,)  # closed-loop levels: clients that each send the next request when done
    rate: tuple[float, ...] = ()  # open-loop levels (requests/s, Poisson arrivals); when given, in place of the above
    requests: int | None = None  # per level; None = as many as the level's concurrency
    prompt_tokens: LengthSpec = LengthSpec.fixed(16)
    prompts_file: Path | None = None  # JSONL: {"ids": [...]} or {"text": "..."} per line
    output_tokens: int = 16
    choices: int = 1  # streams of each prompt (a client's `n`): the prompt computed once, the others forked from it
    stop_at_eos: bool = False  # a request ends at EOS too (else it always makes output_tokens: benchmarks)
    greedy: bool = True
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    top_k: int = 0  # sample among the k most likely tokens only; 0: no limit
    min_p: float = 0.0  # ... among those at least min_p times as likely as the most likely
    slo: SloSpec | None = None  # counts the requests meeting it (goodput) in each level's summary


@attrs.frozen
class Spec:
    model: ModelSpec
    cluster: ClusterSpec
    runtime: RuntimeSpec = RuntimeSpec()
    workload: WorkloadSpec = WorkloadSpec()
    source: Path | None = None  # the YAML file it came from
