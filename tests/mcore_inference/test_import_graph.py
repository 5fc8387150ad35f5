"""mcore_inference's modules import one another one way: the graph of their imports of each other
(``TYPE_CHECKING`` imports included) has no cycle."""

import ast
from pathlib import Path

import mcore_inference

PACKAGE = Path(mcore_inference.__file__).parent


def _imports() -> dict[str, set[str]]:
    """Module name -> the package's modules it imports (``from .x import``, ``from mcore_inference.x import``)."""
    graph = {}
    for path in PACKAGE.glob("*.py"):
        if path.stem == "__init__":
            continue
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                if node.level == 1:
                    targets.add(node.module.split(".")[0])
                elif node.module.startswith("mcore_inference."):
                    targets.add(node.module.split(".")[1])
        graph[path.stem] = targets
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, str] = {}

    def visit(module: str, path: list[str]) -> list[str] | None:
        state[module] = "open"
        for target in sorted(graph.get(module, ())):
            if state.get(target) == "open":
                return [*path, module, target]
            if target not in state and (found := visit(target, [*path, module])):
                return found
        state[module] = "done"
        return None

    for module in sorted(graph):
        if module not in state and (found := visit(module, [])):
            return found
    return None


def test_modules_import_one_way():
    graph = _imports()
    assert {"attention", "block_table", "context", "model_runner", "scheduler"} <= graph.keys()
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_the_layering():
    graph = _imports()
    assert graph["attention"] == set()  # tensors in, tensors out
    assert "context" not in graph["pipeline"] and "scheduler" not in graph["context"]
    assert "model_runner" not in graph["context"] | graph["scheduler"]


def test_the_cycle_finder_finds_cycles():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
