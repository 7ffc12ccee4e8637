"""The command line: choices, one-line errors with exit code 2, --version, torch-free --help."""

from __future__ import annotations

import subprocess
import sys

import pytest

import spmd_compiler
from spmd_compiler.__main__ import main


@pytest.mark.parametrize(
    "argv, message",
    [
        (["demo", "--mode", "foo"], "invalid choice: 'foo'"),
        (["demo", "--world-size", "0"], "0 must be at least 1"),
        (["demo", "--steps", "two"], "'two' is not a whole number"),
        (["demo", "--mesh", "2y2"], "'2y2' is not a DPxTP mesh"),
        (["demo", "--mesh", "2x2"], "--mesh is for --mode fsdp_tp"),
        (["demo", "--world-size", "3"], "--batch-size 16 does not split over 3"),
        (["demo", "--dropout", "1.5"], "1.5 is not in [0, 1)"),
        (["explain", "--mode", "fsdp_tp", "--world-size", "3"], "needs an even --world-size"),
        # ran at 4 ranks, the explicit 6 dropped
        (["explain", "--mode", "fsdp_tp", "--mesh", "2x2", "--world-size", "6"],
         "--world-size 6 contradicts --mesh 2x2 (4 ranks)"),
        (["demo", "--mode", "tp", "--world-size", "64", "--backend", "nccl"],
         "--backend nccl runs one rank per CUDA device: 64 ranks need 64 devices"),
    ],
)
def test_bad_options_end_in_one_error_line_and_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    error_lines = [line for line in err.splitlines() if "error:" in line]
    assert len(error_lines) == 1 and message in error_lines[0], err
    assert "Traceback" not in err


def test_bad_log_level_is_a_usage_error(monkeypatch, capsys):
    monkeypatch.setenv("SPMD_LOG_LEVEL", "LOUD")
    with pytest.raises(SystemExit) as exit_info:
        main(["explain"])
    assert exit_info.value.code == 2
    assert "SPMD_LOG_LEVEL='LOUD' is not a logging level" in capsys.readouterr().err


def test_version_matches_the_package(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip().endswith(spmd_compiler.__version__)
    assert spmd_compiler.__version__.count(".") >= 1 or spmd_compiler.__version__ == "0+unknown"


def test_help_lists_every_option_with_help_and_does_not_import_torch():
    code = (
        "import sys\n"
        "from spmd_compiler.__main__ import main\n"
        "for argv in (['--help'], ['demo', '--help'], ['explain', '--help']):\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "print('torch imported:', 'torch' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert "torch imported: False" in out
    for option in ("--mode", "--world-size", "--steps", "--mesh", "--backend", "--batch-size",
                   "--dropout", "--seed", "--json", "--layers", "--dump", "--version"):
        assert option in out, option
    assert "dtensor_expand" in out and "default 8" in out


def test_public_names_load_on_first_use():
    import spmd_compiler.runtime.launch  # noqa: F401  (the submodule must not hide the function)

    assert callable(spmd_compiler.compile) and callable(spmd_compiler.simulate)
    assert callable(spmd_compiler.launch)
    assert "compile" in dir(spmd_compiler)
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        spmd_compiler.nothing  # noqa: B018


def test_checkpoint_is_importable_by_the_path_the_readme_gives():
    """``spmd_compiler.checkpoint.save/load/full_state_dict`` (README) was only an
    attribute: ``from spmd_compiler.checkpoint import ...`` failed (ModuleNotFoundError)."""
    import spmd_compiler.checkpoint as by_path
    from spmd_compiler.checkpoint import CheckpointError, full_state_dict, load, save
    from spmd_compiler.runtime import checkpoint as defined

    assert spmd_compiler.checkpoint is by_path
    assert (full_state_dict, load, save, CheckpointError) == (
        defined.full_state_dict, defined.load, defined.save, defined.CheckpointError)
    assert sorted(by_path.__all__) == sorted(defined.__all__)
