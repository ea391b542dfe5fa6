"""The package's layout, as docs/design.md draws it: folders of at most 12 modules, no import circle between
modules, and the supervisor's folders importing only along the request's way and down to what they share."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "inferd"
MOST_MODULES = 12

# Each supervisor folder, and the folders it may import from (docs/design.md): the request's way in (intake),
# its wait and batch (queueing), its way out and back (dispatch), beside them the versions' lifecycle and the
# control plane, the child processes under all, and `shared` (the records and types every part uses) below
# everything. The loop and its wiring ("") sit on top.
SUPERVISOR_FOLDERS: dict[str, set[str]] = {
    "shared": set(),
    "processes": {"shared"},
    "queueing": {"shared"},
    "dispatch": {"shared", "queueing", "processes"},
    "pipelines": {"shared", "queueing", "dispatch", "processes"},
    "intake": {"shared", "queueing", "dispatch", "processes", "pipelines"},
    "versions": {"shared", "queueing", "dispatch", "processes"},
    "control": {"shared", "queueing", "dispatch", "processes", "intake", "versions", "pipelines"},
    "": {"shared", "queueing", "dispatch", "processes", "intake", "versions", "control", "pipelines"},
}


def modules() -> dict[str, Path]:
    """Every module of the package by its dotted name (a package by its folder's)."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports() -> dict[str, set[str]]:
    """Each module's imports of the package's modules: every import statement, those under TYPE_CHECKING and
    inside functions too (a name imported from a package counts as its module where it is one)."""
    known = modules()
    graph: dict[str, set[str]] = {name: set() for name in known}
    for name, path in known.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                graph[name].update(alias.name for alias in node.names if alias.name in known)
            elif isinstance(node, ast.ImportFrom) and node.module in known and not node.level:
                graph[name].update(f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in known
                                   else node.module for alias in node.names)
        graph[name].discard(name)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm, without recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for target in edges:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.append(member)
                        if member == node:
                            break
                    if len(group) > 1:
                        found.append(sorted(group))
    return found


def test_no_folder_of_the_package_holds_more_than_twelve_modules():
    crowded = {str(folder.relative_to(PACKAGE.parent)): count for folder in [PACKAGE, *PACKAGE.rglob("*/")]
               if folder.name != "__pycache__" and (count := len(list(folder.glob("*.py")))) > MOST_MODULES}
    assert not crowded, crowded


def test_no_module_imports_itself_through_others():
    assert circles(imports()) == []


def test_the_finder_of_circles_finds_one():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_supervisors_folders_import_along_the_requests_way_and_down():
    def folder(name: str) -> str | None:
        parts = name.split(".")
        if parts[:2] != ["inferd", "supervisor"]:
            return None
        if len(parts) == 3 and parts[2] not in SUPERVISOR_FOLDERS:
            return ""  # a module of the loop and its wiring
        return parts[2] if len(parts) > 2 else ""

    known = modules()
    assert {folder(name) for name in known} - {None} == set(SUPERVISOR_FOLDERS), "a folder docs/design.md does not name"
    against = sorted(f"{name} imports {target}" for name, targets in imports().items() for target in targets
                     if (here := folder(name)) is not None and (there := folder(target)) is not None
                     and there != here and there not in SUPERVISOR_FOLDERS[here])
    assert not against, against
