"""Every test's own bounds on its ranks (``run_ranks(timeout_s=...)``, added up where a test runs
ranks several times) end before the test's timeout.

When the test's timeout (pytest-timeout, thread method) fires first, it ends the whole test worker:
CI then reports "worker crashed" and nothing of why (the stack dump goes to the worker's own
output). When ``run_ranks``' bound fires first, the test fails with the hung ranks' stacks and the
failed ranks' tracebacks. This reads the tests' source: it checks the calls a test function makes
itself, not those of its helpers."""

from __future__ import annotations

import ast
import inspect
import tomllib
from pathlib import Path

from tools.harness.ranks import FAILED_RANK_GRACE_S, STACK_DUMP_WAIT_S, run_ranks

_TESTS = Path(__file__).resolve().parents[1]
# What a test spends around its ranks' run: fixtures (a server, a saved root), starting the
# ranks, the harness's own reaping after its bound.
MARGIN_S = 20.0


def _timeout_marker(fn: ast.FunctionDef) -> float | None:
    for decorator in fn.decorator_list:
        if (
            isinstance(decorator, ast.Call)
            and isinstance(decorator.func, ast.Attribute)
            and decorator.func.attr == "timeout"
            and decorator.args
            and isinstance(decorator.args[0], ast.Constant)
        ):
            return float(decorator.args[0].value)
    return None


def _ranks_bounds(fn: ast.FunctionDef, default_s: float) -> list[tuple[int, float | None]]:
    """(line, timeout_s) of each ``run_ranks`` call in ``fn``; None where it is not a constant."""
    bounds = []
    for node in ast.walk(fn):
        if not isinstance(node, ast.Call):
            continue
        name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
        if name != "run_ranks":
            continue
        bound: float | None = default_s
        for keyword in node.keywords:
            if keyword.arg == "timeout_s":
                bound = float(keyword.value.value) if isinstance(keyword.value, ast.Constant) else None
        bounds.append((node.lineno, bound))
    return bounds


def _violations(tests: Path, ini_timeout_s: float, default_s: float) -> list[str]:
    found = []
    for path in sorted(tests.rglob("test_*.py")):
        for fn in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(fn, ast.FunctionDef) or not fn.name.startswith("test"):
                continue
            timeout_s = _timeout_marker(fn) or ini_timeout_s
            bounds = _ranks_bounds(fn, default_s)
            for line, bound in bounds:
                if bound is None:
                    found.append(f"{path.name}:{line} {fn.name}: run_ranks' timeout_s is not a constant")
            total_s = sum(bound or 0.0 for _, bound in bounds)
            if bounds and total_s + MARGIN_S > timeout_s:  # the runs one after the other
                lines = ",".join(str(line) for line, _ in bounds)
                found.append(f"{path.name}:{lines} {fn.name}: run_ranks for {total_s:g} s in a {timeout_s:g} s test")
    return found


def test_every_run_ranks_bound_ends_before_its_tests_timeout() -> None:
    config = tomllib.loads((_TESTS.parent / "pyproject.toml").read_text(encoding="utf-8"))
    ini_timeout_s = float(config["tool"]["pytest"]["ini_options"]["timeout"])
    default_s = inspect.signature(run_ranks).parameters["timeout_s"].default
    assert FAILED_RANK_GRACE_S + STACK_DUMP_WAIT_S < MARGIN_S
    assert _violations(_TESTS, ini_timeout_s, default_s) == []


def test_the_check_finds_a_bound_as_long_as_the_test(tmp_path: Path) -> None:
    (tmp_path / "test_x.py").write_text(
        "import pytest\n"
        "@pytest.mark.timeout(120)\n"
        "def test_a():\n"
        "    run_ranks(f, 2, timeout_s=120)\n"
        "@pytest.mark.timeout(120)\n"
        "def test_b():\n"
        "    run_ranks(f, 2)\n"
        "def test_c():\n"
        "    run_ranks(f, 2, timeout_s=T)\n"
        "@pytest.mark.timeout(180)\n"
        "def test_d():\n"
        "    run_ranks(f, 2)\n"
        "    run_ranks(f, 1)\n",
        encoding="utf-8",
    )
    assert _violations(tmp_path, 300.0, 90.0) == [
        "test_x.py:4 test_a: run_ranks for 120 s in a 120 s test",
        "test_x.py:9 test_c: run_ranks' timeout_s is not a constant",
        "test_x.py:12,13 test_d: run_ranks for 180 s in a 180 s test",
    ]
