"""``tools/`` runs without the test suite: nothing in it imports the ``tests`` package (the tests
import ``tools.harness``, never the other way round)."""

from __future__ import annotations

import ast
from pathlib import Path

TOOLS = Path(__file__).resolve().parents[2] / "tools"


def _imported_modules(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
    return found


def test_no_tool_imports_the_tests_package():
    files = sorted(TOOLS.rglob("*.py"))
    assert any(f.name == "crash_matrix.py" for f in files)
    offenders = {
        str(f.relative_to(TOOLS)): sorted(m for m in _imported_modules(f) if m == "tests" or m.startswith("tests."))
        for f in files
    }
    assert {f: m for f, m in offenders.items() if m} == {}
