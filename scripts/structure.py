"""Print the shape of the code: modules, import levels, cycles, upward imports, long functions.

    python3 scripts/structure.py            # a summary
    python3 scripts/structure.py --detail   # each cycle, upward import, long function and module

Read from the source with `ast`, nothing imported. An import is an arrow from one of our modules
(`autotune.*`, `strategies.*`) to another, whether made at module level or inside a function.
A module's level is 0 when it imports none of ours and otherwise one more than the highest level
it imports; the modules of an import cycle share one level, so an upward import (to the same or a
higher level) is an arrow that closes a cycle. tests/test_structure.py holds the limits this script reports against.
"""
from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("autotune", "strategies")
MAX_FUNCTION_LINES = 80
MAX_MODULE_LINES = 500


@dataclass
class Module:
    name: str
    path: Path
    lines: int
    top: set[str] = field(default_factory=set)      # our modules imported at module level
    lazy: set[str] = field(default_factory=set)     # ... imported inside a function
    private: list[str] = field(default_factory=list)  # "_name from module" imported across modules
    functions: list[tuple[str, int]] = field(default_factory=list)  # (qualified name, lines)


def _module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(node: ast.ImportFrom, here: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = here.split(".") if is_package else here.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _ours(name: str, known: set[str]) -> str | None:
    """The longest of our modules that `name` is or lies in."""
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def _functions(tree: ast.AST) -> list[tuple[str, int]]:
    found = []

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = prefix + child.name
                found.append((name, child.end_lineno - child.lineno + 1))
                visit(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".")
            else:
                visit(child, prefix)

    visit(tree, "")
    return found


def read(root: Path = ROOT) -> dict[str, Module]:
    paths = [p for pkg in PACKAGES for p in sorted((root / pkg).rglob("*.py"))]
    modules = {_module_name(p, root): Module(_module_name(p, root), p, len(p.read_text().splitlines())) for p in paths}
    known = set(modules)
    for mod in modules.values():
        tree = ast.parse(mod.path.read_text())
        is_package = mod.path.name == "__init__.py"
        mod.functions = _functions(tree)
        inside = set()
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                inside.update(id(n) for n in ast.walk(fn) if n is not fn)
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [(_ours(a.name, known), None) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(node, mod.name, is_package)
                for alias in node.names:
                    sub = _ours(f"{base}.{alias.name}", known)
                    target = sub if sub and sub != _ours(base, known) else _ours(base, known)
                    targets.append((target, None if sub == f"{base}.{alias.name}" else alias.name))
            for target, imported in targets:
                if not target or target == mod.name:
                    continue
                if isinstance(node, ast.ImportFrom) and imported and imported.startswith("_") \
                        and not imported.startswith("__"):
                    mod.private.append(f"{imported} from {target}")
                (mod.lazy if id(node) in inside else mod.top).add(target)
    for mod in modules.values():
        mod.lazy -= mod.top
        # importing a package's submodule runs the package's __init__ first: not an arrow of ours
    return modules


def _cycles(modules: dict[str, Module]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def connect(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(modules[v].top | modules[v].lazy):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                out.append(sorted(part))

    sys.setrecursionlimit(10_000)
    for v in sorted(modules):
        if v not in index:
            connect(v)
    return out


def _levels(modules: dict[str, Module], cycles: list[list[str]]) -> dict[str, int]:
    """Each module's level over all arrows, lazy ones included; a cycle's modules share one level."""
    group = {name: name for name in modules}
    for cycle in cycles:
        for name in cycle:
            group[name] = cycle[0]
    arrows: dict[str, set[str]] = {}
    for m in modules.values():
        arrows.setdefault(group[m.name], set()).update(group[t] for t in m.top | m.lazy if group[t] != group[m.name])
    levels: dict[str, int] = {}

    def level(g):
        if g not in levels:
            levels[g] = 1 + max((level(t) for t in arrows.get(g, ())), default=-1)
        return levels[g]

    return {name: level(group[name]) for name in modules}


def room(module: str, root: Path = ROOT) -> str:
    """The folder a module lives in (``autotune.search``, ``strategies``); a module at the top of ``autotune/`` is a
    room of its own (the recipe, the errors), but ``autotune/__main__.py``, which only runs the command line for
    ``python -m autotune``, is the command line's."""
    if module == "autotune.__main__":  # `python -m autotune`: the command line, by another name
        return "autotune.cli"
    parts = module.split(".")
    folder = parts[:-1] if len(parts) > 1 and not (root.joinpath(*parts) / "__init__.py").exists() else parts
    return module if folder == ["autotune"] else ".".join(folder)


def rooms(modules: dict[str, Module], root: Path = ROOT) -> dict:
    """The same measure a level up: which folders import which, their floors, and each arrow that runs back up
    (to a folder on the same or a higher floor: one that closes a cycle of folders)."""
    of = {name: room(name, root) for name in modules}
    folders = {r: Module(r, root, 0) for r in set(of.values())}
    for m in modules.values():
        folders[of[m.name]].top.update(of[t] for t in m.top | m.lazy if of[t] != of[m.name])
    floors = _levels(folders, _cycles(folders))
    back = sorted({f"{of[m.name]} -> {of[t]} ({m.name} imports {t})" for m in modules.values()
                   for t in m.top | m.lazy if of[t] != of[m.name] and floors[of[t]] >= floors[of[m.name]]})
    return {"rooms": len(folders), "floors": max(floors.values()) + 1, "arrows back up": back, "floor of": floors}


def shape(root: Path = ROOT) -> dict:
    """The figures main() prints, for the packages under ``root``."""
    modules = read(root)
    cycles = _cycles(modules)
    levels = _levels(modules, cycles)
    upward = sorted(f"{m.name} -> {t}" for m in modules.values() for t in m.top | m.lazy if levels[t] >= levels[m.name])
    functions = sorted(((f"{m.name}.{f}", n) for m in modules.values() for f, n in m.functions), key=lambda x: -x[1])
    return {
        "modules": len(modules),
        "import levels": max(levels.values()) + 1,
        "import arrows": sum(len(m.top) + len(m.lazy) for m in modules.values()),
        "cycles": cycles,
        "upward imports": upward,
        "private names imported across modules": sorted(f"{m.name}: {p}" for m in modules.values() for p in m.private),
        "longest function": functions[0] if functions else ("", 0),
        f"functions over {MAX_FUNCTION_LINES} lines": [f for f in functions if f[1] > MAX_FUNCTION_LINES],
        f"modules over {MAX_MODULE_LINES} lines": sorted(((m.name, m.lines) for m in modules.values()
                                                          if m.lines > MAX_MODULE_LINES), key=lambda x: -x[1]),
        **{f"folders: {k}": v for k, v in rooms(modules, root).items()},
        "levels": levels,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--detail", action="store_true", help="list each cycle, upward import, long function")
    args = parser.parse_args(argv)
    found = shape()
    for key, value in found.items():
        if key in ("levels", "folders: floor of"):
            continue
        count = value if isinstance(value, int) else (f"{value[0]} ({value[1]} lines)" if key == "longest function"
                                                      else len(value))
        print(f"{key:42s} {count}")
        if args.detail and isinstance(value, list):
            for item in value:
                print(f"    {item if not isinstance(item, tuple) else f'{item[0]} ({item[1]})'}")
    if args.detail:
        by_level: dict[int, list[str]] = {}
        for name, level in found["levels"].items():
            by_level.setdefault(level, []).append(name)
        for level in sorted(by_level):
            print(f"level {level:2d}: {' '.join(sorted(by_level[level]))}")
        by_floor: dict[int, list[str]] = {}
        for name, floor in found["folders: floor of"].items():
            by_floor.setdefault(floor, []).append(name)
        for floor in sorted(by_floor):
            print(f"floor {floor:2d}: {' '.join(sorted(by_floor[floor]))}")


if __name__ == "__main__":
    main()
