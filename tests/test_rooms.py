"""The package's imports match docs/design.md's rooms table: no import cycle between modules, and no arrow between
rooms that the table does not allow. The table is read from the markdown, so the map and this test cannot drift.

Read with `ast`, nothing imported. Every import counts, at module level or inside a function, and those under
`if TYPE_CHECKING:` too: a module that names another's type in an annotation knows that room, so the map says so.
`from pagedllm.a import b` imports the module pagedllm.a.b when there is one, else pagedllm.a; importing a submodule
does not count as importing its parent packages' __init__ (Python runs them, but they are not what is used).

A room is a subpackage (`engine/`) or a top-level module (`llm.py`, `__init__.py` for the package's own). The
table's third column lists, in backticks, the rooms a room may import; each one must sit lower in the table (arrows
point down only), and the rooms named on the "Leaves any room may import:" line are the table's last rows.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LEAVES_LINE = "Leaves any room may import:"


@dataclass(frozen=True)
class Rooms:
    order: list[str]  # the table's rows, top to bottom
    allowed: dict[str, set[str]]  # room -> rooms it may import (leaves not included)
    leaves: set[str]


def parse_rooms(markdown: str) -> Rooms:
    """The "Rooms and who imports whom" section's table and its leaves line."""
    section = markdown.split("## Rooms and who imports whom", 1)[1].split("\n## ", 1)[0]
    order, allowed, leaves = [], {}, set()
    for line in section.splitlines():
        if line.startswith(LEAVES_LINE):
            leaves = set(re.findall(r"`([^`]+)`", line))
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if len(cells) != 3 or not re.fullmatch(r"`[^`]+`", cells[0]):
            continue  # not a row of the table (its header, its rule, or prose)
        room = cells[0].strip("`")
        order.append(room)
        allowed[room] = set(re.findall(r"`([^`]+)`", cells[2]))
    return Rooms(order, allowed, leaves)


def table_problems(rooms: Rooms) -> list[str]:
    """What is wrong with the table itself: unknown rooms, arrows that do not point down, leaves not last."""
    problems = []
    if not rooms.order:
        problems.append("no rooms table found")
    position = {room: index for index, room in enumerate(rooms.order)}
    for room in rooms.order:
        for target in sorted(rooms.allowed[room]):
            if target not in position:
                problems.append(f"{room} lists {target}, which is no room of the table")
            elif position[target] <= position[room]:
                problems.append(f"{room} lists {target}, which is not below it: arrows point down only")
    for leaf in sorted(rooms.leaves):
        if leaf not in position:
            problems.append(f"leaf {leaf} is no room of the table")
    if set(rooms.order[len(rooms.order) - len(rooms.leaves) :]) != rooms.leaves:
        problems.append(f"the leaves {sorted(rooms.leaves)} must be the table's last rows")
    return problems


def find_modules(root: Path, package: str) -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, whether it is a package's __init__)."""
    modules = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        modules[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return modules


def import_nodes(tree: ast.AST):
    """Every import statement, wherever it is (module level, functions, classes, if blocks)."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node


def imported_modules(node: ast.Import | ast.ImportFrom, importer: str, is_package: bool, modules: dict) -> set[str]:
    """The package's modules an import statement uses."""
    if isinstance(node, ast.Import):
        targets = set()
        for alias in node.names:
            name = alias.name
            while name not in modules and "." in name:
                name = name.rsplit(".", 1)[0]
            targets.add(name)
        return targets & modules.keys()
    base = node.module or ""
    if node.level:  # relative: from the importer's package, up level - 1 packages
        package = importer if is_package else importer.rsplit(".", 1)[0]
        for _ in range(node.level - 1):
            package = package.rsplit(".", 1)[0]
        base = f"{package}.{base}" if base else package
    targets = {f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names}
    return targets & modules.keys()


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (itself left out); a package's __init__ is the package's name."""
    modules = find_modules(root, package)
    graph = {}
    for module, (path, is_package) in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        targets = set()
        for node in import_nodes(tree):
            targets |= imported_modules(node, module, is_package, modules)
        graph[module] = targets - {module}
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module, as a closed path a -> b -> ... -> a."""
    index, low, on_stack, stack, components = {}, {}, set(), [], []

    def visit(module: str) -> None:  # Tarjan's algorithm
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in sorted(graph.get(module, ())):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == module:
                    break
            if len(component) > 1:
                components.append(component)

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return [cycle_through(component, graph) for component in components]


def cycle_through(component: set[str], graph: dict[str, set[str]]) -> list[str]:
    """A closed path inside a strongly connected component, from its first module (breadth first: a shortest one)."""
    start = min(component)
    parents, frontier = {start: None}, [start]
    while frontier:
        next_frontier = []
        for module in frontier:
            for target in sorted(graph[module] & component):
                if target == start:
                    path = [module]
                    while parents[path[-1]] is not None:
                        path.append(parents[path[-1]])
                    return [start, *reversed(path[:-1]), start] if len(path) > 1 else [start, module, start]
                if target not in parents:
                    parents[target] = module
                    next_frontier.append(target)
        frontier = next_frontier
    raise AssertionError("a strongly connected component without a cycle")


def room_of(module: str, root: Path) -> str:
    """`engine/` for pagedllm.engine and pagedllm.engine.*, `llm.py` for pagedllm.llm, `__init__.py` for pagedllm."""
    parts = module.split(".")
    if len(parts) == 1:
        return "__init__.py"
    return f"{parts[1]}/" if (root / parts[0] / parts[1]).is_dir() else f"{parts[1]}.py"


def arrow_problems(graph: dict[str, set[str]], rooms: Rooms, root: Path) -> list[str]:
    """Each import between rooms that the table does not allow, naming both modules."""
    problems = []
    for module in sorted(graph):
        room = room_of(module, root)
        if room not in rooms.allowed:
            problems.append(f"{module} is in room {room}, which the rooms table does not list")
            continue
        for target in sorted(graph[module]):
            target_room = room_of(target, root)
            if target_room != room and target_room not in rooms.allowed[room] | rooms.leaves:
                problems.append(f"{module} imports {target}: the table does not let {room} import {target_room}")
    return problems


def room_problems(root: Path, package: str, markdown: str) -> list[str]:
    rooms = parse_rooms(markdown)
    graph = import_graph(root, package)
    cycles = [f"import cycle: {' -> '.join(cycle)}" for cycle in find_cycles(graph)]
    return table_problems(rooms) + cycles + arrow_problems(graph, rooms, root)


def test_the_package_has_no_import_cycle_and_only_the_arrows_of_design_md():
    markdown = (REPO / "docs" / "design.md").read_text(encoding="utf-8")
    problems = room_problems(REPO, "pagedllm", markdown)
    assert not problems, "\n".join(problems)


def test_every_room_of_the_package_is_in_the_table():
    rooms = parse_rooms((REPO / "docs" / "design.md").read_text(encoding="utf-8"))
    graph = import_graph(REPO, "pagedllm")
    assert {room_of(module, REPO) for module in graph} == set(rooms.order)


# A small fake package: `top/` above `low/`, `leaf.py` a leaf.
FAKE_MAP = f"""# Map

## Rooms and who imports whom

| room | job | imports |
|---|---|---|
| `__init__.py` | the package | nothing |
| `top/` | the top | `low/` (it builds on it) |
| `low/` | below | nothing |
| `leaf.py` | a leaf | nothing |

{LEAVES_LINE} `leaf.py`.

## Next section

| `low/` | not | `top/` |
"""


def write_package(root: Path, files: dict[str, str]) -> None:
    for name, text in {"fake/__init__.py": "", "fake/top/__init__.py": "", "fake/low/__init__.py": "", **files}.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


def test_a_tree_that_keeps_the_map_passes(tmp_path):
    write_package(tmp_path, {
        "fake/leaf.py": "",
        "fake/low/a.py": "from fake import leaf\n",
        "fake/low/b.py": "from . import a\n",
        "fake/top/c.py": "import fake.low.b\n\ndef f():\n    from fake.low import a\n",
    })  # fmt: skip
    assert room_problems(tmp_path, "fake", FAKE_MAP) == []
    graph = import_graph(tmp_path, "fake")
    assert graph["fake.top.c"] == {"fake.low.a", "fake.low.b"}  # not fake or fake.low: parents are no dependency
    assert graph["fake.low.b"] == {"fake.low.a"} and graph["fake.low.a"] == {"fake.leaf"}


def test_a_cycle_fails_and_is_named(tmp_path):
    write_package(tmp_path, {
        "fake/leaf.py": "",
        "fake/low/a.py": "from fake.low.b import thing\n",
        "fake/low/b.py": "def thing():\n    from fake.low import c\n",
        "fake/low/c.py": "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from fake.low.a import x\n",
    })  # fmt: skip
    assert room_problems(tmp_path, "fake", FAKE_MAP) == [
        "import cycle: fake.low.a -> fake.low.b -> fake.low.c -> fake.low.a"
    ]


def test_an_arrow_the_table_does_not_allow_fails_naming_both_modules(tmp_path):
    write_package(tmp_path, {"fake/leaf.py": "", "fake/top/c.py": "", "fake/low/a.py": "from fake.top.c import f\n"})
    assert room_problems(tmp_path, "fake", FAKE_MAP) == [
        "fake.low.a imports fake.top.c: the table does not let low/ import top/"
    ]


def test_a_room_missing_from_the_table_fails(tmp_path):
    write_package(tmp_path, {"fake/leaf.py": "", "fake/extra.py": "from fake.low import a\n", "fake/low/a.py": ""})
    assert room_problems(tmp_path, "fake", FAKE_MAP) == [
        "fake.extra is in room extra.py, which the rooms table does not list"
    ]


@pytest.mark.parametrize(
    ("rows", "problem"),
    [
        (
            ["`top/` | `low/`", "`low/` | `top/`", "`leaf.py` |"],
            "low/ lists top/, which is not below it: arrows point down only",
        ),
        (["`top/` | `lower/`", "`low/` |", "`leaf.py` |"], "top/ lists lower/, which is no room of the table"),
        (["`top/` | `low/`", "`leaf.py` |", "`low/` |"], "the leaves ['leaf.py'] must be the table's last rows"),
    ],
)
def test_a_table_whose_arrows_do_not_point_down_fails(rows, problem):
    table = "\n".join(f"| {room} | job | {imports} |" for room, imports in (row.split(" |") for row in rows))
    header = "## Rooms and who imports whom\n\n| room | job | imports |\n|---|---|---|"
    markdown = f"{header}\n{table}\n\n{LEAVES_LINE} `leaf.py`.\n"
    assert table_problems(parse_rooms(markdown)) == [problem]
