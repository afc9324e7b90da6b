"""The import graph, read from the source: what an agent imports holds no torch, and
every import runs in the direction of docs/design.md ("Map").

Read with `ast`, not by importing: a test that imports the modules proves only what one
interpreter loaded on one machine, while this one sees every import statement, those
inside functions too, and says which file and line breaks a rule.

Two kinds of edge:
- *loaded*: an import at module level (class bodies and `try` blocks included, `if
  TYPE_CHECKING:` blocks not): it runs when the module is imported;
- *deferred*: an import inside a function: it runs only if the function is called.

The rules:
1. An agent (`planaria.elastic.agent`, which never computes) loads no module that imports
   torch, Triton or Planaria's kernels, deferred or not: the modules it loads contain no
   such import at all, so torch-freeness holds by construction and not by the discipline
   of delaying imports in modules that a worker also uses.
2. The contract (`planaria.runtime.contract`) imports nothing of Planaria's but itself
   and the plan contract (`planaria.templates`), and no third-party library but pydantic.
3. Packages import in one direction: templates and kernels import nothing of ours,
   runtime may import those two, elastic those three, chaos and the CLI everything.
4. No cycle among the modules' loaded imports.
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


@dataclass(frozen=True)
class Import:
    target: str
    """A module of ours (resolved to the module, not a name inside it), or a third-party
    library's top-level name."""
    line: int
    loaded: bool


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

    def visit_FunctionDef(self, node):
        self._depth += 1
        self.generic_visit(node)
        self._depth -= 1

    visit_AsyncFunctionDef = visit_FunctionDef
    visit_Lambda = visit_FunctionDef

    def visit_If(self, node):
        test = ast.unparse(node.test)
        if test in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            for child in node.orelse:
                self.visit(child)
            return  # never runs
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
        self.imports.append(Import(target if ours else target.split(".")[0], line, self._depth == 0))


def parse_graph() -> tuple[dict[str, list[Import]], dict[str, Path]]:
    found = modules()
    known = set(found)
    graph = {}
    for name, path in found.items():
        visitor = _Visitor(name, path.name == "__init__.py", known)
        visitor.visit(ast.parse(path.read_text(), str(path)))
        graph[name] = visitor.imports
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
    offending = [where(m, i) for m in sorted(closure) for i in GRAPH[m] if loads_torch(i.target)]
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
