"""The private-API rule (STYLE.md, DESIGN.md "Private torch APIs"): every private torch
name the library uses is reached through ``spmd_compiler/_torch_private.py``, so a torch
upgrade touches one file. Checked on the syntax tree of every library module: imports of a
torch module or name with a ``_``-prefixed part, and attribute chains ``torch.a._b``.
ATen operators (``torch.ops.aten._to_copy``) are op names of the graphs, not private
Python APIs, and are allowed."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = ("spmd_compiler", "passes", "parallel_modes")
GATEWAY = ROOT / "spmd_compiler" / "_torch_private.py"


def _is_private(parts: list[str]) -> bool:
    return any(p.startswith("_") and not (p.startswith("__") and p.endswith("__")) for p in parts)


def _attribute_chain(node: ast.Attribute) -> list[str] | None:
    parts: list[str] = []
    current: ast.expr = node
    while isinstance(current, ast.Attribute):
        parts.append(current.attr)
        current = current.value
    if isinstance(current, ast.Name) and current.id == "torch":
        return ["torch", *reversed(parts)]
    return None


def private_uses(source: str) -> list[tuple[int, str]]:
    """(line, dotted name) of each private torch API the source reaches directly."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names
                      if a.name.split(".")[0] == "torch" and _is_private(a.name.split("."))]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            parts = node.module.split(".")
            if parts[0] != "torch":
                continue
            if _is_private(parts):
                found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names
                      if _is_private([a.name])]
        elif isinstance(node, ast.Attribute):
            chain = _attribute_chain(node)
            if chain and chain[:3] != ["torch", "ops", "aten"] and _is_private(chain[1:]):
                found.append((node.lineno, ".".join(chain)))
    return sorted(set(found))


def _library_files() -> list[Path]:
    return sorted(p for d in LIBRARY for p in (ROOT / d).rglob("*.py") if p != GATEWAY)


def test_rule_catches_each_form() -> None:
    source = (
        "import torch\nimport torch._dynamo\nfrom torch.utils import _pytree\n"
        "from torch._decomp import get_decompositions\nx = torch.ops._c10d_functional\n"
        "y = torch.__version__\nz = torch.nn.functional.relu\nw = torch.ops.aten._to_copy\n"
    )
    assert [name for _, name in private_uses(source)] == [
        "torch._dynamo", "torch.utils._pytree", "torch._decomp", "torch.ops._c10d_functional",
    ]


@pytest.mark.parametrize("path", _library_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_library_reaches_private_torch_only_through_the_gateway(path: Path) -> None:
    uses = private_uses(path.read_text())
    assert not uses, (
        f"{path.relative_to(ROOT)} uses private torch APIs directly: "
        + ", ".join(f"line {line}: {name}" for line, name in uses)
        + "; add a function to spmd_compiler/_torch_private.py and call it instead"
    )
