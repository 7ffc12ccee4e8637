"""The persistent compile cache (NOTE: [persistent compile cache], issue 16).

A second compiled step (as in a restarted job) loads the program the first one wrote and
computes exactly what the first one computed, and what one device computes eagerly; any
change the program depends on misses; broken entries are ignored with a warning; the
Python-value guards still fire on a loaded program.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import spmd_compiler as sc
from spmd_compiler import compile_cache
from spmd_compiler.parallel_modes import DataParallel
from spmd_compiler.tools.demo.steps import classification_train_step
from spmd_compiler.tools.parity import full_state, relative_difference

TOLERANCE = 1e-5
STEPS = 3


def mlp(hidden: int = 16) -> nn.Module:
    return nn.Sequential(nn.Linear(8, hidden), nn.ReLU(), nn.Linear(hidden, 4))


def adamw(m: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(m.parameters(), lr=1e-2)


def batches(batch_size: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(7)
    return [(torch.randn(batch_size, 8, generator=gen), torch.randint(0, 4, (batch_size,), generator=gen))
            for _ in range(STEPS)]


def run(
    cache_dir: Path | None,
    mode: Callable[[], object] = lambda: DataParallel("replicate"),
    make_model: Callable[[], nn.Module] = mlp,
    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer] = adamw,
    world_size: int = 2,
    **compile_options: object,
) -> tuple[sc.CompiledTrainStep, list[torch.Tensor], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = make_model()
    optimizer = make_optimizer(model)
    step = sc.compile(mode(), cache_dir=cache_dir, **compile_options)(classification_train_step)
    with sc.simulate(world_size=world_size) as sim:
        losses = [step(model, optimizer, x, y).detach().clone() for x, y in batches()]
        step.flush()
        state = full_state(model, optimizer, sim)
    return step, losses, state


def eager(make_model=mlp, make_optimizer=adamw) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = make_model()
    optimizer = make_optimizer(model)
    losses = [classification_train_step(model, optimizer, x, y).detach() for x, y in batches()]
    return losses, full_state(model, optimizer, None)


def caches(step: sc.CompiledTrainStep) -> list[str]:
    return [r.cache for r in step.records]


def entries(root: Path) -> set[str]:
    return {p.name for p in (root / "programs").glob("*.pt")}


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("extra_passes", [(), ("cross_iteration_overlap",)])
def test_hit_loads_the_same_program_and_matches_eager(tmp_path: Path, extra_passes) -> None:
    first, first_losses, first_state = run(tmp_path, extra_passes=extra_passes)
    # AdamW's state is made before the one program (NOTE: [optimizer state made before
    # the first program]); a restart makes it again and loads that program (NOTE:
    # [optimizer state made on a restart])
    assert caches(first) == ["miss"]
    assert len(entries(tmp_path)) == 1
    second, losses, state = run(tmp_path, extra_passes=extra_passes)
    assert caches(second) == ["hit"]
    assert second.timings.expand_seconds == 0.0 and second.timings.pass_seconds == 0.0
    assert second.timings.cache_load_seconds > 0.0
    assert first.timings.expand_seconds > 0.0
    # bit for bit what the compiled-here program computed, and eager's numbers
    assert all(torch.equal(a, b) for a, b in zip(first_losses, losses, strict=True))
    assert_same(first_state, state)
    ref_losses, ref_state = eager()
    assert max(relative_difference(a, b) for a, b in zip(losses, ref_losses, strict=True)) < TOLERANCE
    assert max(relative_difference(state[k], ref_state[k]) for k in ref_state) < TOLERANCE
    if extra_passes:
        assert second.last_program.deferred is not None


def fsdp_tp() -> object:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from spmd_compiler.parallel_modes.fsdp_tp import FullyShardTensorParallel

    return FullyShardTensorParallel(
        {"0": ColwiseParallel(), "2": RowwiseParallel()}, mesh_shape=(2, 2)
    )


@pytest.mark.slow
def test_fsdp_tp_2x2_hit_matches_eager(tmp_path: Path) -> None:
    first, first_losses, first_state = run(tmp_path, mode=fsdp_tp, world_size=4)
    assert caches(first) == ["miss"]
    second, losses, state = run(tmp_path, mode=fsdp_tp, world_size=4)
    assert caches(second) == ["hit"]
    assert all(torch.equal(a, b) for a, b in zip(first_losses, losses, strict=True))
    assert_same(first_state, state)
    ref_losses, ref_state = eager()
    assert max(relative_difference(a, b) for a, b in zip(losses, ref_losses, strict=True)) < TOLERANCE
    assert max(relative_difference(state[k], ref_state[k]) for k in ref_state) < TOLERANCE


CHANGES = [
    {"mode": lambda: DataParallel("fully_shard")},
    {"world_size": 4},
    {"make_optimizer": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, amsgrad=True)},
    {"make_optimizer": lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)},
    {"make_model": lambda: mlp(hidden=32)},
    {"disable_passes": ("bucket_collectives",)},
    "torch_version",
    "compiler_source",
]


@pytest.mark.parametrize(
    "change",
    CHANGES,
    ids=["mode", "mesh", "amsgrad", "optimizer", "model_shape", "passes", "torch", "source"],
)
def test_a_change_misses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change) -> None:
    run(tmp_path)
    written = entries(tmp_path)
    kwargs = change if isinstance(change, dict) else {}
    if change == "torch_version":
        monkeypatch.setattr(torch, "__version__", torch.__version__ + "+other")
    if change == "compiler_source":
        monkeypatch.setattr(compile_cache, "source_digest", lambda: "another compiler")
    step, losses, state = run(tmp_path, **kwargs)
    # SGD with momentum makes its state in its first program: two programs
    assert caches(step) == ["miss"] * (2 if change is CHANGES[3] else 1)
    assert len(entries(tmp_path) - written) == len(step.records)


def test_rank_is_not_in_the_key_but_the_mesh_is(tmp_path: Path) -> None:
    """NOTE: [one program for every rank]: the world size changes the key (above); a
    second run with the same world hits."""
    run(tmp_path, world_size=4)
    step, _, _ = run(tmp_path, world_size=4)
    assert caches(step) == ["hit"]


@pytest.mark.parametrize("damage", ["garbage", "truncated", "other_key"])
def test_a_broken_entry_warns_and_recompiles(tmp_path: Path, damage: str) -> None:
    _, first_losses, first_state = run(tmp_path)
    (path,) = (tmp_path / "programs").glob("*.pt")
    if damage == "garbage":
        path.write_bytes(b"not a cache entry")
    elif damage == "truncated":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    else:  # the file holds another step's program: its stored key does not match
        run(tmp_path / "other", make_model=lambda: mlp(hidden=32))
        (other,) = (tmp_path / "other" / "programs").glob("*.pt")
        path.write_bytes(other.read_bytes())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step, losses, state = run(tmp_path)
    # one warning (NOTE: [one warning per broken entry]): the entry is read by the key
    # before capture and again after it, and each read warned; its reason ends at a
    # sentence end, where a cut at 200 characters ended "your checkpoint file is"
    (warned,) = [str(w.message) for w in caught if "ignoring the" in str(w.message)]
    assert "ignoring the compile-cache entry" in warned
    assert warned.endswith(". Compiling the step again."), warned
    assert caches(step) == ["miss"]
    assert all(torch.equal(a, b) for a, b in zip(first_losses, losses, strict=True))
    assert_same(first_state, state)
    step, _, _ = run(tmp_path)  # the entries were rewritten
    assert caches(step) == ["hit"]


def test_a_broken_step_entry_warns_once_and_recompiles(tmp_path: Path) -> None:
    """A truncated step entry was logged (``log.warning``) with torch's reason cut at 200
    characters, mid-sentence; now one UserWarning, as a broken program entry."""
    _, first_losses, _ = run(tmp_path)
    (path,) = (tmp_path / "steps").glob("*.pt")
    path.write_bytes(path.read_bytes()[:1000])  # torch's reader: "... is corrupted" in one long line
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step, losses, _ = run(tmp_path)
    (warned,) = [str(w.message) for w in caught if "ignoring the" in str(w.message)]
    assert f"ignoring the step entry {path}: ValueError:" in warned
    assert warned.endswith("the file was damaged. Compiling the step again."), warned
    assert all(torch.equal(a, b) for a, b in zip(first_losses, losses, strict=True))


@pytest.mark.parametrize("kind", ["programs", "steps"])
def test_a_flipped_bit_in_an_entry_warns_once_and_recompiles(tmp_path: Path, kind: str) -> None:
    """One bit of a constant in the stored JSON (0.01 -> 0.00: AdamW's weight decay)
    loaded silently and trained another program before entries carried their SHA-256
    (NOTE: [cache entries carry their SHA-256]); now the entry warns once and is a miss."""
    _, first_losses, first_state = run(tmp_path)
    (path,) = (tmp_path / kind).glob("*.pt")
    raw = bytearray(path.read_bytes())
    at = raw.find(b"0.01")
    assert at > 0, "no constant 0.01 in the entry"
    raw[at + 3] ^= 0x01  # "1" -> "0": one bit, the zip's stored member is not checked
    path.write_bytes(bytes(raw))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step, losses, state = run(tmp_path)
    (warned,) = [str(w.message) for w in caught if "ignoring the" in str(w.message)]
    assert str(path) in warned and "do not match its SHA-256" in warned, warned
    # a damaged step entry costs the capture; the program entry, intact, is still a hit
    assert caches(step) == ["miss" if kind == "programs" else "hit"]
    assert not step.records[0].capture_skipped
    assert all(torch.equal(a, b) for a, b in zip(first_losses, losses, strict=True))
    assert_same(first_state, state)
    step, _, _ = run(tmp_path)  # rewritten whole
    assert caches(step) == ["hit"] and step.records[0].capture_skipped


def test_short_reason_cuts_at_a_sentence_or_a_space() -> None:
    long = "first sentence. " + "word " * 80
    assert compile_cache.short_reason(ValueError(long)) == "ValueError: first sentence."
    assert compile_cache.short_reason(ValueError("x" * 10 + " " + "y" * 300)) == "ValueError: xxxxxxxxxx ..."
    assert compile_cache.short_reason(OSError("line one\nline two")) == "OSError: line one"


def test_an_unreadable_entry_warns_and_misses(tmp_path: Path) -> None:
    """Only a missing entry was a miss; any other error reading one (another user's file,
    a directory in its place) failed the step, though the cache only saves time."""
    _, first_losses, _ = run(tmp_path)
    written = sorted(tmp_path.glob("*/*.pt"))
    assert {p.parent.name for p in written} == {"programs", "steps", "states"}
    for path in written:
        path.unlink()
        path.mkdir()  # reading it raises IsADirectoryError (a PermissionError as root would not)
    with pytest.warns(UserWarning, match="could not read the compile cache entry"):
        step, losses, _ = run(tmp_path)
    assert caches(step) == ["miss"]
    assert all(torch.equal(a, b) for a, b in zip(first_losses, losses, strict=True))


def test_entries_get_the_mode_of_a_plain_file(tmp_path: Path) -> None:
    """Entries were 0600 (tempfile.mkstemp): a cache shared by several users was readable
    by its writer alone. Now 0666 less the umask, as ``open`` makes files."""
    old = os.umask(0o027)
    try:
        run(tmp_path)
    finally:
        os.umask(old)
    modes = {oct(p.stat().st_mode & 0o777) for p in tmp_path.glob("*/*.pt")}
    assert modes == {oct(0o640)}


def test_a_cache_dir_that_is_a_file_is_refused_at_compile(tmp_path: Path) -> None:
    file = tmp_path / "not_a_dir"
    file.write_text("x")
    with pytest.raises(sc.SPMDCompileError, match="is an existing file"):
        sc.compile(DataParallel("replicate"), cache_dir=file)(classification_train_step)


def test_entries_are_decoded_with_the_collector_paused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NOTE: [no collector while an entry is decoded]: the step entry and each program
    are decoded with CPython's cyclic collector off, and it is back on after, also when a
    decode fails; a collector the user turned off stays off."""
    import gc

    from spmd_compiler import step_key

    run(tmp_path)
    seen: list[tuple[str, bool]] = []
    for module, name in ((compile_cache, "program_from_bytes"), (step_key, "_captured")):
        original = getattr(module, name)

        def watched(*args, _original=original, _name=name, **kwargs):
            seen.append((_name, gc.isenabled()))
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, name, watched)
    step, _, _ = run(tmp_path)
    assert caches(step) == ["hit"]
    # the step entry is read where the process has a key before capture (alone, it has;
    # in a worker that loaded a module since changed or deleted it may not): the program
    # entries are decoded either way
    assert "program_from_bytes" in {n for n, _ in seen}
    assert not any(enabled for _, enabled in seen)
    assert gc.isenabled()
    for p in (tmp_path / "programs").glob("*.pt"):
        p.write_bytes(b"not a cache entry")
    with pytest.warns(UserWarning, match="ignoring the compile-cache entry"):
        run(tmp_path)
    assert gc.isenabled()
    gc.disable()
    try:
        with compile_cache.collector_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


class Tempered(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)
        self.temperature = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) / self.temperature


def test_guards_fire_on_a_loaded_program(tmp_path: Path) -> None:
    run(tmp_path, make_model=Tempered)
    torch.manual_seed(0)
    model = Tempered()
    reference = copy.deepcopy(model)
    optimizer, ref_optimizer = adamw(model), adamw(reference)
    step = sc.compile(DataParallel("replicate"), cache_dir=tmp_path)(classification_train_step)
    differences = []
    with sc.simulate(world_size=2) as sim:
        for i, (x, y) in enumerate(batches()):
            if i == 2:  # a new value: the loaded program's guard fails, a new one compiles
                model.temperature = reference.temperature = 4.0
            loss = step(model, optimizer, x, y)
            expected = classification_train_step(reference, ref_optimizer, x, y)
            differences.append(relative_difference(loss, expected))
        state = full_state(model, optimizer, sim)
    assert caches(step) == ["hit", "miss"]
    assert max(differences) < TOLERANCE
    ref_state = full_state(reference, ref_optimizer, None)
    assert max(relative_difference(state[k], ref_state[k]) for k in ref_state) < TOLERANCE


class WithCallable(DataParallel):
    """A mode holding code the key cannot describe."""

    def __init__(self) -> None:
        super().__init__("replicate")
        self.hook = lambda: None


def test_a_mode_holding_code_is_not_cached(tmp_path: Path) -> None:
    step, losses, _ = run(tmp_path, mode=WithCallable)
    assert caches(step) == ["uncacheable"]  # one program: no key before capture either
    assert not entries(tmp_path) if (tmp_path / "programs").exists() else True


def test_off_without_a_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(compile_cache.CACHE_ENV, raising=False)
    step, _, _ = run(None)
    assert caches(step) == ["off"]  # NOTE: [optimizer state made before the first program]
    monkeypatch.setenv(compile_cache.CACHE_ENV, str(tmp_path))
    step, _, _ = run(None)
    assert caches(step) == ["miss"] and len(entries(tmp_path)) == 1


RESTART_SCRIPT = textwrap.dedent(
    """
    import json, sys, time
    import torch, torch.nn as nn
    import spmd_compiler as sc
    from spmd_compiler.tools.demo.steps import classification_train_step
    from spmd_compiler.parallel_modes import DataParallel
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = sc.compile(DataParallel("fully_shard"), cache_dir=sys.argv[1])(classification_train_step)
    gen = torch.Generator().manual_seed(7)
    losses = []
    with sc.simulate(world_size=2):
        for _ in range(3):
            x, y = torch.randn(8, 8, generator=gen), torch.randint(0, 4, (8,), generator=gen)
            losses.append(float(step(model, optim, x, y)))
    r = step.records
    print(json.dumps({"cache": [x.cache for x in r], "losses": losses,
                      "compile": [x.total_seconds for x in r],
                      "capture": [x.capture_seconds for x in r],
                      "load": [x.cache_load_seconds for x in r]}))
    """
)


def test_a_restarted_process_loads_the_program(tmp_path: Path) -> None:
    script = tmp_path / "restart.py"
    script.write_text(RESTART_SCRIPT)
    # older than the processes: a file written within their first second may have changed
    # after its module loaded, which leaves the step without a key before capture
    past = time.time() - 3600
    os.utime(script, (past, past))
    env = {k: v for k, v in os.environ.items() if k != compile_cache.CACHE_ENV}
    runs = []
    for _ in range(2):
        out = subprocess.run(
            [sys.executable, str(script), str(tmp_path / "cache")],
            capture_output=True, text=True, env=env, timeout=600, check=True,
        )
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    first, second = runs
    assert first["cache"] == ["miss"] and second["cache"] == ["hit"]
    assert second["capture"] == [0.0]  # the state made from the state entry, no trace
    assert first["losses"] == second["losses"]  # bit for bit
    print(f"first compile {sum(first['compile']):.2f} s, restart {sum(second['compile']):.2f} s "
          f"(capture {sum(second['capture']):.2f} s, load {sum(second['load']):.2f} s)")
    # a hit skips expansion and the passes: well under the first compile
    assert sum(second["compile"]) < sum(first["compile"])


USER_MODE = '''
from spmd_compiler.parallel_modes import DataParallel


class UserMode(DataParallel):
    """A user's mode: its code is not the compiler's, so its source is in the key."""

    def __init__(self):
        super().__init__("replicate")
'''


def test_a_user_mode_class_is_keyed_by_its_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = tmp_path / "user_mode_for_cache_test.py"
    source.write_text(USER_MODE)
    monkeypatch.syspath_prepend(str(tmp_path))
    import user_mode_for_cache_test as user

    cache = tmp_path / "cache"
    try:
        assert caches(run(cache, mode=user.UserMode)[0]) == ["miss"]
        assert caches(run(cache, mode=user.UserMode)[0]) == ["hit"]
        source.write_text(USER_MODE + "\n# edited: placement_of could have changed\n")
        assert caches(run(cache, mode=user.UserMode)[0]) == ["miss"]
    finally:
        # edited while loaded: left loaded, it would keep every later test's step from a
        # key before capture (step_key refuses a loaded module whose source changed)
        sys.modules.pop("user_mode_for_cache_test", None)
