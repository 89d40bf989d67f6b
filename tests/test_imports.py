"""How the top-level modules depend on each other: each has one job, so every import points one way (down to the
module whose job it is), and no module imports train_grpo.py, which a reader reads first and last."""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def module_imports() -> dict[str, set[str]]:
    """Each top-level module's imports of other top-level modules, wherever they stand (a function's local import
    closes a cycle as surely as one at the top)."""
    modules = {p.stem: p for p in REPO.glob("*.py")}
    graph = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module.split(".")[0])
        graph[name] = found & modules.keys() - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import cycle, each as the path that closes it (depth-first search, colouring modules as it goes)."""
    found, state = [], {}

    def visit(name, path):
        state[name] = "open"
        for dep in sorted(graph[name]):
            if state.get(dep) == "open":
                found.append(path[path.index(dep) :] + [dep])
            elif dep not in state:
                visit(dep, path + [dep])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    return found


def test_cycle_finder_finds_a_cycle():
    """Guards against a check that can never fail."""
    assert cycles({"data": {"video"}, "video": {"media", "data"}, "media": set()}) == [["data", "video", "data"]]
    assert cycles({"data": {"media", "video"}, "video": {"media"}, "media": set()}) == []


def test_no_two_modules_import_each_other():
    """Guards against a module doing another's job again (data.py and video.py once needed each other's helpers)."""
    graph = module_imports()
    assert {"data", "video", "media", "rollout", "train_grpo"} <= graph.keys()
    assert cycles(graph) == []
    assert [name for name, deps in graph.items() if "train_grpo" in deps] == []
