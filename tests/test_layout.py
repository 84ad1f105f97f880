"""The layout's rules, read from the source: which package may import which, and no import cycle.

- `models/` (the families' descriptions) sits below everything that reads a model: it imports neither `engine/`,
  `pipeline/`, `sim/`, `measure/`, `serve/`, the graph, the spec nor the policy;
- `engine/` (one process, one model) imports neither `pipeline/`, `sim/`, `measure/` nor `serve/`;
- `pipeline/` (many processes) imports neither `sim/`, `measure/` nor `serve/`, and only its stage runtime
  (`pipeline/stage.py`) reaches into `engine/`;
- `sim/` imports neither `engine/`, `pipeline/`, `measure/` nor `serve/`;
- `serve/` (the HTTP front end) reaches the model only through `pipeline/`: neither `engine/`, `sim/` nor `measure/`;
- the policy, driver, workload, metrics, graph, spec and models modules import no OpenVINO, ZeroMQ, SimPy or HTTP
  stack, not even through other Cascadia modules;
- a family's modules (`models/inkling.py`, `engine/families/inkling.py`, ...) are imported only within `models/`
  and `engine/families/`: everything else reaches a model through `family(config)` and `host_layers(config)`;
- no module imports itself back through others (imports inside functions count too).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable
from pathlib import Path

import networkx as nx

PACKAGE = Path(__file__).parent.parent / "cascadia"
HEAVY = {"openvino", "zmq", "simpy", "fastapi", "starlette", "uvicorn"}
PURE = ("cascadia.policy", "cascadia.driver", "cascadia.workload", "cascadia.metrics", "cascadia.graph",
        "cascadia.spec", "cascadia.models")
# package -> packages it must not import
FORBIDDEN = {
    "cascadia.models": ("cascadia.engine", "cascadia.pipeline", "cascadia.sim", "cascadia.measure", "cascadia.serve",
                        "cascadia.cli", "cascadia.graph", "cascadia.spec", "cascadia.policy"),
    "cascadia.engine": ("cascadia.pipeline", "cascadia.sim", "cascadia.measure", "cascadia.serve", "cascadia.cli"),
    "cascadia.pipeline": ("cascadia.sim", "cascadia.measure", "cascadia.serve", "cascadia.cli"),
    "cascadia.sim": ("cascadia.engine", "cascadia.pipeline", "cascadia.measure", "cascadia.serve", "cascadia.cli"),
    "cascadia.serve": ("cascadia.engine", "cascadia.sim", "cascadia.measure", "cascadia.cli"),
}
ENGINE_BRIDGE = "cascadia.pipeline.stage"  # the one pipeline module that may import the engine
FAMILY_PACKAGES = ("cascadia.models", "cascadia.engine.families")
SHARED_BY_FAMILIES = ("cascadia.models.base", "cascadia.models.names", "cascadia.models.rope")


def module_names(package: Path = PACKAGE) -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name, for its __init__)."""
    out = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(package.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports_of(path: Path, modules: Iterable[str]) -> set[str]:
    """What a module imports, anywhere in it: Cascadia modules by their dotted names (`from cascadia.x import y` is
    cascadia.x.y when y is a module), other packages by their top-level name."""
    modules = set(modules)
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out |= {f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules else node.module
                    for alias in node.names}
    return {name if name.startswith("cascadia") else name.split(".")[0] for name in out}


def import_graph(package: Path = PACKAGE) -> nx.DiGraph:
    """Modules and their imports: an edge a -> b for each import of b by a (third-party packages are nodes too)."""
    modules = module_names(package)
    graph = nx.DiGraph()
    for name, path in modules.items():
        graph.add_node(name)
        graph.add_edges_from((name, target) for target in imports_of(path, modules) if target != name)
    return graph


def within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def violations(graph: nx.DiGraph) -> list[str]:
    """Every import that breaks a rule of the module's docstring, and every cycle."""
    found = []
    for source, target in graph.edges:
        for package, banned in FORBIDDEN.items():
            if within(source, package) and any(within(target, b) for b in banned):
                found.append(f"{source} imports {target}")
        if within(source, "cascadia.pipeline") and within(target, "cascadia.engine") and source != ENGINE_BRIDGE:
            found.append(f"{source} imports {target}: only {ENGINE_BRIDGE} bridges into the engine")
        if (any(target.startswith(package + ".") for package in FAMILY_PACKAGES) and target not in SHARED_BY_FAMILIES
                and not any(within(source, package) for package in FAMILY_PACKAGES)):
            found.append(f"{source} imports {target}: a family is reached through its config")
    for source in graph.nodes:
        if any(within(source, pure) for pure in PURE):
            reached = nx.descendants(graph, source) & HEAVY
            found += [f"{source} reaches {heavy}" for heavy in sorted(reached)]
    cascadia_only = graph.subgraph(n for n in graph.nodes if within(n, "cascadia"))
    found += [" -> ".join([*cycle, cycle[0]]) for cycle in nx.simple_cycles(cascadia_only)]
    return found


def test_the_layout_keeps_its_rules():
    assert violations(import_graph()) == []


def test_the_checker_finds_each_kind_of_violation(tmp_path):
    """A made-up package breaking every rule once: each break is named."""
    files = {
        "__init__.py": "",
        "engine/__init__.py": "", "engine/core.py": "from cascadia.pipeline import wire\n",
        "pipeline/__init__.py": "", "pipeline/wire.py": "def f():\n    import cascadia.engine.core\n",
        "pipeline/stage.py": "from cascadia.engine import core\n",
        "sim/__init__.py": "", "sim/model.py": "import simpy\nfrom cascadia import policy\n",
        "policy.py": "from cascadia.sim import model\n",
        "models/__init__.py": "from cascadia.models import llama\n", "models/llama.py": "", "models/base.py": "",
        "graph.py": "from cascadia.models import llama\nfrom cascadia.models import base\n",
    }
    for name, text in files.items():
        (tmp_path / "cascadia" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "cascadia" / name).write_text(text)
    found = violations(import_graph(tmp_path / "cascadia"))
    assert "cascadia.engine.core imports cascadia.pipeline.wire" in found
    assert any(f.startswith("cascadia.pipeline.wire imports cascadia.engine.core: only") for f in found)
    assert not any(f.startswith("cascadia.pipeline.stage imports") for f in found)  # the bridge may
    assert "cascadia.graph imports cascadia.models.llama: a family is reached through its config" in found
    assert not any(f.startswith(("cascadia.graph imports cascadia.models.base", "cascadia.models imports"))
                   for f in found)
    assert "cascadia.policy reaches simpy" in found
    assert any(set(f.split(" -> ")) == {"cascadia.policy", "cascadia.sim.model"} for f in found)


CHECKPOINT_NAME = re.compile(r"^(self_attn|mlp|attn_sconv|mlp_sconv|input_layernorm|post_attention_layernorm)\."
                             r"|^lm_head\.|^model\.(layers|embed_tokens|norm|mtp|language_model|vision_tower|audio_tower)\b"
                             r"|conv1d\.weight|norm\.weight|global_scale|e_score_correction_bias")


def string_literals(path: Path) -> list[str]:
    """A module's string constants, its docstrings left out (they may name the reference's modules)."""
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return [node.value for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings]


def test_checkpoint_names_are_spelled_only_in_the_families():
    """The checkpoint's tensor names live in `cascadia/models/` (a family's module, or `names.py` for those every
    family shares); every other module takes them from there."""
    spelled = {str(path.relative_to(PACKAGE)): found for name, path in module_names().items()
               if not within(name, "cascadia.models")
               and (found := [s for s in string_literals(path) if CHECKPOINT_NAME.search(s)])}
    assert spelled == {}
    for family in ("names.py", "inkling.py"):  # it finds them
        assert sum(map(bool, map(CHECKPOINT_NAME.search, string_literals(PACKAGE / "models" / family)))) >= 3
