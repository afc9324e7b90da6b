"""The import graph, read from the source: what an agent imports holds no torch, and
every import runs in the direction of docs/design.md ("Map").

Read with `ast`, not by importing: a test that imports the modules proves only what one
interpreter loaded on one machine, while this one sees every import statement, those
inside functions too, and says which file and line breaks a rule.

Three kinds of edge:
- *loaded*: an import at module level (class bodies and `try` blocks included, `if
  TYPE_CHECKING:` blocks not): it runs when the module is imported;
- *deferred*: an import inside a function: it runs only if the function is called;
- *typing*: an import under `if TYPE_CHECKING:`: it never runs, but the module still
  names what it imports (in annotations), so it counts for the direction of the map.

The rules:
1. An agent (`planaria.elastic.agent`, which never computes) loads no module that imports
   torch, Triton or Planaria's kernels, deferred or not: the modules it loads contain no
   such import at all, so torch-freeness holds by construction and not by the discipline
   of delaying imports in modules that a worker also uses.
2. The contract (`planaria.runtime.contract`) imports nothing of Planaria's but itself
   and the plan contract (`planaria.templates`), and no third-party library but pydantic.
3. Packages import in one direction: templates and kernels import nothing of ours,
   runtime may import those two, elastic those three, chaos and the CLI everything.
4. Inside the runtime, every module lives in a room (`planaria.runtime.<room>`), and
   rooms import in one direction too (`ROOMS`): config at the bottom, then models and
   data, the parallel engine, the planning and the layer state on it, the worker on top.
5. No cycle among the modules' loaded imports.
"""
from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the test extra installs tomli, the same parser
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
TORCH = {"torch", "triton", "planaria.kernels"}
AGENTS = ("planaria.elastic.agent",)
CONTRACT = "planaria.runtime.contract"
CONTRACT_LIBRARIES = {"pydantic"}
# Which of our packages each package may import (docs/design.md, "Map"); a package may import itself.
ALLOWED = {
    "planaria.templates": set(),
    "planaria.kernels": set(),
    "planaria.runtime": {"planaria.templates", "planaria.kernels"},
    "planaria.train": {"planaria.templates", "planaria.kernels", "planaria.runtime"},
    "planaria.elastic": {"planaria.templates", "planaria.kernels", "planaria.runtime"},
    "planaria.chaos": {"planaria.templates", "planaria.kernels", "planaria.runtime", "planaria.elastic",
                       "planaria.train"},
    "planaria.cli": {"planaria.templates", "planaria.kernels", "planaria.runtime", "planaria.elastic",
                     "planaria.train", "planaria.chaos"},
}
RUNTIME = "planaria.runtime"
ROOMS = {
    "contract": set(),
    "config": set(),
    "models": {"config"},
    "data": {"config"},
    "parallel": {"models", "config"},
    "planning": {"parallel", "models", "config"},
    "state": {"parallel", "models", "config"},
    "worker": {"state", "planning", "parallel", "data", "models", "config"},
}
"""Which rooms of the runtime each room may import (docs/design.md, "Map"); a room may
import itself, and every room the contract (what crosses a process boundary)."""


@dataclass(frozen=True)
class Import:
    target: str
    """A module of ours (resolved to the module, not a name inside it), or a third-party
    library's top-level name."""
    line: int
    loaded: bool
    typing: bool = False
    """Under `if TYPE_CHECKING:`: never run (so never loaded), but a dependency all the same."""


def package_dirs() -> dict[str, Path]:
    """pyproject's package-dir: import prefix -> folder."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return {name: ROOT / folder for name, folder in setuptools["package-dir"].items()}


def modules() -> dict[str, Path]:
    """Every module of ours by its import name (a package by its __init__.py)."""
    dirs = package_dirs()
    claimed = set(dirs.values())
    found: dict[str, Path] = {}
    for prefix, folder in dirs.items():
        for path in folder.rglob("*.py"):
            # A folder mapped to a prefix of its own is that prefix's, not this one's.
            if max((f for f in claimed if f in path.parents), key=lambda f: len(f.parts)) != folder:
                continue
            parts = path.relative_to(folder).with_suffix("").parts
            name = ".".join((prefix, *parts[:-1]) if parts[-1] == "__init__" else (prefix, *parts))
            found[name] = path
    return found


class _Visitor(ast.NodeVisitor):
    def __init__(self, module: str, is_package: bool, known: set[str]):
        self.module, self.is_package, self.known = module, is_package, known
        self.imports: list[Import] = []
        self._depth = 0  # > 0 inside a function
        self._typing = False  # inside an `if TYPE_CHECKING:` block

    def visit_FunctionDef(self, node):
        self._depth += 1
        self.generic_visit(node)
        self._depth -= 1

    visit_AsyncFunctionDef = visit_FunctionDef
    visit_Lambda = visit_FunctionDef

    def visit_If(self, node):
        test = ast.unparse(node.test)
        if test in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            self._typing = True  # never runs: recorded as typing only
            for child in node.body:
                self.visit(child)
            self._typing = False
            for child in node.orelse:
                self.visit(child)
            return
        self.generic_visit(node)

    def visit_Import(self, node):
        for alias in node.names:
            self._add(alias.name, node.lineno)

    def visit_ImportFrom(self, node):
        base = self._absolute(node.module or "", node.level)
        for alias in node.names:
            candidate = f"{base}.{alias.name}"
            self._add(candidate if candidate in self.known else base, node.lineno)

    def _absolute(self, name: str, level: int) -> str:
        if level == 0:
            return name
        parts = self.module.split(".")
        base = parts if self.is_package else parts[:-1]
        base = base[: len(base) - (level - 1)]
        return ".".join(base + ([name] if name else []))

    def _add(self, target: str, line: int) -> None:
        if target == "__future__":
            return
        ours = target.startswith("planaria.")
        if ours:  # `import planaria.x.y.name` where name is not a module: the module holding it
            while target not in self.known and "." in target:
                target = target.rsplit(".", 1)[0]
        loaded = self._depth == 0 and not self._typing
        self.imports.append(Import(target if ours else target.split(".")[0], line, loaded, self._typing))


def imports_of(name: str, source: str, *, is_package: bool, known: set[str]) -> list[Import]:
    visitor = _Visitor(name, is_package, known)
    visitor.visit(ast.parse(source, name))
    return visitor.imports


def parse_graph() -> tuple[dict[str, list[Import]], dict[str, Path]]:
    found = modules()
    known = set(found)
    graph = {name: imports_of(name, path.read_text(), is_package=path.name == "__init__.py", known=known)
             for name, path in found.items()}
    return graph, found


GRAPH, PATHS = parse_graph()


def parents(module: str) -> list[str]:
    """The packages importing `module` loads first (planaria.a.b.c: planaria.a, planaria.a.b)."""
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(2, len(parts)) if ".".join(parts[:i]) in GRAPH]


def loaded_closure(roots) -> set[str]:
    """Our modules that importing `roots` loads."""
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        module = todo.pop()
        if module in seen or module not in GRAPH:
            continue
        seen.add(module)
        todo += parents(module)
        todo += [i.target for i in GRAPH[module] if i.loaded and i.target in GRAPH]
    return seen


def package_of(module: str) -> str:
    """The package of the map a module belongs to."""
    if module == "planaria.cli" or module.startswith("planaria.cli."):
        return "planaria.cli"
    for name in ("planaria.templates", "planaria.kernels", "planaria.runtime", "planaria.train",
                 "planaria.elastic", "planaria.chaos"):
        if module == name or module.startswith(name + "."):
            return name
    raise AssertionError(f"{module} belongs to no package of the map in docs/design.md")


def where(module: str, imp: Import) -> str:
    return f"{PATHS[module].relative_to(ROOT)}:{imp.line} imports {imp.target}"


def test_the_graph_is_read_from_every_module():
    # A parser that missed files or imports would pass every rule below.
    assert {"planaria.elastic.agent", "planaria.runtime.parallel.engine", "planaria.runtime.contract.keys",
            "planaria.templates.plan", "planaria.kernels.dispatch", "planaria.cli", "planaria.train"} <= set(GRAPH)
    engine = {i.target for i in GRAPH["planaria.runtime.parallel.engine"]}
    assert "torch" in engine and "planaria.templates.plan" in engine


def loads_torch(target: str) -> bool:
    """Importing `target` (a library, or a module of ours) loads torch, Triton or the kernels."""
    if target in TORCH:
        return True
    return any(i.target in TORCH for m in loaded_closure([target]) for i in GRAPH[m] if i.loaded)


def test_an_agent_loads_no_module_that_imports_torch():
    closure = loaded_closure(AGENTS)
    assert "planaria.elastic.controller" in closure and "planaria.runtime.contract.keys" in closure
    # Deferred imports count too: of torch itself, or of a module of ours that loads it.
    offending = [where(m, i) for m in sorted(closure) for i in GRAPH[m] if not i.typing and loads_torch(i.target)]
    assert offending == [], ("modules an agent loads must contain no import of torch, Triton or the kernels "
                             "(move the code that needs them to a module only workers import):\n"
                             + "\n".join(offending))


def test_the_contract_imports_only_itself_the_plan_contract_and_pydantic():
    offending = []
    for module in sorted(m for m in GRAPH if m == CONTRACT or m.startswith(CONTRACT + ".")):
        for imp in GRAPH[module]:
            ours = imp.target.startswith("planaria.")
            if ours and not (imp.target.startswith(CONTRACT) or imp.target.startswith("planaria.templates")):
                offending.append(where(module, imp))
            if not ours and imp.target not in sys.stdlib_module_names and imp.target not in CONTRACT_LIBRARIES:
                offending.append(where(module, imp))
    assert offending == []


def test_imports_run_in_the_direction_of_the_map():
    offending = []
    for module, imports in sorted(GRAPH.items()):
        source = package_of(module)
        for imp in imports:
            if not imp.target.startswith("planaria."):
                continue
            target = package_of(imp.target)
            if target != source and target not in ALLOWED[source]:
                offending.append(f"{where(module, imp)} ({source} may not import {target})")
    assert offending == []


def room_of(module: str) -> str | None:
    """The runtime room a module lives in (`planaria.runtime.<room>...`), None outside the runtime."""
    if not module.startswith(RUNTIME + "."):
        return None
    return module[len(RUNTIME) + 1:].split(".")[0]


def room_violations(graph: dict[str, list[Import]]) -> list[str]:
    """Imports between rooms of the runtime against `ROOMS` (loaded, deferred or typing)."""
    offending = []
    for module, imports in sorted(graph.items()):
        source = room_of(module)
        if source is None:
            continue
        for imp in imports:
            target = room_of(imp.target)
            if target is None or target in (source, "contract"):
                continue
            if target not in ROOMS[source]:
                offending.append(f"{module} line {imp.line} imports {imp.target} "
                                 f"(the {source} room may not import the {target} room)")
    return offending


def test_every_runtime_module_lives_in_a_room():
    flat = [m for m in GRAPH if m.startswith(RUNTIME + ".") and room_of(m) not in ROOMS]
    assert flat == [], ("runtime/ holds rooms, not modules: put these in the room whose concern they are "
                        f"(docs/design.md, \"Map\"): {flat}")
    assert {room_of(m) for m in GRAPH} >= set(ROOMS)


def test_rooms_import_in_the_direction_of_the_map():
    # The map itself runs one way: rooms sorted so that each imports only rooms before it.
    order, left = [], dict(ROOMS)
    while left:
        ready = sorted(room for room, below in left.items() if below <= set(order))
        assert ready, f"the rooms' map has a cycle among {sorted(left)}"
        order += ready
        for room in ready:
            del left[room]
    assert room_violations(GRAPH) == []


def test_a_planted_import_against_the_rooms_is_found():
    # The rule must be able to fail: an import of the layer state planted in the model,
    # at module level, in a function and under TYPE_CHECKING, is reported each time.
    known = set(GRAPH)
    planted = """
from typing import TYPE_CHECKING
from planaria.runtime.state.transfer import exchange_layers
def f():
    from planaria.runtime.worker import trainer
if TYPE_CHECKING:
    from planaria.runtime.parallel.engine import Engine
"""
    graph = dict(GRAPH)
    graph["planaria.runtime.models.llama"] = imports_of("planaria.runtime.models.llama", planted,
                                                       is_package=False, known=known)
    found = [v for v in room_violations(graph) if v.startswith("planaria.runtime.models.llama ")]
    assert [line.split(" imports ")[1].split(" ")[0] for line in found] == [
        "planaria.runtime.state.transfer", "planaria.runtime.worker.trainer", "planaria.runtime.parallel.engine"]
    # ... and a cycle between two rooms is one import against the map, whichever way it runs.
    graph = dict(GRAPH)
    graph["planaria.runtime.config.sections"] = imports_of(
        "planaria.runtime.config.sections", "from planaria.runtime.models.llama import LayerModel\n",
        is_package=False, known=known)
    assert len([v for v in room_violations(graph) if v.startswith("planaria.runtime.config.sections ")]) == 1


def test_no_import_cycle():
    # A package's __init__ importing its own modules is no cycle, though each module loads
    # its package first: Python gives the module the partly run package.
    edges = {m: {i.target for i in imports if i.loaded and i.target in GRAPH} for m, imports in GRAPH.items()}
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for target in sorted(edges[module]):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        path.pop()
        state[module] = 2
        return None

    for module in sorted(edges):
        if module not in state and (cycle := visit(module)):
            pytest.fail("import cycle: " + " -> ".join(cycle))


def test_no_two_modules_share_a_name():
    # `report` in one package and `report` in another read alike in a traceback, an import
    # or a review, and one is taken for the other: each module is named by what it owns.
    by_name: dict[str, list[str]] = {}
    for module in PATHS:
        leaf = module.rsplit(".", 1)[-1]
        if leaf not in ("__init__", "__main__") and PATHS[module].name != "__init__.py":
            by_name.setdefault(leaf, []).append(module)
    assert {leaf: found for leaf, found in by_name.items() if len(found) > 1} == {}
