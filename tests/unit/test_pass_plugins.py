"""Third-party passes through the entry-point group ``spmd_compiler.passes``.

Installing ``examples/custom_pass`` with pip would take seconds and change the
environment; instead each test writes the ``*.dist-info`` (METADATA + entry_points.txt)
that pip would write into a temporary folder on ``sys.path``, with the entry points read
from the example's own pyproject.toml, so ``importlib.metadata.entry_points`` finds the
plugin exactly as it finds an installed one.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import spmd_compiler as sc
from spmd_compiler.ir.collectives import collective_stats
from spmd_compiler.passes import (
    DEFAULT_PIPELINE,
    ENTRY_POINT_GROUP,
    CostModel,
    PassFailure,
    PassOptions,
    PipelineError,
    build_pipeline,
    is_collective,
    registered_passes,
)
from spmd_compiler.passes import registry as pass_registry
from spmd_compiler.tools.demo.steps import classification_train_step

tomllib = pytest.importorskip("tomllib")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "custom_pass"
PLUGIN_MODULES = ("spmd_count_collectives", "broken_passes_plugin", "late_passes_plugin")

BROKEN_PLUGIN = """
from spmd_compiler.passes import is_wait, register_pass


@register_pass("drop_waits", "reads collective results without waiting (deliberately wrong)")
def drop_waits(program, context):
    graph = program.graph_module.graph
    waits = [node for node in graph.nodes if is_wait(node)]
    for wait in waits:
        wait.replace_all_uses_with(wait.args[0])
        graph.erase_node(wait)
    return bool(waits)


def not_a_pass(program, context):
    return False
"""

LATE_PLUGIN = """
from spmd_compiler.passes import register_pass


@register_pass("late_noop", "registered by a package put on sys.path after the first build")
def late_noop(program, context):
    return False
"""


def _install(root: Path, name: str, entry_points: dict[str, str], module: str = "") -> None:
    """What ``pip install`` leaves behind: a dist-info folder (and the module, if given)."""
    info = root / f"{name.replace('-', '_')}-0.1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1.0\n")
    lines = [f"[{ENTRY_POINT_GROUP}]"] + [f"{k} = {v}" for k, v in entry_points.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    if module:
        module_name, source = module.split("\n", 1)
        (root / f"{module_name}.py").write_text(source)


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A fresh registry and plugin scan, with the example package 'installed' in tmp_path."""
    monkeypatch.setattr(pass_registry, "_REGISTRY", dict(pass_registry._REGISTRY))
    monkeypatch.setattr(pass_registry, "_PLUGINS", pass_registry._PluginState())
    for module in PLUGIN_MODULES:
        monkeypatch.delitem(sys.modules, module, raising=False)
    project = tomllib.loads((EXAMPLE / "pyproject.toml").read_text())["project"]
    _install(tmp_path, project["name"], project["entry-points"][ENTRY_POINT_GROUP])
    monkeypatch.syspath_prepend(str(EXAMPLE))
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


_step = classification_train_step


def _default_order() -> list[str]:
    return [b.name for b in build_pipeline(PassOptions())]


def _compile_and_run(how: list[str] | None = None, **compile_options):
    """The program of a one-call run; ``how`` gets how each program was obtained."""
    # bucketing would merge the four all-reduces this file counts
    compile_options.setdefault("disable_passes", ("bucket_collectives",))
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    step = sc.compile(**compile_options)(_step)
    with sc.simulate(world_size=2):
        step(model, optim, torch.randn(4, 4), torch.randint(0, 3, (4,)))
    if how is not None:
        how += [r.cache for r in step.records]
    return step.last_program


def test_example_pass_runs_from_its_entry_point_only_when_named(site):
    assert "count_collectives" not in registered_passes()
    plain = _compile_and_run()
    # building the first pipeline imported the plugin, but its pass runs only when named
    assert "count_collectives" in registered_passes()
    assert "count_collectives" not in plain.passes_applied

    program = _compile_and_run(
        extra_passes=("count_collectives",), pass_options={"count_collectives": {"tag_nodes": True}}
    )
    assert program.passes_applied[-1] == "count_collectives"
    assert program.passes_applied[:-1] == plain.passes_applied
    stats = collective_stats(program.graph_module)
    summary = program.graph_module.meta["count_collectives"]
    assert {kind: entry["count"] for kind, entry in summary.items()} == stats.counts
    assert {kind: entry["bytes"] for kind, entry in summary.items()} == stats.bytes
    # a Linear's two gradients, the loss and the loss's total weight: four all-reduces
    assert stats.counts == {"all_reduce": 4}
    cost = CostModel()
    assert summary["all_reduce"]["seconds"] == pytest.approx(
        4 * cost.alpha_seconds + stats.bytes["all_reduce"] / cost.beta_bytes_per_second
    )
    collectives = [n for n in program.graph_module.graph.nodes if is_collective(n)]
    assert [n.meta["count_collectives.index"] for n in collectives] == [0, 1, 2, 3]


def test_the_same_plugin_pass_runs_again_in_a_second_compile(site):
    from spmd_count_collectives import CountCollectivesOptions

    first = _compile_and_run(extra_passes=("count_collectives",))
    second = _compile_and_run(
        extra_passes=("count_collectives",),
        pass_options={"count_collectives": CountCollectivesOptions(tag_nodes=False)},
    )
    for program in (first, second):
        assert program.passes_applied.count("count_collectives") == 1
        assert program.graph_module.meta["count_collectives"]["all_reduce"]["count"] == 4
    tagged = [n for n in second.graph_module.graph.nodes if "count_collectives.index" in n.meta]
    assert tagged == []


def test_broken_plugin_pass_is_caught_and_named(site):
    _install(
        site,
        "broken-passes",
        {"drop_waits": "broken_passes_plugin"},
        module="broken_passes_plugin\n" + BROKEN_PLUGIN,
    )
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    step = sc.compile(extra_passes=("drop_waits",))(_step)
    with sc.simulate(world_size=2), pytest.raises(PassFailure) as info:
        step(model, optim, torch.randn(4, 4), torch.randint(0, 3, (4,)))
    failure = info.value
    assert failure.pass_name == "drop_waits"
    assert failure.ran_before == tuple(_default_order())
    assert failure.check == "graph lint, collectives waited before use"
    assert "has 0 waits" in str(failure) and "broken_passes_plugin" in str(failure)
    # the failure came at compile time: the model was not touched
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


def test_bad_entry_points_are_skipped_and_reported_when_their_pass_is_named(site, caplog):
    _install(
        site,
        "bad-passes",
        {
            "missing": "no_such_module_for_spmd_tests",
            "not_registered": "broken_passes_plugin:not_a_pass",
        },
        module="broken_passes_plugin\n" + BROKEN_PLUGIN,
    )
    with caplog.at_level(logging.WARNING, logger="spmd_compiler.passes"):
        names = _default_order()
    assert sorted(names) == sorted(DEFAULT_PIPELINE)
    warnings = "\n".join(r.getMessage() for r in caplog.records)
    assert "ModuleNotFoundError" in warnings and "no_such_module_for_spmd_tests" in warnings
    assert "not_a_pass" in warnings and "neither a module nor a registered pass" in warnings
    with pytest.raises(PipelineError, match="unknown pass 'missing_pass'") as info:
        build_pipeline(PassOptions(extra_passes=("missing_pass",)))
    assert "plugin failed to load" in str(info.value)
    assert "no_such_module_for_spmd_tests" in str(info.value)


def test_a_plugin_added_after_the_first_build_is_found_when_named(
    site, tmp_path_factory, monkeypatch
):
    build_pipeline(PassOptions())  # the first build scans the entry points
    later = tmp_path_factory.mktemp("later_site")
    _install(
        later,
        "late-passes",
        {"late_noop": "late_passes_plugin:late_noop"},
        module="late_passes_plugin\n" + LATE_PLUGIN,
    )
    monkeypatch.syspath_prepend(str(later))
    names = [b.name for b in build_pipeline(PassOptions(extra_passes=("late_noop",)))]
    assert names == [*_default_order(), "late_noop"]


SCALING_PLUGIN = '''
import torch
from spmd_compiler.passes import is_wait, register_pass

from . import factors


@register_pass("scale_reduced", "scales the largest all-reduce by factors.FACTOR", after="bucket_collectives")
def scale_reduced(program, context):
    graph = program.graph_module.graph
    waits = [n for n in graph.nodes if is_wait(n) and n.users]
    # the gradients' bucket (the loss and its count cancel each other when both scale)
    wait = max(waits, key=lambda n: n.meta["val"].numel())
    users = list(wait.users)
    with graph.inserting_after(wait):
        scaled = graph.call_function(torch.ops.aten.mul.Tensor, (wait, factors.FACTOR))
    for user in users:
        user.replace_input_with(wait, scaled)
    return bool(waits)
'''


def _scaled_loss(cache_dir: Path) -> tuple[float, str]:
    """The second call's loss of a step with ``scale_reduced`` (a fresh registry and
    plugin scan, as in a new process), and how its first program was obtained."""
    pass_registry._REGISTRY.pop("scale_reduced", None)
    pass_registry._PLUGINS = pass_registry._PluginState()
    for module in ("scaling_passes", "scaling_passes.factors"):
        sys.modules.pop(module, None)
    torch.manual_seed(0)
    model = nn.Linear(4, 3).double()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    step = sc.compile(extra_passes=("scale_reduced",), cache_dir=str(cache_dir))(_step)
    x, y = torch.randn(4, 4, dtype=torch.float64), torch.randint(0, 3, (4,))
    with sc.simulate(world_size=2):
        step(model, optim, x, y)
        loss = step(model, optim, x, y)
    return float(loss), step.records[0].cache


def test_a_changed_plugin_pass_is_not_served_from_the_compile_cache(site, tmp_path, monkeypatch):
    """NOTE: [pass plugins in the key]: the pre-capture key of a process that had not
    built a pipeline left a lazily loaded plugin out, and only the pass function's own
    file was hashed: a pass edited between jobs, or a module of its package it imports,
    reused the program the old pass wrote (the loss of the old factor, silently)."""
    package = site / "scaling_passes"
    package.mkdir()
    (package / "__init__.py").write_text(SCALING_PLUGIN)
    (package / "factors.py").write_text("FACTOR = 1.0\n")
    _install(site, "scaling-passes", {"scale_reduced": "scaling_passes"})
    monkeypatch.setattr(pass_registry, "_PLUGINS", pass_registry._PluginState())
    cache = tmp_path / "cache"
    first, how = _scaled_loss(cache)
    assert how == "miss"
    assert _scaled_loss(cache) == (first, "hit")
    (package / "factors.py").write_text("FACTOR = 0.25\n")  # another size: no stale bytecode
    changed, how = _scaled_loss(cache)
    assert how == "miss" and changed != first
    assert _scaled_loss(tmp_path / "fresh") == (changed, "miss")


def test_pass_options_given_as_their_dataclass_are_keyed():
    """A pass's options as an instance of its own dataclass made the step uncacheable
    ("its key would need a ScaleOptions"); now its fields and class source are keyed."""
    import dataclasses

    from spmd_compiler.compile_cache import fingerprint

    @dataclasses.dataclass(frozen=True)
    class ScaleOptions:
        factor: float = 1.0

    assert fingerprint(ScaleOptions(1.0)) == fingerprint(ScaleOptions(1.0))
    assert fingerprint(ScaleOptions(1.0)) != fingerprint(ScaleOptions(2.0))


def test_a_plugin_pass_metadata_comes_back_with_a_cached_program(site, tmp_path):
    """NOTE: [pass metadata in entries]: on a cache hit no pass runs, and the entry kept
    only ``spmd_`` metadata: the documented ``graph_module.meta["count_collectives"]``
    was missing (KeyError) and the nodes' ``count_collectives.index`` too."""
    options = {"extra_passes": ("count_collectives",), "cache_dir": str(tmp_path),
               "pass_options": {"count_collectives": {"tag_nodes": True}}}
    how: list[str] = []
    compiled = _compile_and_run(how, **options)
    loaded = _compile_and_run(how, **options)
    assert how == ["miss", "hit"]  # before, "miss" again: the plugin was keyed once loaded
    assert loaded is not compiled and "count_collectives" in loaded.passes_applied
    assert loaded.graph_module.meta["count_collectives"] == compiled.graph_module.meta["count_collectives"]

    def indices(program):
        return [n.meta.get("count_collectives.index") for n in program.graph_module.graph.nodes if is_collective(n)]

    assert indices(loaded) == indices(compiled) == [0, 1, 2, 3]
