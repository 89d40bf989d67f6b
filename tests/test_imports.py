"""How the modules depend on each other: each has one job, so every import points one way (down to the module whose
job it is): train_grpo.py on top, which no module imports; the mission's files (rollout.py, reward.py, data.py) below
it; the machinery in grpo/ below them, importing none of them."""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def module_imports() -> dict[str, set[str]]:
    """Each module's imports of the repository's other modules (top-level files by their name, the package's as
    grpo.NAME), wherever they stand (a function's local import closes a cycle as surely as one at the top)."""
    modules = {p.stem: p for p in REPO.glob("*.py")}
    modules |= {f"grpo.{p.stem}": p for p in (REPO / "grpo").glob("*.py") if p.stem != "__init__"}
    graph = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {".".join(alias.name.split(".")[:2]) for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                if node.module == "grpo":  # from grpo import a, b
                    found |= {f"grpo.{alias.name}" for alias in node.names}
                found.add(".".join(node.module.split(".")[:2]))
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
    assert {"data", "grpo.video", "grpo.media", "rollout", "train_grpo"} <= graph.keys()
    assert cycles(graph) == []
    assert [name for name, deps in graph.items() if "train_grpo" in deps] == []


# The dry run checks the user's data, reward and engine limits through the files that define them: it stands above
# them, and only the loop imports it.
ABOVE_THE_MISSION = {"grpo.preflight"}


def test_the_package_imports_no_top_level_file():
    """Guards against the machinery reaching up into the files a reader opens first (a cycle waiting to happen, and
    a package that cannot be read without them)."""
    graph = module_imports()
    top = {name for name in graph if not name.startswith("grpo.")}
    up = {name: sorted(deps & top) for name, deps in graph.items() if name.startswith("grpo.") and deps & top}
    assert {name: deps for name, deps in up.items() if name not in ABOVE_THE_MISSION} == {}
    assert [name for name, deps in graph.items() if deps & ABOVE_THE_MISSION] == ["train_grpo"]
