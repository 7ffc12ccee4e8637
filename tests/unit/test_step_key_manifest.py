"""The step key's module manifest (NOTE: [cache key before capture]): which loaded
modules count as sources of the step."""

from __future__ import annotations

import sys
from types import ModuleType

import pytest

from spmd_compiler.step_key import Uncacheable, module_manifest


@pytest.fixture(autouse=True)
def without_other_tests_modules(monkeypatch: pytest.MonkeyPatch, tmp_path_factory) -> None:
    """Modules other tests wrote under pytest's temporary directory (plugins, steps) are
    hidden from the manifest here; they are restored afterwards."""
    base = str(tmp_path_factory.getbasetemp())
    for name, module in list(sys.modules.items()):
        if str(getattr(module, "__file__", None) or "").startswith(base):
            monkeypatch.delitem(sys.modules, name)


def _generated(monkeypatch: pytest.MonkeyPatch, folder, name: str, file: str = "generated.py") -> str:
    """A module made by exec of a file written after this process started (as Inductor
    loads the kernels it generates)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / file
    path.write_text("x = 1\n")
    module = ModuleType(name)
    module.__file__ = str(path)
    monkeypatch.setitem(sys.modules, name, module)
    return str(path)


def test_kernels_inductor_generated_are_not_sources_of_the_step(tmp_path, monkeypatch) -> None:
    """After any Inductor compile in the process (backend="inductor", torch.compile), its
    generated modules were taken for user files edited while loaded, and no later step
    got a cache entry."""
    path = _generated(monkeypatch, tmp_path, "torch._inductor.runtime.compile_tasks.ckey")
    assert all(entry[0] != path for entry in module_manifest())


def test_a_user_module_written_while_the_process_runs_still_refuses(tmp_path, monkeypatch) -> None:
    _generated(monkeypatch, tmp_path, "generated_by_the_user")
    with pytest.raises(Uncacheable, match="changed since it was loaded"):
        module_manifest()


def test_compiled_kernel_libraries_in_inductors_cache_are_not_sources(tmp_path, monkeypatch) -> None:
    """Inductor's C++ kernels load as extension modules named ``<key>.kernel`` from its
    cache directory (``TORCHINDUCTOR_CACHE_DIR`` here)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    path = _generated(monkeypatch, tmp_path / "inductor" / "ab", "cabkey.kernel", "cabkey.main.so")
    assert all(entry[0] != path for entry in module_manifest())


def test_kernels_in_inductors_default_cache_stay_skipped_when_the_variable_moves(tmp_path, monkeypatch) -> None:
    """A kernel loaded from Inductor's default cache stays loaded after
    ``TORCHINDUCTOR_CACHE_DIR`` points elsewhere (a later compile in another cache, a
    test's own directory); it was taken for a user file (CI failure of 2026-11-24)."""
    import torch._inductor.runtime.cache_dir_utils as cache_dir_utils

    monkeypatch.setattr(cache_dir_utils, "default_cache_dir", lambda: str(tmp_path / "default"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "elsewhere"))
    path = _generated(monkeypatch, tmp_path / "default" / "cd", "cdkey.kernel", "cdkey.main.so")
    assert all(entry[0] != path for entry in module_manifest())
