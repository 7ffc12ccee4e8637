"""Every code block of the README and docs/, and every examples/ script, runs (short
settings): python blocks are executed, shell commands of the package's command line
parsed, make targets looked up, relative links resolved.

A python block that cannot run alone says so on the line before it:
``<!-- not run: REASON -->``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from spmd_compiler.__main__ import build_parser

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
EXAMPLES = sorted(p for p in (ROOT / "examples").glob("*.py") if not p.name.startswith("_"))
FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>\w*)[ \t]*$")
SKIP = re.compile(r"<!--\s*not run:\s*(?P<reason>.+?)\s*-->")


def _blocks(path: Path) -> list[tuple[str, int, str, str | None]]:
    """(language, first line number, code, skip reason) of every fenced block."""
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        start = FENCE.match(lines[i])
        if not start or not start["lang"]:
            i += 1
            continue
        indent = len(start["indent"])
        skip = SKIP.search(lines[i - 1]) if i else None
        j = i + 1
        while not FENCE.match(lines[j]):
            j += 1
        code = "\n".join(line[indent:] for line in lines[i + 1 : j])
        blocks.append((start["lang"], i + 1, code, skip["reason"] if skip else None))
        i = j + 1
    return blocks


def _cases(lang: str) -> list:
    return [
        pytest.param(code, reason, id=f"{path.relative_to(ROOT)}:{line}")
        for path in DOCS
        for block_lang, line, code, reason in _blocks(path)
        if block_lang == lang
    ]


@pytest.mark.parametrize("code, skip_reason", _cases("python"))
def test_python_block_runs(code: str, skip_reason: str | None) -> None:
    if skip_reason:
        pytest.skip(skip_reason)
    exec(compile(code, "<doc block>", "exec"), {"__name__": "__doc_block__"})  # noqa: S102


@pytest.mark.parametrize("code, skip_reason", _cases("bash"))
def test_shell_block_commands_exist(code: str, skip_reason: str | None) -> None:
    makefile = (ROOT / "Makefile").read_text()
    for line in code.splitlines():
        command = line.split("#", 1)[0].strip()
        if command.startswith("make "):
            target = command.split()[1]
            assert re.search(rf"^{re.escape(target)}:", makefile, re.M), f"no make target {target}"
        elif command.startswith("python -m spmd_compiler"):
            argv = command.split()[3:]
            build_parser().parse_args(argv)  # exits (fails the test) on a bad option


def test_every_relative_link_resolves() -> None:
    missing = []
    for path in [*DOCS, *ROOT.glob("examples/**/*.md")]:
        for target in re.findall(r"\]\(([^)#\s]+)", path.read_text()):
            if "://" in target:
                continue
            if not (path.parent / target).exists():
                missing.append(f"{path.relative_to(ROOT)} -> {target}")
    assert not missing


def test_package_docstring_points_inside_the_repository() -> None:
    import spmd_compiler

    assert "docs/design.md" in spmd_compiler.__doc__ and (ROOT / "docs" / "design.md").exists()
    assert "shared/DESIGN.md" not in (ROOT / "README.md").read_text()


def _run_example(args: list[str], timeout: int = 900) -> str:
    env = {**os.environ, "SPMD_PROGRESS": "0"}
    done = subprocess.run(
        args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Traceback" not in done.stderr and "Warning" not in done.stderr, done.stderr
    return done.stdout


@pytest.mark.slow  # a fresh process per script: 15-45 s each on a 2-core machine
@pytest.mark.parametrize(
    "script",
    [p for p in EXAMPLES if not p.name.startswith("torchrun_")],  # torchrun's: tests/dist
    ids=lambda p: p.name,
)
def test_example_script_runs_and_matches_one_device(script: Path) -> None:
    out = _run_example([sys.executable, str(script), "--steps", "1", "--world-size", "2"])
    assert "max relative loss difference" in out


@pytest.mark.dist
def test_torchrun_example_on_two_gloo_ranks() -> None:
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    if torchrun is None:
        pytest.skip("torchrun is not installed next to this interpreter")
    out = _run_example(
        [torchrun, "--standalone", "--nproc-per-node", "2", "examples/torchrun_ddp.py", "--steps", "2"]
    )
    assert "max relative loss difference" in out
    assert "validation: compiled" in out  # a compiled step without an optimizer
