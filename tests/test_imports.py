"""The import graph of the two packages: no cycle, no import up the layers, and eagle3_train never
imports data_prep.

Every import statement counts, at module level or inside a function (a lazy import is still a
dependency); imports under ``if TYPE_CHECKING:`` are for type hints only and do not.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("data_prep", "eagle3_train")

# The layers, lowest first: a module imports from its own layer and those below, never from above.
# A module belongs to the longest prefix named here (eagle3_train itself: the package's version).
LAYERS = (
    ("eagle3_train", "eagle3_train.core"),  # the contracts, formats and helpers every stage shares
    ("eagle3_train.model", "eagle3_train.targets", "eagle3_train.engines"),
    ("eagle3_train.training", "eagle3_train.serving", "data_prep"),  # the stages
    ("eagle3_train.evaluation",),  # reads what the stages made
    ("eagle3_train.run",),  # runs them all
)


def project_modules() -> dict[str, Path]:
    """Dotted name -> file, for every module of the two packages (a package is its __init__)."""
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _type_checking_only(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules ``name`` imports (``from pkg import sub`` names the submodule)."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if _type_checking_only(node):
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                here = name.split(".") if is_package else name.split(".")[:-1]
                base = ".".join(here[: len(here) - node.level + 1] + ([base] if base else []))
            for a in node.names:
                found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return {m for m in found if m in modules and m != name}


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a list of modules (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def dfs(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := dfs(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := dfs(node)):
            return cycle
    return None


def test_the_walk_sees_lazy_imports_and_finds_a_cycle():
    graph = import_graph()
    assert "data_prep.dump.stage" in graph["data_prep.dump.cli"]
    assert "eagle3_train.engines.http" in graph["eagle3_train.engines.vllm"]
    assert "data_prep.dump.backend" in graph["data_prep.dump.hf"]  # `from data_prep.dump import backend`
    assert "eagle3_train.targets" in graph["eagle3_train.serving.check"]  # imported inside a function
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]


def layer_of(module: str) -> int:
    """The index in LAYERS of the layer ``module`` belongs to (its longest prefix there)."""
    found = [(len(p), i) for i, layer in enumerate(LAYERS) for p in layer if module == p or module.startswith(p + ".")]
    assert found, f"{module} is on no layer: add its package to LAYERS"
    return max(found)[1]


def test_the_layers_place_every_module():
    assert layer_of("eagle3_train.core.reports") == 0 and layer_of("eagle3_train") == 0
    assert layer_of("eagle3_train.serving.card") == 2 and layer_of("data_prep.dump.stage") == 2
    assert layer_of("eagle3_train.evaluation.eval") == 3 and layer_of("eagle3_train.run") == 4
    for module in import_graph():
        layer_of(module)


def test_no_import_runs_up_the_layers():
    graph = import_graph()
    up = sorted(f"{m} -> {d}" for m, deps in graph.items() for d in deps if layer_of(d) > layer_of(m))
    assert up == []


def test_no_import_cycle():
    assert find_cycle(import_graph()) is None


def test_eagle3_train_never_imports_data_prep():
    """The library stands without data_prep; only eagle3-run, which runs data_prep's stages and
    checks their options against their schemas before the first runs, sits above both."""
    graph = import_graph()
    bad = {
        m: sorted(d for d in deps if d.startswith("data_prep"))
        for m, deps in graph.items()
        if m.startswith("eagle3_train") and m != "eagle3_train.run"
    }
    assert {m: d for m, d in bad.items() if d} == {}
