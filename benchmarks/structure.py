"""The package's shape, measured: large modules, long functions, long parameter lists, wide classes, import circles.

    .venv/bin/python benchmarks/structure.py [--json]

What docs/architecture.md's targets are held to: modules over 400 lines, functions over 60
lines, functions with 8 or more parameters (``self`` and ``cls`` not counted, public
constructors included), classes with more than 15 methods, and import circles inside the
package (from the module-level imports, ``TYPE_CHECKING`` blocks included: a circle there is
still a circle in the design; an import inside a function is a call, not a layer). Each
offender is listed by name, an overloaded function once.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys
from typing import Any

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "overlapckpt")
MODULE_LINES, FUNCTION_LINES, PARAMETERS, METHODS = 400, 60, 8, 15


def _module_name(path: str) -> str:
    relative = os.path.relpath(path, os.path.dirname(PACKAGE))[: -len(".py")].replace(os.sep, ".")
    return relative[: -len(".__init__")] if relative.endswith(".__init__") else relative


def _resolve(module: str, node: ast.ImportFrom, is_package: bool) -> str | None:
    if node.level == 0:
        return node.module
    parts = module.split(".")
    base = parts if is_package else parts[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _module_level_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """The imports a module runs when it is imported, and those of its ``if TYPE_CHECKING:`` blocks (not a function's)."""
    found: list[ast.Import | ast.ImportFrom] = []
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, (ast.If, ast.Try)):
            found.extend(n for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom)))
    return found


def scan() -> dict[str, Any]:
    modules: dict[str, str] = {}
    for root, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(root, name)
                modules[_module_name(path)] = path
    big_modules, long_functions, many_parameters, wide_classes = [], [], [], []
    graph: dict[str, set[str]] = {m: set() for m in modules}
    total_lines = 0
    for module, path in sorted(modules.items()):
        source = open(path).read()
        lines = source.count("\n")
        total_lines += lines
        if lines > MODULE_LINES:
            big_modules.append((module, lines))
        tree = ast.parse(source)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > FUNCTION_LINES:
                    long_functions.append((f"{module}.{node.name}", length))
                args = node.args
                names = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]
                count = len([n for n in names if n not in ("self", "cls")]) + bool(args.vararg) + bool(args.kwarg)
                if count >= PARAMETERS and (f"{module}.{node.name}", count) not in many_parameters:
                    many_parameters.append((f"{module}.{node.name}", count))
            elif isinstance(node, ast.ClassDef):
                methods = [n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
                if len(methods) > METHODS:
                    wide_classes.append((f"{module}.{node.name}", len(methods)))
        for node in _module_level_imports(tree):
            if isinstance(node, ast.ImportFrom):
                target = _resolve(module, node, path.endswith("__init__.py"))
                if target is None:
                    continue
                for alias in node.names:
                    for candidate in (f"{target}.{alias.name}", target):
                        if candidate in modules and candidate != module:
                            graph[module].add(candidate)
                            break
            else:
                for alias in node.names:
                    if alias.name in modules:
                        graph[module].add(alias.name)
    return {
        "modules": len(modules),
        "lines": total_lines,
        "modules_over_400_lines": sorted(big_modules, key=lambda x: -x[1]),
        "functions_over_60_lines": sorted(long_functions, key=lambda x: -x[1]),
        "functions_with_8_or_more_parameters": sorted(many_parameters, key=lambda x: -x[1]),
        "classes_with_more_than_15_methods": sorted(wide_classes, key=lambda x: -x[1]),
        "import_circles": _circles(graph),
    }


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    sys.setrecursionlimit(10_000)

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    report = scan()
    if args.json:
        print(json.dumps(report, indent=1))
        return
    print(f"{report['modules']} modules, {report['lines']:,} lines")
    for key in ("modules_over_400_lines", "functions_over_60_lines", "functions_with_8_or_more_parameters",
                "classes_with_more_than_15_methods"):
        items = report[key]
        print(f"{key.replace('_', ' ')}: {len(items)}")
        for name, value in items:
            print(f"  {value:4}  {name}")
    print(f"import circles: {len(report['import_circles'])}")
    for circle in report["import_circles"]:
        print("  " + " <-> ".join(circle))


if __name__ == "__main__":
    main()
