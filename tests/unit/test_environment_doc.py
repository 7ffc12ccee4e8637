"""docs/environment.md lists every environment variable the code reads.

It said "Every environment variable the package reads" but missed
SPMD_COMPILER_CACHE_DIR and SPMD_TEST_BACKEND, and "the benchmarks and tests read none
beyond these" while the tests read SPMD_SLOW_TESTS and SPMD_FUZZ_EXAMPLES; the command
line's --help and the README's "Daily use" bullet had the same short list. The names are
found in the code here (``os.environ.get("X")``, ``os.environ["X"]``, ``os.getenv("X")``,
``"X" in os.environ``, ``X_ENV = "X"``), so a new one fails this test until documented.
A variable a test sets itself to test the capture's environment guards
(``monkeypatch.setenv`` in the same file) is that test's own, not listed.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from spmd_compiler.__main__ import build_parser

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ("spmd_compiler", "passes", "parallel_modes")
ALSO = ("benchmarks", "tests", "examples")
NAME = re.compile(r"[A-Z][A-Z0-9_]*\Z")


def _is_environ(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or (
        isinstance(node, ast.Name) and node.id == "environ"
    )


def _names_read(source: str) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        texts: list[ast.AST] = []
        if isinstance(node, ast.Call) and node.args and isinstance(node.func, ast.Attribute):
            if (node.func.attr in ("get", "pop", "setdefault") and _is_environ(node.func.value)) or (
                node.func.attr == "getenv"
            ):
                texts.append(node.args[0])
        elif isinstance(node, ast.Subscript) and _is_environ(node.value):
            texts.append(node.slice)
        elif isinstance(node, ast.Compare) and any(_is_environ(c) for c in node.comparators):
            texts.append(node.left)
        elif isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id.endswith("_ENV") for t in node.targets
        ):
            texts.append(node.value)
        found |= {
            t.value for t in texts
            if isinstance(t, ast.Constant) and isinstance(t.value, str) and NAME.match(t.value)
        }
    return found


def _set_by_the_file(source: str) -> set[str]:
    return set(re.findall(r"monkeypatch\.(?:setenv|delenv)\(\s*[\"']([A-Z][A-Z0-9_]*)[\"']", source))


def names_read(tops: tuple[str, ...]) -> dict[str, str]:
    """Variable name -> the first file reading it."""
    found: dict[str, str] = {}
    for top in tops:
        for path in sorted((ROOT / top).rglob("*.py")):
            source = path.read_text()
            for name in sorted(_names_read(source) - _set_by_the_file(source)):
                found.setdefault(name, str(path.relative_to(ROOT)))
    return found


def test_the_scan_finds_what_it_should() -> None:
    package = names_read(PACKAGE)
    for name in ("SPMD_PROGRESS", "SPMD_COMPILER_CACHE_DIR", "SPMD_TEST_BACKEND",
                 "SPMD_DISABLE_PASSES", "SPMD_DEBUG", "SPMD_LOG_LEVEL", "CI", "RANK"):
        assert name in package, name
    also = names_read(ALSO)
    assert {"SPMD_SLOW_TESTS", "SPMD_FUZZ_EXAMPLES"} <= set(also)
    assert "SPMD_TEST_LOSS_WEIGHT" not in also  # set by its own test


def test_environment_md_lists_every_variable_read() -> None:
    doc = (ROOT / "docs" / "environment.md").read_text()
    listed = set(re.findall(r"`([A-Z][A-Z0-9_]*)`", doc))
    missing = {n: f for n, f in {**names_read(ALSO), **names_read(PACKAGE)}.items() if n not in listed}
    assert not missing, f"read but not in docs/environment.md: {missing}"


def test_help_and_readme_name_every_package_variable() -> None:
    ours = {n for n in names_read(PACKAGE) if n.startswith("SPMD_")}
    helped = build_parser().format_help()
    assert not ours - set(re.findall(r"SPMD_[A-Z0-9_]+", helped)), ours
    readme = (ROOT / "README.md").read_text()
    start = readme.index("- Environment variables (")
    bullet = readme[start: readme.index("\n\n", start)]
    assert "docs/environment.md" in bullet
    assert not ours - set(re.findall(r"SPMD_[A-Z0-9_]+", bullet)), bullet
