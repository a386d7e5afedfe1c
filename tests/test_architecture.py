"""The architecture rules, checked on the source text (ast only: nothing here imports torch or the package,
except the tests that run turns: `test_no_feature_package_runs_on_the_default_path` and the turn's cost).

- no import cycles among stateful_hf's modules, counting imports behind `TYPE_CHECKING` and inside functions;
- module names unique within their package (no module shares its name with a sibling subpackage) and unique
  class names across the package;
- `stateful_hf/cache/` and `stateful_hf/kernels/` never import transformers;
- the store's core imports its feature packages (disk/, hidden/, layerwise/, virtual/) for annotations only:
  `store_parts.py` alone builds their parts, and with the default options none of their functions runs;
- one returning turn through `Engine` makes at most 5 calls into the store's public methods besides one
  plan/commit per step (no cap on lines or files: a module is as long as its one concept needs);
- no module uses another module's private members (`obj._x`, `from m import _x`);
- docs/architecture.md names every module of the package by path, and every path it names exists; its module
  tables give each module one row;
- imports go one way (options <- kernels <- cache <- the seam <- engine <- serve), every module has a docstring,
  and every `*.py` a docstring, comment or doc names exists.

The package is one source tree, `stateful_hf/`, whose folders are its subpackages (cache/, kernels/, engine/,
serve/): a module's path is its import path.
"""

from __future__ import annotations

import ast
import os
import re
import sys
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "stateful_hf"
# Also held to the private-member rule: the code beside the package that uses it.
CLIENT_DIRS = ("demo", "benchmarks", "examples")
ARCHITECTURE_DOC = ROOT / "docs" / "architecture.md"


@dataclass(frozen=True, slots=True)
class Module:
    name: str  # dotted, e.g. "stateful_hf.cache.kv_store"; a package's __init__ is the package's name
    path: Path
    is_package: bool

    @property
    def rel(self) -> str:
        return self.path.relative_to(ROOT).as_posix()


@cache
def package_modules() -> dict[str, Module]:
    """Every module of the installed package by dotted name."""
    modules: dict[str, Module] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        name = ".".join(parts)
        modules[name] = Module(name, path, is_package)
    return modules


@cache
def parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _resolve_relative(module: Module, level: int, target: str | None) -> str:
    package = module.name if module.is_package else module.name.rpartition(".")[0]
    for _ in range(level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{target}" if target else package


@dataclass(frozen=True, slots=True)
class Import:
    target: str  # the dotted module imported
    line: int


def imports_of(module: Module) -> list[Import]:
    """Every import statement anywhere in the module (top level, functions, `if TYPE_CHECKING:`),
    resolved to dotted module names. `from pkg import name` is an import of `pkg.name` when that is a
    module, else of `pkg`."""
    known = package_modules()
    found: list[Import] = []
    for node in ast.walk(parse(module.path)):
        if isinstance(node, ast.Import):
            found.extend(Import(alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve_relative(module, node.level, node.module) if node.level else node.module
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.append(Import(sub if sub in known else base, node.lineno))
    return found


def import_graph() -> dict[str, dict[str, int]]:
    """module -> {imported package module: line of the first such import}."""
    known = package_modules()
    graph: dict[str, dict[str, int]] = {}
    for name, module in known.items():
        edges: dict[str, int] = {}
        for imp in imports_of(module):
            target = imp.target
            # `import stateful_hf.cache.kv_store.X` style names: the longest known prefix.
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                edges.setdefault(target, imp.line)
        graph[name] = edges
    return graph


def strongly_connected(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Tarjan's components with more than one module (a module importing itself is skipped above)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return components


def shortest_cycle(graph: dict[str, dict[str, int]], component: list[str]) -> list[str]:
    """A shortest cycle through the component's first module (breadth-first inside the component)."""
    members = set(component)
    start = component[0]
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w not in members:
                    continue
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if w not in parent:
                    parent[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle in component {component}")


def describe_cycle(graph: dict[str, dict[str, int]], cycle: list[str]) -> str:
    modules = package_modules()
    hops = [f"{modules[a].rel}:{graph[a][b]} imports {b}" for a, b in zip(cycle, cycle[1:])]
    return " -> ".join(cycle) + "\n      " + "\n      ".join(hops)


def test_no_import_cycles():
    graph = import_graph()
    components = strongly_connected(graph)
    modules = package_modules()
    report = [
        f"{len(c)} modules {c}\n    one cycle: {describe_cycle(graph, shortest_cycle(graph, c))}"
        + "\n    every import inside: "
        + ", ".join(f"{modules[a].rel}:{graph[a][b]} -> {b}" for a in c for b in sorted(graph[a]) if b in c)
        for c in components
    ]
    assert not components, "import cycles (TYPE_CHECKING and function-local imports count):\n  " + "\n  ".join(report)


# Layers, lowest first: a module may import its own layer and those below, never one above.
LAYERS = (
    ("options", ("stateful_hf.options",)),  # the option list: plain data, imports nothing of the package
    ("kernels", ("stateful_hf.kernels",)),
    ("cache", ("stateful_hf.cache",)),
    ("seam", ()),  # integration/ (the transformers seam), profile/ and the root's other modules
    ("engine", ("stateful_hf.engine",)),
    ("serve", ("stateful_hf.serve",)),
    ("facade", ()),  # stateful_hf/__init__.py re-exports from every layer
)


def layer_of(name: str) -> int:
    if name == "stateful_hf":
        return len(LAYERS) - 1
    for i, (_, prefixes) in enumerate(LAYERS):
        if any(name == p or name.startswith(p + ".") for p in prefixes):
            return i
    return [name for name, _ in LAYERS].index("seam")


def test_imports_go_one_way():
    """options <- kernels <- cache <- the transformers seam <- engine <- serve (<- the package's __init__)."""
    modules, graph = package_modules(), import_graph()
    upward = [
        f"{modules[a].rel}:{line} ({LAYERS[layer_of(a)][0]}) imports {b} ({LAYERS[layer_of(b)][0]})"
        for a, edges in sorted(graph.items())
        for b, line in sorted(edges.items())
        if layer_of(b) > layer_of(a)
    ]
    assert not upward, "imports against the layering:\n  " + "\n  ".join(upward)


def test_layers_are_ordered():
    names = ["stateful_hf.options.store", "stateful_hf.kernels.plan", "stateful_hf.cache", "stateful_hf.integration",
             "stateful_hf.engine.engine", "stateful_hf.serve.app", "stateful_hf"]
    assert [layer_of(n) for n in names] == list(range(len(LAYERS)))


def test_cycle_finder_finds_a_cycle():
    graph = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3, "d": 4}, "d": {}}
    assert strongly_connected(graph) == [["a", "b", "c"]]
    assert shortest_cycle(graph, ["a", "b", "c"]) == ["a", "b", "c", "a"]


def test_unique_module_basenames():
    """Unique within a package: a module's name is its noun inside its package (`cache/disk/index.py` and
    `cache/prefix/index.py` are two), but no two names of one package's modules and subpackages are equal,
    ignoring case (`cache/disk.py` beside `cache/disk/` would shadow one of them)."""
    by_name: dict[tuple[str, str], list[str]] = {}
    for module in package_modules().values():
        path = module.path.parent if module.is_package else module.path
        if module.name == "stateful_hf" or path.stem == "__main__":
            continue
        by_name.setdefault((path.parent.as_posix(), path.stem.lower()), []).append(module.rel)
    repeated = {name: paths for (_, name), paths in by_name.items() if len(paths) > 1}
    assert not repeated, f"names used more than once within a package: {repeated}"


def test_unique_class_names():
    by_name: dict[str, list[str]] = {}
    for module in package_modules().values():
        for node in ast.walk(parse(module.path)):
            if isinstance(node, ast.ClassDef):
                by_name.setdefault(node.name, []).append(f"{module.rel}:{node.lineno}")
    repeated = {name: where for name, where in by_name.items() if len(where) > 1}
    assert not repeated, f"class names defined more than once: {repeated}"


def test_every_module_says_what_it_holds():
    """A module docstring on every module of the package (`__main__` aside): the first thing a reader sees."""
    modules = [m for m in package_modules().values() if m.path.stem != "__main__"]
    bare = [m.rel for m in modules if not ast.get_docstring(parse(m.path))]
    assert not bare, f"modules without a docstring: {bare}"


def test_cache_and_kernels_never_import_transformers():
    offenders = [
        f"{module.rel}:{imp.line} imports {imp.target}"
        for module in package_modules().values()
        if module.name.startswith(("stateful_hf.cache", "stateful_hf.kernels"))
        for imp in imports_of(module)
        if imp.target == "transformers" or imp.target.startswith("transformers.")
    ]
    assert not offenders, "cache and kernels must not import transformers:\n  " + "\n  ".join(offenders)


# ---- the engine's door into the store ------------------------------------------------------------------------

ENGINE_DOOR = "stateful_hf.cache.doors.engine"
STORE_MAKER = "stateful_hf.engine.engine"      # the facade builds a SessionStore when the caller gives none


def door_breaches(graph: dict[str, dict[str, int]]) -> list[str]:
    """`module:line target` for each import by a module of stateful_hf/engine/ of the store other than through
    its door: any module of stateful_hf.cache but `ENGINE_DOOR`, or the seam's SessionStore outside the facade."""
    def inside(name: str, package: str) -> bool:
        return name == package or name.startswith(package + ".")

    return sorted(f"{a}:{line} {b}" for a, edges in graph.items() if inside(a, "stateful_hf.engine")
                  for b, line in edges.items()
                  if (inside(b, "stateful_hf.cache") and b != ENGINE_DOOR)
                  or (b == "stateful_hf.integration.session_store" and a != STORE_MAKER))


def test_the_engine_reaches_the_store_only_through_its_door():
    """The engine (scheduler, admission, runner, layer offload, warm-ups, hints) imports `EngineStore` and the
    values that cross it from `stateful_hf/cache/doors/engine.py`, nothing else of the store: mypy (CI) checks
    its code against the protocol, and `Engine` checks that the SessionStore it runs keeps it."""
    graph = import_graph()
    assert any(b == ENGINE_DOOR for a in graph if a.startswith("stateful_hf.engine") for b in graph[a])
    breaches = door_breaches(graph)
    assert not breaches, "the engine imports the store past its door:\n  " + "\n  ".join(breaches)


def test_the_door_check_sees_a_breach():
    """The negative control: an engine module importing a store part, or SessionStore, is reported."""
    graph = {"stateful_hf.engine.scheduler": {"stateful_hf.cache.kv_store": 3, ENGINE_DOOR: 4},
             "stateful_hf.engine.runner": {"stateful_hf.integration.session_store": 7},
             STORE_MAKER: {"stateful_hf.integration.session_store": 9}}
    assert door_breaches(graph) == ["stateful_hf.engine.runner:7 stateful_hf.integration.session_store",
                                    "stateful_hf.engine.scheduler:3 stateful_hf.cache.kv_store"]


# ---- the other consumers' doors ------------------------------------------------------------------------------

CONSUMER_DOORS = {      # a module that consumes the store -> its door, the one module of the store it may import
    "stateful_hf.integration.stateful_cache": "stateful_hf.cache.doors.seam",
    "stateful_hf.serve.replica": "stateful_hf.cache.doors.server",
    "stateful_hf.serve.metrics": "stateful_hf.cache.doors.server",
    "stateful_hf.serve.migrate": "stateful_hf.cache.doors.migration",
    "demo.backend": "stateful_hf.cache.doors.demo",
}


def consumer_graph() -> dict[str, dict[str, int]]:
    """The import graph of the package, with the demo's backend (outside the package) added."""
    graph = dict(import_graph())
    known = package_modules()
    edges: dict[str, int] = {}
    for imp in imports_of(Module("demo.backend", ROOT / "demo" / "backend.py", False)):
        target = imp.target
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target:
            edges.setdefault(target, imp.line)
    graph["demo.backend"] = edges
    return graph


def consumer_breaches(graph: dict[str, dict[str, int]]) -> list[str]:
    """`module:line target` for each import by a consumer of `CONSUMER_DOORS` of the store other than its door:
    any other module of stateful_hf.cache (its package `__init__` too), or the seam's SessionStore."""
    return sorted(f"{a}:{line} {b}" for a, door in CONSUMER_DOORS.items() for b, line in graph.get(a, {}).items()
                  if b != door and (b == "stateful_hf.cache" or b.startswith("stateful_hf.cache.")
                                    or b == "stateful_hf.integration.session_store"))


def test_the_other_consumers_reach_the_store_only_through_their_doors():
    """The seam's `StatefulCache`, the server's replica and metrics, migration and the demo each import their
    door (`stateful_hf/cache/doors/`) and nothing else of the store; mypy checks that `SessionStore` keeps
    each door where the consumer takes it (`Replica`, `ChatBackend`, `SessionStore.cache`)."""
    graph = consumer_graph()
    missing = [a for a, door in CONSUMER_DOORS.items() if door not in graph.get(a, {})]
    assert not missing, f"consumers that do not import their door: {missing}"
    breaches = consumer_breaches(graph)
    assert not breaches, "a consumer imports the store past its door:\n  " + "\n  ".join(breaches)


def test_the_consumer_door_check_sees_a_breach():
    """The negative control: a consumer importing the store's package, a part, another door or SessionStore."""
    graph = {"stateful_hf.serve.replica": {"stateful_hf.cache": 3, "stateful_hf.cache.doors.server": 4},
             "stateful_hf.serve.migrate": {"stateful_hf.cache.doors.server": 5},
             "demo.backend": {"stateful_hf.cache.doors.demo": 1, "stateful_hf.integration.session_store": 9}}
    assert consumer_breaches(graph) == ["demo.backend:9 stateful_hf.integration.session_store",
                                        "stateful_hf.serve.migrate:5 stateful_hf.cache.doors.server",
                                        "stateful_hf.serve.replica:3 stateful_hf.cache"]


# ---- one owner for request state ----------------------------------------------------------------------------

REQUEST_MODULE = "stateful_hf/engine/request.py"
_MUTATORS = {"append", "extend", "insert", "pop", "remove", "clear"}    # a Request's list fields


def request_fields() -> set[str]:
    """The fields of `Request` (a dataclass in request.py), read from its source."""
    tree = parse(ROOT / REQUEST_MODULE)
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "Request")
    return {st.target.id for st in cls.body if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name)}


def request_writes(tree: ast.Module, rel: str, fields: set[str]) -> list[str]:
    """`rel:line target` for each assignment to, or mutating call on, a field of `Request` through another
    object than `self` (the engine's and server's objects other than a request use other field names)."""
    found = []
    for node in ast.walk(tree):
        targets: list[ast.AST] = []
        if isinstance(node, ast.Assign):
            targets = [e for t in node.targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _MUTATORS:
            targets = [node.func.value]
        found += [f"{rel}:{node.lineno} {ast.unparse(t)}" for t in targets
                  if isinstance(t, ast.Attribute) and t.attr in fields and not _is_self(t.value)]
    return found


def test_a_request_changes_only_through_its_own_methods():
    """The scheduler, admission, layer offload, the stepper, the runner and the server change a `Request`
    through its methods (`advance`, `emit`, `suspend`, `finish`, ...), never by assigning its fields."""
    fields = request_fields()
    assert {"status", "needs", "pending", "output_ids", "leased"} <= fields, fields
    modules = [m for m in package_modules().values()
               if m.name.startswith(("stateful_hf.engine", "stateful_hf.serve")) and m.rel != REQUEST_MODULE]
    found = [w for m in modules for w in request_writes(parse(m.path), m.rel, fields)]
    assert not found, "a Request's fields written outside request.py:\n  " + "\n  ".join(found)


def test_the_request_write_check_sees_writes():
    """The negative control: the check reports an assignment, a tuple assignment and a mutating call."""
    tree = ast.parse("def f(r, items):\n    r.status = 1\n    r.needs, r.pending = None, []\n"
                     "    items[0].request.output_ids.append(3)\n    self.status = 2\n")
    assert request_writes(tree, "x.py", {"status", "needs", "pending", "output_ids"}) == [
        "x.py:2 r.status", "x.py:3 r.needs", "x.py:3 r.pending", "x.py:4 items[0].request.output_ids"]


# Admission and layer offload decide and return verdicts (the store's answers in them); the scheduler applies them.
VERDICT_MODULES = ("stateful_hf/engine/admission.py", "stateful_hf/engine/layer_offload.py")


def request_mutators() -> set[str]:
    """The methods of `Request` that write one of its fields through `self` (assign, or a list's mutating call)."""
    tree = parse(ROOT / REQUEST_MODULE)
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "Request")
    fields, out = request_fields(), set()
    for fn in cls.body:
        if not isinstance(fn, ast.FunctionDef):
            continue
        for node in ast.walk(fn):
            targets: list[ast.AST] = []
            if isinstance(node, ast.Assign):
                targets = [e for t in node.targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]
            elif isinstance(node, ast.AugAssign):
                targets = [node.target]
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _MUTATORS:
                targets = [node.func.value]
            if any(isinstance(t, ast.Attribute) and t.attr in fields and _is_self(t.value) for t in targets):
                out.add(fn.name)
    return out


def mutator_calls(tree: ast.Module, rel: str, mutators: set[str]) -> list[str]:
    """`rel:line call` for each call of one of `mutators` on another object than `self`."""
    return [f"{rel}:{n.lineno} {ast.unparse(n.func)}" for n in ast.walk(tree)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in mutators
            and not _is_self(n.func.value)]


def test_admission_and_layer_offload_change_no_request():
    """They return verdicts (`Verdict`, `LayerFit`, `PushDown`) with the store's answers; the scheduler, the one
    writer, applies them through the request's methods."""
    mutators = request_mutators()
    assert {"asked", "prepare", "admit", "start", "set_factor", "pushed", "suspend", "finish"} <= mutators, mutators
    assert not {"rows", "prefill_rows", "metrics", "length"} & mutators, mutators   # readers are not mutators
    found = [c for rel in VERDICT_MODULES for c in mutator_calls(parse(ROOT / rel), rel, mutators)]
    assert not found, "admission or layer offload changes a request:\n  " + "\n  ".join(found)


def test_the_mutator_call_check_sees_calls():
    """The negative control: calls on a request, on an item's request; not on `self` nor of other names."""
    tree = ast.parse("def f(self, r, item):\n    r.asked(None, None)\n    item.request.set_factor(0)\n"
                     "    self.finish()\n    r.prefill_rows()\n")
    assert mutator_calls(tree, "x.py", request_mutators()) == ["x.py:2 r.asked", "x.py:3 item.request.set_factor"]


# The engine's LayerKV scheduling plugs in as one part (`LayerScheduling`: `AllLayers` or `LayerwiseScheduling`, chosen
# where the engine is made); the scheduler's loop and admission call it without knowing which.
LAYER_CLIENTS = ("stateful_hf/engine/scheduler.py", "stateful_hf/engine/admission.py")
LAYERKV_NAMES = {"LayerwiseScheduling", "LayerwisePolicy", "layerwise", "layered"}


def layerkv_branches(tree: ast.Module, rel: str) -> list[str]:
    """`rel:line what` for each use of LayerKV's own classes or names, and each `is None` test of the part."""
    found = []
    for n in ast.walk(tree):
        name = n.id if isinstance(n, ast.Name) else n.attr if isinstance(n, ast.Attribute) else \
            n.arg if isinstance(n, ast.arg) else None
        if name in LAYERKV_NAMES:
            found.append(f"{rel}:{n.lineno} {name}")
        elif isinstance(n, ast.ImportFrom):
            found += [f"{rel}:{n.lineno} imports {a.name}" for a in n.names if a.name in LAYERKV_NAMES]
        elif isinstance(n, ast.Compare) and any(isinstance(op, (ast.Is, ast.IsNot)) for op in n.ops) \
                and "layers" in ast.unparse(n.left):
            found.append(f"{rel}:{n.lineno} {ast.unparse(n)}")
    return found


def test_the_scheduler_takes_layerkv_decisions_through_one_part():
    found = [f for rel in LAYER_CLIENTS for f in layerkv_branches(parse(ROOT / rel), rel)]
    assert not found, "the scheduler or admission branches on LayerKV:\n  " + "\n  ".join(found)


def test_the_layerkv_branch_check_sees_branches():
    """The negative control: the scheduler's loop as it was (a None check of the part, the policy named)."""
    tree = ast.parse("from .layer_offload import LayerwiseScheduling\n"
                     "def f(self, layerwise):\n    if self.layers is not None:\n        pass\n"
                     "    x = self.layered.committed([])\n")
    assert layerkv_branches(tree, "x.py") == ["x.py:1 imports LayerwiseScheduling", "x.py:2 layerwise",
                                              "x.py:3 self.layers is not None", "x.py:5 layered"]


# ---- the store's feature packages ---------------------------------------------------------------------------

# Optional features of the store, each a package of stateful_hf/cache/ that runs only when its option is on.
# cache/prefix/ is not one: prefix sharing is on by default, part of the core.
FEATURE_PACKAGES = ("stateful_hf.cache.disk", "stateful_hf.cache.hidden", "stateful_hf.cache.layerwise",
                    "stateful_hf.cache.virtual")
# The one core module that builds the features' parts (a feature that is off has none).
FEATURE_ASSEMBLER = "stateful_hf.cache.store_parts"


def _in_feature(name: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in FEATURE_PACKAGES)


def _type_checking_lines(tree: ast.Module) -> set[int]:
    """Lines of the import statements inside an `if TYPE_CHECKING:` block."""
    imports = (ast.Import, ast.ImportFrom)
    return {n.lineno for node in ast.walk(tree)
            if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
            for stmt in node.body for n in ast.walk(stmt) if isinstance(n, imports)}


def test_core_imports_features_for_annotations_only():
    """The store's core (stateful_hf/cache/ outside the feature packages) imports a feature package only
    behind `TYPE_CHECKING`, except `store_parts.py`, which builds the parts: at run time features depend on
    the core, never the reverse, and a feature that is off has no code path in."""
    core = [m for m in package_modules().values() if m.name.startswith("stateful_hf.cache")
            and not _in_feature(m.name) and m.name != FEATURE_ASSEMBLER]
    offenders = sorted({f"{m.rel}:{imp.line} imports {imp.target}" for m in core for imp in imports_of(m)
                        if _in_feature(imp.target) and imp.line not in _type_checking_lines(parse(m.path))})
    assert not offenders, "the core imports feature packages at run time:\n  " + "\n  ".join(offenders)


def feature_functions_run(run: Callable[[], None]) -> list[str]:
    """`path:line name` of each function of a feature package that runs during `run()`, on any thread
    (a module's own code, run once when it is imported, is not counted)."""
    roots = tuple(str(ROOT.joinpath(*p.split("."))) + os.sep for p in FEATURE_PACKAGES)
    seen: set[str] = set()

    def probe(frame, event, arg):
        code = frame.f_code
        if event == "call" and code.co_name != "<module>" and code.co_filename.startswith(roots):
            seen.add(f"{Path(code.co_filename).relative_to(ROOT).as_posix()}:{code.co_firstlineno} {code.co_name}")

    before = sys.getprofile(), threading.getprofile()
    threading.setprofile(probe)
    sys.setprofile(probe)
    try:
        run()
    finally:
        sys.setprofile(before[0])
        threading.setprofile(before[1])
    return sorted(seen)


def two_turns(path: str, **options) -> Callable[[], None]:
    """A store (and engine) with `options` made, then a warm-up turn and a returning turn of one session
    on the tiny Llama, through `Engine` or `model.generate(past_key_values=store.cache(sid))`."""
    import torch

    from stateful_hf import Engine, SamplingParams, SessionStore  # imported here, not in the probed run
    from stateful_hf.testing import tiny_llama

    model = tiny_llama()
    first, message = list(range(5, 45)), list(range(50, 60))

    def run() -> None:
        store = SessionStore(model, **options) if options else None
        if path == "engine":
            engine = Engine(model, store=store)
            sampling = SamplingParams(max_new_tokens=6)
            out = engine.submit("s", first, sampling).result()
            engine.submit("s", first + list(out.token_ids) + message, sampling).result()
            engine.stop()
            store = engine.store
        else:
            store = store or SessionStore(model)
            ids = torch.tensor([first])
            for _ in range(2):
                ids = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=store.cache("s"),
                                     max_new_tokens=6, do_sample=False, pad_token_id=0)
                ids = torch.cat([ids, torch.tensor([message])], dim=1)
        store.check_integrity()
        store.close()

    return run


def test_no_feature_package_runs_on_the_default_path():
    """With the default options no function of disk/, hidden/, layerwise/ or virtual/ runs while a store
    (and engine) is made and a session takes a warm-up turn and a returning turn, either way."""
    for path in ("engine", "generate"):
        ran = feature_functions_run(two_turns(path))
        assert not ran, f"{path}: feature package code on the default path:\n  " + "\n  ".join(ran)


def test_the_feature_probe_sees_features_that_are_on(tmp_path):
    """The negative control: with a feature's option on, the same probe sees its package run."""
    hidden = feature_functions_run(two_turns("generate", host_capacity=1024, hidden_states="always", hidden_layers=1))
    assert any(f.startswith("stateful_hf/cache/hidden/") for f in hidden), hidden
    disk = feature_functions_run(two_turns("engine", disk_dir=tmp_path / "disk", disk_capacity=1024))
    assert any(f.startswith("stateful_hf/cache/disk/") for f in disk), disk


def test_a_default_store_registers_no_feature(tmp_path):
    """The registry the core loops over (`StoreParts.features`) is empty for a default store, and each
    feature's option registers its part (the control), so the probe above has something to miss."""
    from stateful_hf import SessionStore  # imported here: the other tests of this file need no torch
    from stateful_hf.testing import tiny_llama

    def registered(**options) -> list[str]:
        store = SessionStore(tiny_llama(), **options)
        try:
            return [type(f).__name__ for f in store.parts.features]
        finally:
            store.close()

    assert registered() == []
    assert registered(host_capacity=1024, hidden_states="always", hidden_layers=1) == ["HiddenSteps"]
    assert registered(host_capacity=1024, layerwise_kv=True) == ["LayeredChunks"]
    assert registered(disk_dir=tmp_path / "disk", disk_capacity=1024) == ["DiskWriter"]


MAX_STORE_CALLS = 5          # per admitted turn, besides plan_step/commit/abort once per step
PER_STEP = frozenset({"plan_step", "commit", "abort"})
STORE_FILES = ("stateful_hf/cache/", "stateful_hf/integration/session_store.py")


def returning_turn_trace() -> tuple[set[str], Counter]:
    """(package files with a function that runs, {store method: calls from outside the store}) during
    one returning turn of one session through `Engine` on the tiny Llama, after a warm-up turn; every
    thread is traced (the engine steps on whichever thread waits, or its loop thread)."""
    from stateful_hf import Engine, SamplingParams  # imported here, not in the probed run
    from stateful_hf.cache import KVStore
    from stateful_hf.testing import tiny_llama

    public = {n for n in dir(KVStore) if not n.startswith("_")}
    engine = Engine(tiny_llama())
    first, message, sampling = list(range(5, 45)), list(range(50, 60)), SamplingParams(max_new_tokens=6)
    out = engine.submit("s", first, sampling).result()
    files: set[str] = set()
    calls: Counter = Counter()
    root = str(PACKAGE) + os.sep

    def probe(frame, event, arg):
        if event != "call" or not frame.f_code.co_filename.startswith(root):
            return
        rel = Path(frame.f_code.co_filename).relative_to(ROOT).as_posix()
        files.add(rel)
        if rel.startswith(STORE_FILES) and frame.f_code.co_name in public and frame.f_back is not None:
            caller = Path(frame.f_back.f_code.co_filename)
            inside = caller.is_relative_to(ROOT) and caller.relative_to(ROOT).as_posix().startswith(STORE_FILES)
            if not inside:
                calls[frame.f_code.co_name] += 1

    before = sys.getprofile(), threading.getprofile()
    threading.setprofile(probe)
    sys.setprofile(probe)
    try:
        engine.submit("s", first + list(out.token_ids) + message, sampling).result()
    finally:
        sys.setprofile(before[0])
        threading.setprofile(before[1])
    engine.store.check_integrity()
    engine.stop()
    return files, calls


def test_a_returning_turn_makes_few_store_calls():
    files, calls = returning_turn_trace()
    assert calls["plan_step"] >= 1 and calls["commit"] == calls["plan_step"], calls   # the probe sees the steps
    assert any(f.startswith("stateful_hf/engine/") for f in files), files           # and the engine's files
    per_turn = {name: n for name, n in calls.items() if name not in PER_STEP}
    assert sum(per_turn.values()) <= MAX_STORE_CALLS, f"store calls per admitted turn: {per_turn}"


# ---- private members ----------------------------------------------------------------------------------------

# Underscore names that are public API of the library that defines them.
PUBLIC_UNDERSCORE_API = {
    "_replace": "namedtuple public API",
    "_asdict": "namedtuple public API",
    "_fields": "namedtuple public API",
    "_make": "namedtuple public API",
}

# Private members of third-party libraries used on purpose: (file, attribute) -> why there is no public way.
THIRD_PARTY_PRIVATE: dict[tuple[str, str], str] = {
    ("stateful_hf/integration/checks.py", "_prepare_generation_config"): (
        "transformers has no public way to get the GenerationConfig that generate(**kwargs) will use (the merge "
        "of model defaults, the given generation_config and kwargs); the pad-token check needs exactly that one, "
        "and the code falls back to a public merge when the method is missing"
    ),
    ("stateful_hf/kernels/linear.py", "_mkl_reorder_linear_weight"): (
        "torch's packed-weight GEMM ops (MKL's packed sgemm, oneDNN's packed matmul) have no public name; they are "
        "the ops inductor's own weight prepacking emits, and the engine falls back to F.linear (prepack_weights=off)"
    ),
    ("stateful_hf/kernels/linear.py", "_mkl_linear"): (
        "torch's packed-weight GEMM ops (MKL's packed sgemm, oneDNN's packed matmul) have no public name; they are "
        "the ops inductor's own weight prepacking emits, and the engine falls back to F.linear (prepack_weights=off)"
    ),
    ("stateful_hf/kernels/linear.py", "_reorder_linear_weight"): (
        "torch's packed-weight GEMM ops (MKL's packed sgemm, oneDNN's packed matmul) have no public name; they are "
        "the ops inductor's own weight prepacking emits, and the engine falls back to F.linear (prepack_weights=off)"
    ),
    ("stateful_hf/kernels/linear.py", "_linear_pointwise"): (
        "torch's packed-weight GEMM ops (MKL's packed sgemm, oneDNN's packed matmul) have no public name; they are "
        "the ops inductor's own weight prepacking emits, and the engine falls back to F.linear (prepack_weights=off)"
    ),
    ("stateful_hf/integration/compiled_step.py", "_dynamo"): (
        "torch has no public way to mark a dimension unbacked (torch.compiler has no mark_unbacked in 2.13); the "
        "compiled step's one graph needs its token count unbacked, as vLLM marks its compiled models' inputs"
    ),
    ("stateful_hf/kernels/invariance.py", "_base"): (
        "a view's base has no public accessor; the invariant GEMM packs only a model parameter's weight.t(), "
        "which it recognises by its base"
    ),
    ("stateful_hf/kernels/invariance.py", "_destroy"): (
        "torch.library.Library has no public way to drop the kernels it registered; batch_invariant() must restore "
        "the stock kernels when the last context exits (torch's own scoped library uses the same call)"
    ),
    ("stateful_hf/serve/vllm_flags.py", "_option_string_actions"): (
        "argparse has no public accessor for a parser's option strings; the did-you-mean of an unknown flag needs "
        "them all (argparse's own abbreviation matching reads the same dict)"
    ),
    ("stateful_hf/kernels/linear.py", "_version"): (
        "a tensor's in-place version counter has no public accessor; a packed copy is made again when it changes"
    ),
}


def _is_private(name: str) -> bool:
    """`_x` and `__x`; not dunders (`__x__`) nor enum's sunders (`_value_`, `_missing_`: its public API)."""
    return name.startswith("_") and not name.endswith("_")


def _is_self(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def _is_call_to(node: ast.AST, *names: str) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in names


def _defined_private_names(tree: ast.Module) -> set[str]:
    """Underscore names this module defines: module-level names, functions, classes, class attributes and
    fields, `__slots__` entries, methods, and attributes assigned on `self`/`cls`."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _is_self(node.value):
            names.add(node.attr)
        elif isinstance(node, ast.alias):
            names.add((node.asname or node.name).split(".")[0])
        elif _is_call_to(node, "setattr") and len(node.args) >= 2 and _is_self(node.args[0]):
            if isinstance(node.args[1], ast.Constant):
                names.add(str(node.args[1].value))
        elif isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__slots__" for t in node.targets):
            names.update(str(e.value) for e in getattr(node.value, "elts", ()) if isinstance(e, ast.Constant))
    return names


# A static type as far as this check needs one: a class name, or a container of such (its values).
_CONTAINERS = {"dict", "Dict", "list", "List", "deque", "Deque", "set", "Set", "Mapping", "Sequence", "OrderedDict",
               "defaultdict", "Iterable", "Iterator", "tuple"}


@dataclass(frozen=True, slots=True)
class _Type:
    name: str
    of: _Type | None = None  # the element (value) type of a container


class _PrivateUseFinder(ast.NodeVisitor):
    """Finds `x._name` where `_name` is another module's: either this module does not define `_name`, or
    `x`'s static type is known (a parameter or attribute annotation, a constructor call) to be a class this
    module imports rather than defines. `self._name`/`cls._name` count too when the class is this
    package's own (no base classes, or only bases of this package) and this module does not define
    `_name`: a mixin reaching into its host, or a class into its in-package base. `super()._name` and
    `self._name` in a class deriving from a third-party class are not checked."""

    def __init__(self, tree: ast.Module, rel: str):
        self.rel = rel
        self.own = _defined_private_names(tree)
        self.local_classes = {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
        self.imported = {
            (a.asname or a.name).split(".")[0]
            for n in ast.walk(tree)
            if isinstance(n, (ast.Import, ast.ImportFrom))
            for a in n.names
        }
        self.in_package = self.local_classes | {  # names bound by imports from this package
            a.asname or a.name
            for n in ast.walk(tree)
            if isinstance(n, ast.ImportFrom) and (n.level or (n.module or "").split(".")[0] == "stateful_hf")
            for a in n.names
        }
        self.own_self: list[bool] = [False]  # per enclosing class: are `self._x` uses checked
        self.found: list[tuple[int, str]] = []
        self.scopes: list[dict[str, _Type]] = [{}]  # names -> types, innermost last
        self.attrs: list[dict[str, _Type]] = [{}]  # `self.<attr>` -> type, per enclosing class

    # -- types
    def ann(self, node: ast.AST | None) -> _Type | None:
        if node is None:
            return None
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            try:
                return self.ann(ast.parse(node.value, mode="eval").body)
            except SyntaxError:
                return None
        if isinstance(node, ast.Name):
            return _Type(node.id)
        if isinstance(node, ast.Attribute):
            return _Type(node.attr)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
            for side in (node.left, node.right):
                if not (isinstance(side, ast.Constant) and side.value is None):
                    return self.ann(side)
        if isinstance(node, ast.Subscript):
            outer = self.ann(node.value)
            args = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
            if outer is not None and outer.name == "Optional":
                return self.ann(args[0])
            if outer is not None and outer.name in _CONTAINERS:
                return _Type(outer.name, self.ann(args[-1]))
        return None

    def type_of(self, node: ast.AST) -> _Type | None:
        if isinstance(node, ast.Name):
            for scope in reversed(self.scopes):
                if node.id in scope:
                    return scope[node.id]
            return None
        if isinstance(node, ast.Attribute) and _is_self(node.value):
            return self.attrs[-1].get(node.attr)
        if isinstance(node, ast.Subscript):
            outer = self.type_of(node.value)
            return outer.of if outer is not None else None
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Name) and f.id[:1].isupper():
                return _Type(f.id)
            if isinstance(f, ast.Attribute) and f.attr in ("get", "pop", "popleft", "setdefault"):
                outer = self.type_of(f.value)
                return outer.of if outer is not None else None
        return None

    def foreign_class(self, t: _Type | None) -> bool:
        return t is not None and t.of is None and t.name in self.imported and t.name not in self.local_classes

    def foreign_name(self, name: str) -> bool:
        return name not in PUBLIC_UNDERSCORE_API and (self.rel, name) not in THIRD_PARTY_PRIVATE

    # -- scopes
    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        attrs: dict[str, _Type] = {}
        for stmt in node.body:  # dataclass fields / class-level annotations
            t = self.ann(stmt.annotation) if isinstance(stmt, ast.AnnAssign) else None
            if t is not None and isinstance(stmt.target, ast.Name):
                attrs[stmt.target.id] = t
        for fn in node.body:  # `self.x: T = ...`, `self.x = T(...)`, `self.x = typed_param`
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            params = {a.arg: t for a in self._args(fn) if (t := self.ann(a.annotation)) is not None}
            for stmt in ast.walk(fn):
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Attribute):
                    if _is_self(stmt.target.value) and (t := self.ann(stmt.annotation)) is not None:
                        attrs[stmt.target.attr] = t
                    continue
                if isinstance(stmt, ast.Assign):
                    for target, value in self._pairs(stmt):
                        if isinstance(target, ast.Attribute) and _is_self(target.value):
                            t = params.get(value.id) if isinstance(value, ast.Name) else None
                            t = t or (self.type_of(value) if isinstance(value, ast.Call) else None)
                            if t is not None:
                                attrs.setdefault(target.attr, t)
        self.attrs.append(attrs)
        self.own_self.append(all(isinstance(b, ast.Name) and b.id in self.in_package for b in node.bases))
        self.generic_visit(node)
        self.own_self.pop()
        self.attrs.pop()

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        scope = {a.arg: t for a in self._args(node) if (t := self.ann(a.annotation)) is not None}
        self.scopes.append(scope)
        for stmt in ast.walk(node):
            t = self.ann(stmt.annotation) if isinstance(stmt, ast.AnnAssign) else None
            if t is not None and isinstance(stmt.target, ast.Name):
                scope[stmt.target.id] = t
        for stmt in node.body:
            self.visit(stmt)
        self.scopes.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Assign(self, node: ast.Assign) -> None:
        for target, value in self._pairs(node):
            if isinstance(target, ast.Name) and (t := self.type_of(value)) is not None:
                self.scopes[-1][target.id] = t
        self.generic_visit(node)

    @staticmethod
    def _args(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[ast.arg]:
        return [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs]

    @staticmethod
    def _pairs(node: ast.Assign) -> list[tuple[ast.AST, ast.AST]]:
        pairs = []
        for target in node.targets:
            if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                pairs.extend(zip(target.elts, node.value.elts))
            else:
                pairs.append((target, node.value))
        return pairs

    # -- uses
    def check(self, node: ast.AST, base: ast.AST, name: str) -> None:
        """Record `node` if it reaches `base.<name>` and that is another module's private member."""
        if not _is_private(name) or not self.foreign_name(name) or _is_call_to(base, "super"):
            return
        if _is_self(base):
            if self.own_self[-1] and name not in self.own:
                self.found.append((node.lineno, ast.unparse(node)))
            return
        if name not in self.own or self.foreign_class(self.type_of(base)):
            self.found.append((node.lineno, ast.unparse(node)))

    def visit_Attribute(self, node: ast.Attribute) -> None:
        self.check(node, node.value, node.attr)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        if _is_call_to(node, "getattr", "hasattr") and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant):
            self.check(node, node.args[0], str(node.args[1].value))
        self.generic_visit(node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        for alias in node.names:
            if _is_private(alias.name):
                self.found.append((node.lineno, f"from {'.' * node.level}{node.module or ''} import {alias.name}"))


def private_uses(path: Path) -> list[str]:
    """`file:line expression` for each use in `path` of another module's private members (see
    `_PrivateUseFinder`). A name this module also defines, used on an object of unknown type, is taken as
    this module's own: the check knows names and annotations, not runtime types."""
    rel = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.name
    finder = _PrivateUseFinder(parse(path), rel)
    finder.visit(parse(path))
    return [f"{rel}:{line} {text}" for line, text in sorted(set(finder.found))]


def _checked_files() -> list[Path]:
    files = [m.path for m in package_modules().values()]
    for d in CLIENT_DIRS:
        files.extend(sorted((ROOT / d).rglob("*.py")))
    return files


def test_no_private_member_use_across_modules():
    found = [use for path in _checked_files() for use in private_uses(path)]
    assert not found, f"{len(found)} uses of another module's private members:\n  " + "\n  ".join(found)


def test_third_party_exceptions_are_still_used():
    for (rel, name), why in THIRD_PARTY_PRIVATE.items():
        assert why and name in (ROOT / rel).read_text(), f"stale exception {rel}: {name}"


def test_private_use_heuristic(tmp_path):
    src = tmp_path / "handle.py"
    src.write_text(
        "from stateful_hf.cache.kv_store import _helper\n"
        "from stateful_hf.engine.engine import Engine\n"
        "class Handle:\n"
        "    _ready: bool = False\n"
        "    def __init__(self, engine: 'Engine', peer: 'Handle | None'):\n"
        "        self._engine = engine\n"
        "        self._peers: dict[int, Handle] = {}\n"
        "        self.__mangled = 1\n"
        "    def wait(self, other: 'Handle', config):\n"
        "        self._engine._wait_until(1)\n"  # not defined here
        "        self._engine._ready\n"  # defined here, but self._engine is an Engine (imported)
        "        other._engine.__len__()\n"  # Handle is this module's; dunders are public
        "        self._peers[1]._ready, self._peers.get(2)._ready\n"  # a dict of this module's Handles
        "        config._name_or_path = ''\n"  # a write to a foreign object
        "        return getattr(self._engine, '_cv'), super()._x, self.__mangled, p._replace(a=1)\n"
        "class ChatMixin:\n"
        "    def chat(self):\n"
        "        return self._cv, self._engine\n"  # _cv: the host's (another module's); _engine is defined here
        "from transformers import Cache\n"
        "class Sub(Cache):\n"
        "    def f(self):\n"
        "        return self._inherited\n"  # a third-party base: not checked
    )
    uses = [u.split(" ", 1)[1] for u in private_uses(src)]
    assert uses == [
        "from stateful_hf.cache.kv_store import _helper",
        "self._engine._wait_until",
        "self._engine._ready",
        "config._name_or_path",
        "getattr(self._engine, '_cv')",
        "self._cv",
    ], uses


# ---- the architecture page ----------------------------------------------------------------------------------

_PATH = re.compile(r"(?<![\w./-])((?:stateful_hf|cache|kernels|demo|benchmarks|examples|tests)/[\w/]*\w\.py)\b")


def test_architecture_doc_names_every_module_and_only_real_ones():
    text = ARCHITECTURE_DOC.read_text()
    named = set(_PATH.findall(text))
    missing = sorted(named_path for named_path in named if not (ROOT / named_path).is_file())
    modules = sorted(m.rel for m in package_modules().values())
    unnamed = [rel for rel in modules if rel not in named]
    assert not missing, f"docs/architecture.md names paths that do not exist: {missing}"
    assert not unnamed, f"docs/architecture.md does not name these modules: {unnamed}"
    rows = Counter(re.findall(r"^\| `(stateful_hf/[\w/]*\.py)` \|", text, re.M))
    wrong = {rel: rows[rel] for rel in modules if rows[rel] != 1}
    assert not wrong, f"docs/architecture.md's module tables should give each module one row, not: {wrong}"


# A Python file name as prose names it: `kv_store.py`, `cache/kv_store.py`, `stateful_hf/engine/engine.py`.
_FILE_NAME = re.compile(r"(?<![\w./<>-])((?:[a-z_]+/)*[a-z][a-z0-9_]*\.py)\b")
# Files of other projects that comments may name.
EXTERNAL_FILES: set[str] = {"convert_hf_to_gguf.py",      # llama.cpp's converter (benchmarks/llama_server.py)
                             "vllm/entrypoints/openai/protocol.py"}   # vLLM's request shapes (serve/utility.py)


def test_file_names_in_docstrings_comments_and_docs_exist():
    """A module renamed or removed leaves no stale name behind: every `*.py` the package's source, the
    client code, docs/ or README.md names is a file of the repository (a bare name: some file of that
    name; a path: a file whose path ends with it)."""
    repo = [p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*.py") if not set(p.parts) & {".venv", ".git"}]
    basenames = {path.rpartition("/")[2] for path in repo}
    texts = [*_checked_files(), *sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
    stale = []
    for path in texts:
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            for name in _FILE_NAME.findall(line):
                known = any(r == name or r.endswith("/" + name) for r in repo) if "/" in name else name in basenames
                if not known and name not in EXTERNAL_FILES:
                    stale.append(f"{path.relative_to(ROOT).as_posix()}:{lineno} {name}")
    assert not stale, "names of files that do not exist:\n  " + "\n  ".join(stale)

