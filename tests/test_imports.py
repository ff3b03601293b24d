"""The packages' import graph: no module of `launcher/` or `rl/` reaches itself through
imports, and the config path loads no torch.

Every import counts, at module level or inside a function: a lazy import hides a cycle from
Python at start-up but not from the reader, who still cannot understand one module without
the other. The graph is read from the source (AST), so nothing is imported to check it.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from rl.core.paths import ROOT

PACKAGES = ("launcher", "rl")


def module_files() -> dict[str, Path]:
    """Every module of the packages by dotted name (a package by its `__init__.py`)."""
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest known module `name` starts with (`rl.x.attr` -> `rl.x`), if any."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return None


def _imported(node: ast.AST, module: str, path: Path) -> Iterator[str]:
    """The dotted names one import statement brings in."""
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:  # relative: from the module's package, up `level - 1` more
            package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
            anchor = package[: len(package) - node.level + 1]
            base = ".".join([*anchor, base] if base else anchor)
        for alias in node.names:  # `from rl.x import y`: `rl.x.y` when that is a module
            yield f"{base}.{alias.name}"


def import_graph() -> dict[str, dict[str, int]]:
    """module -> {imported module of the packages: line of the first such import}."""
    modules = module_files()
    graph: dict[str, dict[str, int]] = {}
    for module, path in modules.items():
        edges: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            for name in _imported(node, module, path):
                target = _resolve(name, modules)
                if target is not None:
                    edges.setdefault(target, node.lineno)
        graph[module] = edges
    return graph


def strongly_connected(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Tarjan's strongly connected components of the graph (iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            child = next(edges, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(sorted(component))
    return components


def a_cycle(graph: dict[str, dict[str, int]], component: list[str]) -> list[str]:
    """One cycle through the component's first module, as `module:line` import sites."""
    inside, start = set(component), component[0]
    paths = {start: [start]}
    frontier = [start]
    while frontier:  # breadth-first: the shortest way back to `start`
        node = frontier.pop(0)
        for child in graph[node]:
            if child == start:
                path = [*paths[node], start]
                steps = zip(path[:-1], path[1:], strict=True)
                return [f"{a} (line {graph[a][b]})" for a, b in steps] + [start]
            if child in inside and child not in paths:
                paths[child] = [*paths[node], child]
                frontier.append(child)
    raise AssertionError(f"no cycle through {start}")


def cycles(package: str) -> list[str]:
    """Each import cycle that passes through `package`, spelled out."""
    graph = import_graph()
    found = []
    for component in strongly_connected(graph):
        if not any(m == package or m.startswith(f"{package}.") for m in component):
            continue
        if len(component) > 1 or component[0] in graph[component[0]]:
            cycle = " -> ".join(a_cycle(graph, component))
            found.append(f"{', '.join(component)} import each other, e.g. {cycle}")
    return found


def test_the_graph_sees_lazy_and_from_imports() -> None:
    graph = import_graph()
    assert "rl.core.config" in graph["rl.core.derive"]  # `from rl.core.config import ...`
    assert "rl.envs" in graph["launcher.plan.checks"]  # `from rl.envs import locate` (a name)
    assert "rl.orchestrator.agents" in graph["launcher.plan.checks"]  # inside a function
    assert not any(m.startswith("tests") for m in graph)  # test helpers are not shipped


def test_launcher_has_no_import_cycle() -> None:
    found = cycles("launcher")
    assert not found, "import cycles:\n" + "\n".join(found)


def test_rl_has_no_import_cycle() -> None:
    found = cycles("rl")
    assert not found, "import cycles:\n" + "\n".join(found)


# Each package's layer: a module imports only modules of its own package or of a layer below
# it. rl/: the core every role shares, then environments and the weight transport, then the
# servers (queue, inference: the orchestrator calls the inference servers' client and API
# layer), then the roles that drive them; no role imports another of its layer.
RL_LAYERS = (
    ("rl", "rl.core"),
    ("rl.envs", "rl.weights"),
    ("rl.queue", "rl.inference"),
    ("rl.orchestrator", "rl.trainer"),
)
# launcher/: module by module, lowest first (a folder's `__init__` imports nothing). The README
# shows this list (`launcher_layers_text`), and a test holds the two together.
LAUNCHER_LAYERS = (
    (
        "launcher",
        "launcher.errors",
        "launcher.hydra_dirs",
        "launcher.plan",
        "launcher.plan.gpus",
        "launcher.plan.costs",
        "launcher.plan.costs.memory",
        "launcher.clusters",
        "launcher.clusters.processes",
        "launcher.clusters.local",
        "launcher.clusters.slurm",
        "launcher.clusters.kubernetes",
        "launcher.sweeps",
        "launcher.watch",
        "launcher.watch.report",
    ),
    ("launcher.clusters.base",),
    (
        "launcher.plan.costs.step_time",
        "launcher.watch.tracking",
        "launcher.help",
        "launcher.branch",
        "launcher.clusters.slurm.cli",
        "launcher.clusters.kubernetes.manifests",
    ),
    ("launcher.plan.costs.fit", "launcher.clusters.kubernetes.api"),
    (
        "launcher.plan.checks",
        "launcher.plan.costs.figures",
        "launcher.clusters.slurm.jobs",
        "launcher.clusters.layout",
    ),
    ("launcher.plan.planner",),
    ("launcher.clusters.run_dir", "launcher.clusters.supervisor"),
    (
        "launcher.sweeps.summary",
        "launcher.clusters.local.launch",
        "launcher.clusters.slurm.supervisor",
        "launcher.clusters.kubernetes.pod",
        "launcher.clusters.kubernetes.submit",
    ),
    ("launcher.watch.status",),
    ("launcher.clusters.slurm.submit",),
    ("launcher.sweeps.base",),
    ("launcher.sweeps.shared",),
    (
        "launcher.clusters.local.cluster",
        "launcher.clusters.slurm.cluster",
        "launcher.clusters.kubernetes.cluster",
    ),
    ("launcher.run",),
    ("launcher.cli",),
)


def launcher_layers_text() -> str:
    """LAUNCHER_LAYERS as the README lists them: a line per layer, lowest first, each module
    by its path under launcher/ (folders' `__init__`s left out)."""
    modules = set(module_files())
    lines = []
    for i, layer in enumerate(LAUNCHER_LAYERS, 1):
        names = [m.removeprefix("launcher.").replace(".", "/") + ".py" for m in layer
                 if m != "launcher" and not modules_is_package(m, modules)]  # fmt: skip
        lines.append(f"{i}. " + ", ".join(f"`{n}`" for n in names))
    return "\n".join(lines)


def modules_is_package(module: str, modules: set[str]) -> bool:
    return any(other.startswith(f"{module}.") for other in modules)


def test_the_readme_lists_the_launcher_layers_as_they_are() -> None:
    """The README's layering of launcher/ is this test's, so the two cannot drift apart."""
    text = (ROOT / "README.md").read_text()
    start, end = "<!-- launcher layers: tests/test_imports.py -->\n", "\n<!-- end -->"
    assert start in text and end in text.split(start, 1)[1], "README.md lacks the markers"
    listed = text.split(start, 1)[1].split(end, 1)[0]
    assert listed == launcher_layers_text(), (
        f"README.md's launcher layers differ from tests/test_imports.py's; they are:\n"
        f"{launcher_layers_text()}"
    )


def test_the_launcher_top_level_is_small() -> None:
    """launcher/ shows its architecture: a few command modules, the rest in folders."""
    top = sorted(p.name for p in (ROOT / "launcher").glob("*.py"))
    assert len(top) <= 8, top


def package_of(module: str, layers: tuple[tuple[str, ...], ...]) -> str | None:
    """The longest package of `layers` that `module` is or lies in."""
    found = [
        package
        for layer in layers
        for package in layer
        if module == package or module.startswith(f"{package}.")
    ]
    return max(found, key=len, default=None)


@pytest.mark.parametrize(
    ("root", "layers"), [("rl", RL_LAYERS), ("launcher", LAUNCHER_LAYERS)], ids=["rl", "launcher"]
)
def test_modules_import_only_lower_layers(root: str, layers: tuple[tuple[str, ...], ...]) -> None:
    level = {package: i for i, packages in enumerate(layers) for package in packages}
    graph = import_graph()
    mine = [m for m in graph if m == root or m.startswith(f"{root}.")]
    unplaced = [
        m for m in mine if package_of(m, layers) is None or (root == "launcher" and m not in level)
    ]
    assert not unplaced, f"add {unplaced} to the layers"
    upward = []
    for module in mine:
        package = package_of(module, layers)
        for target, line in graph[module].items():
            theirs = package_of(target, layers)
            if theirs is None or theirs == package or package == root == theirs:
                continue
            if level[theirs] >= level[package]:
                upward.append(f"{module} imports {target} (line {line})")
    assert not upward, "\n".join(upward)


def test_every_package_of_rl_is_placed() -> None:
    """The layers name every package of rl/ (a new package gets a place), and only those."""
    packages = {
        ".".join(p.relative_to(ROOT).parts[:-1]) for p in (ROOT / "rl").glob("*/__init__.py")
    }
    placed = {package for layer in RL_LAYERS for package in layer} - {"rl"}
    assert packages == placed


def test_roles_import_nothing_from_the_launcher() -> None:
    """The roles run inside Slurm jobs and torchrun with only `rl` to rely on."""
    graph = import_graph()
    found = [
        f"{module} imports {target}"
        for module, edges in graph.items()
        if module.startswith("rl")
        for target in edges
        if target.startswith("launcher")
    ]
    assert not found, "\n".join(found)


@pytest.mark.parametrize(
    "module",
    [
        "launcher.cli",
        "launcher.plan.planner",
        "launcher.run",
        "rl.core.config",
        "rl.core.derive",
        "rl.core.rundir",
        "rl.envs",
    ],
)
def test_config_path_imports_no_torch(module: str) -> None:
    """`rl --help` and a dry run stay fast: the CLI and planner never load torch."""
    code = f"import sys, {module}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False", f"importing {module} loads torch"


MAX_FUNCTION_LINES = 80


def test_functions_read_on_a_screen() -> None:
    """No function of rl/ or launcher/ is longer than a screen: longer ones are split into
    calls that each say what they do."""
    long = []
    for module, path in module_files().items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{module}.{node.name} (line {node.lineno}): {lines} lines")
    assert not long, "\n".join(long)


def test_shipped_code_needs_no_test_tools() -> None:
    """pytest is a development dependency: nothing under rl/ or launcher/ imports it."""
    found = [
        f"{module} (line {line})"
        for module, path in module_files().items()
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.Import | ast.ImportFrom)
        for name in _imported(node, module, path)
        if name == "pytest" or name.startswith("pytest.")
        for line in [node.lineno]
    ]
    assert not found, found


def test_tests_readme_maps_every_module_to_tests_that_exist() -> None:
    """A module's tests can be found by its path: tests/README.md has a row for each module
    with code, naming test files that exist."""
    rows = {}
    for line in (ROOT / "tests" / "README.md").read_text().splitlines():
        if line.startswith("| `"):
            cells = line.split("|")
            rows[cells[1].strip().strip("`")] = [t.strip().strip("`") for t in cells[2].split(",")]
    with_code = {
        str(path.relative_to(ROOT))
        for path in module_files().values()
        if path.name != "__init__.py" or "def " in path.read_text() or "class " in path.read_text()
    }
    assert sorted(with_code - set(rows)) == [], "add these modules to tests/README.md's map"
    assert sorted(set(rows) - with_code) == [], "tests/README.md maps modules that are gone"
    named = {t for tests in rows.values() for t in tests}
    assert sorted(t for t in named if not (ROOT / "tests" / t).is_file()) == []
