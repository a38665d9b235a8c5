"""Print ckptd's import graph by layer and fail on a cycle or an import that runs up the layers.

    python tools/import_graph.py            # the graph, then OK or the violations (exit 1)
    python tools/import_graph.py --quiet    # only violations

Every ``import``/``from ... import`` of a ckptd module counts, also those inside functions (a lazy
import is still a dependency). A module belongs to the first layer whose prefix matches its
dotted name; it may import modules of its own layer or of lower ones, and the module graph must
have no cycle. The daemon's pure state machines (``PURE``) import nothing that reaches a socket,
a thread, the clock or the file system (``IMPURE_IMPORTS``): their inputs come with the events.
CI runs this (``.ci/run``).
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "ckptd"

# Lowest first. Each entry: (layer name, module prefixes).
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("ckptd.errors", "ckptd.config", "ckptd.progress", "ckptd.dist", "ckptd.gcpause", "ckptd.procid")),
    ("vocabulary", ("ckptd.mapping",)),
    ("statedict", ("ckptd.statedict",)),
    ("format", ("ckptd.format",)),
    ("storage", ("ckptd.storage",)),
    ("loading", ("ckptd.loading",)),
    (
        "checkpoints",
        (
            "ckptd.lineage",
            "ckptd.catalog",
            "ckptd.s3catalog",
            "ckptd.recovery",
            "ckptd.retention",
            "ckptd.verifyreport",
            "ckptd.verify",
            "ckptd.verifyroot",
            "ckptd.describe",
            "ckptd.tune",
        ),
    ),
    ("roots", ("ckptd.roots",)),
    ("sync api", ("ckptd.opening", "ckptd.s3save", "ckptd.saveexchange", "ckptd.api", "ckptd.optim")),
    ("staging", ("ckptd.staging",)),
    ("control", ("ckptd.control",)),
    ("daemon", ("ckptd.daemon",)),
    ("client", ("ckptd.client",)),
    ("tools", ("ckptd.convert", "ckptd.commands", "ckptd.cli")),
    ("package", ("ckptd",)),
]


# Decisions as pure functions of events and time (``handle(event, now) -> actions``).
PURE = (
    "ckptd.daemon.commitstate",
    "ckptd.daemon.reportcheck",
    "ckptd.daemon.countedreports",
    "ckptd.daemon.uplinkstate",
    "ckptd.daemon.intakestate",
)
IMPURE_IMPORTS = ("zmq", "threading", "time", "os", "socket", "select", "concurrent", "subprocess", "asyncio")


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(module: str) -> int:
    for i, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return i
    raise SystemExit(f"{module} is in no layer; add it to LAYERS in {Path(__file__).name}")


def imports_of(path: Path, module: str, known: set[str]) -> set[str]:
    """The ckptd modules ``path`` imports (resolved to modules that exist)."""
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    for node in _runtime_nodes(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_pkg else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            # ``from pkg import mod`` imports pkg.mod; ``from pkg import name`` imports pkg.
            names = [f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in known else prefix for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module:
                out.add(name)
    return {m for m in out if m.startswith(PACKAGE)}


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node except those under ``if TYPE_CHECKING:`` (annotations only, never imported)."""
    out: list[ast.AST] = []
    todo = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo.extend(node.orelse)
            continue
        out.append(node)
        todo.extend(ast.iter_child_nodes(node))
    return out


def impure_imports(path: Path) -> set[str]:
    """The modules of ``IMPURE_IMPORTS`` that ``path`` imports (also inside functions)."""
    out: set[str] = set()
    for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names = [node.module]
        else:
            continue
        out.update(n for n in names if n.split(".")[0] in IMPURE_IMPORTS)
    return out


def graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in (ROOT / PACKAGE).rglob("*.py")}
    known = set(files)
    return {m: imports_of(p, m, known) for m, p in sorted(files.items())}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in g:
        if v not in index:
            visit(v)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quiet", action="store_true", help="print only violations")
    args = ap.parse_args()
    g = graph()
    # The package's __init__ re-exports the public API; only the tools on top of the package
    # (CLI commands, benchmarks, converters) may use it.
    tools = next(i for i, (name, _) in enumerate(LAYERS) if name == "tools")
    upward = [(m, d) for m, deps in g.items() for d in deps if d != PACKAGE and layer_of(d) > layer_of(m)]
    loops = cycles({m: {d for d in deps if d != PACKAGE} for m, deps in g.items()})
    into_init = [(m, PACKAGE) for m, deps in g.items() if PACKAGE in deps and layer_of(m) < tools]
    impure = [(m, sorted(impure_imports(ROOT / (m.replace(".", "/") + ".py")))) for m in PURE]
    impure = [(m, names) for m, names in impure if names]
    if not args.quiet:
        by_layer: dict[int, list[str]] = defaultdict(list)
        for m in g:
            by_layer[layer_of(m)].append(m)
        for i, (name, _) in enumerate(LAYERS):
            print(f"[{i}] {name}")
            for m in by_layer[i]:
                deps = ", ".join(sorted(d.removeprefix("ckptd.") for d in g[m])) or "-"
                print(f"    {m.removeprefix('ckptd.') or 'ckptd'} -> {deps}")
    for m, d in upward:
        print(f"UP: {m} ({LAYERS[layer_of(m)][0]}) imports {d} ({LAYERS[layer_of(d)][0]})")
    for m, _ in into_init:
        print(f"UP: {m} imports the package's __init__ (import the defining module instead)")
    for c in loops:
        print(f"CYCLE: {' -> '.join(c)}")
    for m, names in impure:
        print(f"IMPURE: {m} is a pure state machine but imports {', '.join(names)} (pass what it needs in events)")
    if upward or loops or into_init or impure:
        return 1
    if not args.quiet:
        print(f"OK: {len(g)} modules, {sum(map(len, g.values()))} imports, no cycle, nothing imported upward")
    return 0


if __name__ == "__main__":
    sys.exit(main())
