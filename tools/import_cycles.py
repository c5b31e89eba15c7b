"""Count the package's import cycles and the imports that break its layering; exit 1 if any.

Reads every module's imports from its source (module level and inside functions alike: an
import hidden in a function still ties two modules together) and checks:
- cycles among the package's modules (strongly connected components of the import graph);
- the layers: ``constraints`` and ``model`` never import each other, ``decoding`` imports
  neither the top (``generator``, ``cli``, ``server``, ``jobs``, ``testing``) nor anything
  above it, and no layer imports the top.

    python tools/import_cycles.py            # CI runs it
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "constrained_spec"
# what each layer may import from the package (the modules at the package's root: errors)
ALLOWED = {
    "constraints": {"constraints", "errors"},
    "model": {"model", "errors"},
    "decoding": {"decoding", "constraints", "model", "errors"},
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, name: str) -> set[str]:
    """The package modules ``path`` imports (relative imports resolved)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("constrained_spec")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            if base.startswith("constrained_spec"):
                found.add(base)
                found |= {f"{base}.{a.name}" for a in node.names}
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module, or with a self-loop (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph[v]:
                out.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def main() -> int:
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in paths.items():
        found = imports(path, name)
        # `from .x import y` names y, a module or an attribute of x: keep the modules only, and
        # a package's __init__ only where nothing deeper was named
        graph[name] = {m for m in found if m in paths and m != name} - {
            m for m in found if any(o.startswith(m + ".") for o in found if o in paths)
        }
    problems = [f"cycle: {' -> '.join(c)}" for c in cycles(graph)]
    for name, targets in sorted(graph.items()):
        layer = name.split(".")[1] if "." in name else None
        for target in sorted(targets):
            other = target.split(".")[1] if "." in target else None
            if layer in ALLOWED and other not in ALLOWED[layer]:
                problems.append(f"layering: {name} imports {target}")
    print(f"{len(graph)} modules, {sum(map(len, graph.values()))} imports inside the package")
    for problem in problems:
        print(problem)
    print(
        f"{sum(p.startswith('cycle') for p in problems)} import cycles, "
        f"{sum(p.startswith('layering') for p in problems)} layering violations"
    )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
