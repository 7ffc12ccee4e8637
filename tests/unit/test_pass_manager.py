"""The pass manager: ordering, options, disabling, checks that name the failing pass, debug output."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

import pytest
import torch
import torch.fx
from torch.distributed.tensor import Shard

from spmd_compiler.ir.node_meta import CREATED_BY, PLACEMENT
from spmd_compiler.passes import (
    PassFailure,
    PassOptions,
    PipelineError,
    build_pipeline,
    register_pass,
    run_pipeline,
)
from spmd_compiler.passes.manager import check_program


class _Program:
    """The slice of DistributedProgram the manager touches."""

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        self.graph_module = gm
        self.passes_applied: list[str] = []
        self.pass_seconds: dict[str, float] = {}


def _tiny_program() -> _Program:
    def f(x):
        y = torch.ops.aten.mul.Tensor(x, 2.0)
        unused = torch.ops.aten.add.Tensor(x, 1.0)  # noqa: F841
        return (y,)

    gm = torch.fx.symbolic_trace(f)
    return _Program(gm)


def test_remove_dead_nodes_changes_then_is_a_no_op():
    program = _tiny_program()
    before = len(program.graph_module.graph.nodes)
    run_pipeline(program, PassOptions(), pipeline=("remove_dead_nodes",))
    assert len(program.graph_module.graph.nodes) == before - 1
    assert program.passes_applied == ["remove_dead_nodes"]
    nodes = len(program.graph_module.graph.nodes)
    run_pipeline(program, PassOptions(), pipeline=("remove_dead_nodes",))
    assert len(program.graph_module.graph.nodes) == nodes


def test_disabled_pass_does_not_run(monkeypatch):
    program = _tiny_program()
    before = len(program.graph_module.graph.nodes)
    run_pipeline(
        program,
        PassOptions(disabled=frozenset({"remove_dead_nodes"})),
        pipeline=("remove_dead_nodes",),
    )
    assert len(program.graph_module.graph.nodes) == before
    monkeypatch.setenv("SPMD_DISABLE_PASSES", "remove_dead_nodes")
    run_pipeline(program, PassOptions(), pipeline=("remove_dead_nodes",))
    assert len(program.graph_module.graph.nodes) == before
    assert program.passes_applied == []


def test_a_misspelt_disabled_pass_is_an_error(monkeypatch):
    """It only logged a warning and the pass ran, while misspelt ``extra_passes`` and
    ``pass_options`` names were errors."""
    with pytest.raises(PipelineError, match="unknown pass 'remove_dead_node' in disable_passes"):
        run_pipeline(_tiny_program(), PassOptions(disabled=frozenset({"remove_dead_node"})))
    monkeypatch.setenv("SPMD_DISABLE_PASSES", "bucket_colectives")
    with pytest.raises(PipelineError, match="SPMD_DISABLE_PASSES"):
        run_pipeline(_tiny_program(), PassOptions())


def test_broken_pass_is_named_with_passes_before_it():
    @register_pass("test_break_graph", "uses a collective's result without its wait")
    def _break(program, context):
        graph = program.graph_module.graph
        x = next(n for n in graph.nodes if n.op == "placeholder")
        out = graph.output_node()
        with graph.inserting_before(out):
            ar = graph.call_function(torch.ops._c10d_functional.all_reduce.default, (x, "sum", "0"))
            use = graph.call_function(torch.ops.aten.add.Tensor, (ar, 1.0))
        out.args = ((use,),)
        return True

    program = _tiny_program()
    with pytest.raises(PassFailure, match=r"test_break_graph.*remove_dead_nodes"):
        run_pipeline(program, PassOptions(), pipeline=("remove_dead_nodes", "test_break_graph"))


def test_nodes_created_by_a_pass_carry_its_name():
    @register_pass("test_add_node", "appends a multiply")
    def _add(program, context):
        graph = program.graph_module.graph
        out = graph.output_node()
        (value,) = out.args[0]
        with graph.inserting_before(out):
            new = graph.call_function(torch.ops.aten.mul.Tensor, (value, 3.0))
        out.args = ((new,),)
        return True

    program = _tiny_program()
    run_pipeline(program, PassOptions(), pipeline=("test_add_node",))
    created = [
        n for n in program.graph_module.graph.nodes if n.meta.get(CREATED_BY) == "test_add_node"
    ]
    assert len(created) == 1
    assert program.graph_module(torch.ones(2))[0].tolist() == [6.0, 6.0]


def test_check_program_accepts_waited_collectives():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    ar = graph.call_function(torch.ops._c10d_functional.all_reduce.default, (x, "sum", "0"))
    wait = graph.call_function(torch.ops._c10d_functional.wait_tensor.default, (ar,))
    graph.output((wait,))
    check_program(torch.fx.GraphModule(torch.nn.Module(), graph))


# ---------------------------------------------------------------- registration and ordering


@pytest.fixture
def registry(monkeypatch):
    """A private copy of the pass registry: what a test registers disappears after it."""
    from spmd_compiler.passes import registry as reg

    monkeypatch.setattr(reg, "_REGISTRY", dict(reg._REGISTRY))
    return reg


def _noop_pass(name: str, **kwargs):
    @register_pass(name, f"does nothing ({name})", **kwargs)
    def _pass(program, context):
        return False

    return _pass


def _order(*names: str, **options) -> list[str]:
    return [b.name for b in build_pipeline(PassOptions(**options), pipeline=names)]


def test_list_order_is_kept_without_constraints(registry):
    for name in ("pass_c", "pass_a", "pass_b"):
        _noop_pass(name)
    assert _order("pass_c", "pass_a", "pass_b") == ["pass_c", "pass_a", "pass_b"]


def test_after_and_before_reorder_the_list(registry):
    _noop_pass("pass_a", after="pass_c")
    _noop_pass("pass_b")
    _noop_pass("pass_c")
    _noop_pass("pass_d", before=("pass_b",))
    # a waits for c, b waits for d; of the passes whose constraints are met, the earliest
    # in the list runs next
    assert _order("pass_a", "pass_b", "pass_c", "pass_d") == [
        "pass_c",
        "pass_a",
        "pass_d",
        "pass_b",
    ]
    # constraints on passes outside the pipeline (or disabled) are ignored
    assert _order("pass_a", "pass_b") == ["pass_a", "pass_b"]
    assert _order("pass_a", "pass_c", disabled=frozenset({"pass_c"})) == ["pass_a"]


def test_extra_passes_are_added_and_placed_by_their_constraints(registry):
    _noop_pass("pass_first")
    _noop_pass("pass_last")
    _noop_pass("pass_extra", after="pass_first", before="pass_last")
    names = _order("pass_first", "pass_last", extra_passes=("pass_extra",))
    assert names == ["pass_first", "pass_extra", "pass_last"]


def test_a_cycle_is_an_error_naming_it(registry):
    _noop_pass("pass_x", after="pass_z")
    _noop_pass("pass_y", after="pass_x")
    _noop_pass("pass_z", after="pass_y")
    _noop_pass("pass_free")
    with pytest.raises(PipelineError, match=r"cycle: pass_x -> pass_y -> pass_z -> pass_x"):
        _order("pass_free", "pass_x", "pass_y", "pass_z")


def test_unknown_names_are_errors(registry):
    _noop_pass("pass_known", after="pass_missing")
    with pytest.raises(PipelineError, match=r"unknown pass 'pass_nowhere' in the pipeline"):
        _order("pass_nowhere")
    with pytest.raises(
        PipelineError, match=r"'pass_missing' in the ordering constraints of pass 'pass_known'"
    ):
        _order("pass_known")
    with pytest.raises(PipelineError, match=r"unknown pass 'pass_typo' in pass_options"):
        _order(pass_options={"pass_typo": {}})


def test_bad_registrations_are_refused(registry):
    with pytest.raises(ValueError, match="verb_noun"):
        _noop_pass("Bad-Name")

    @dataclass
    class Mutable:
        size: int = 1

    @dataclass(frozen=True)
    class NoDefault:
        size: int

    with pytest.raises(ValueError, match="frozen"):
        _noop_pass("pass_mutable", options=Mutable)
    with pytest.raises(ValueError, match="needs a default"):
        _noop_pass("pass_no_default", options=NoDefault)
    _noop_pass("pass_taken")
    with pytest.raises(ValueError, match="already registered"):
        register_pass("pass_taken", "another function")(lambda program, context: False)


# ------------------------------------------------------------------------------- options


@dataclass(frozen=True)
class _ScaleOptions:
    factor: float = 3.0


def _register_scale(registry) -> list:
    seen = []

    @register_pass("scale_output", "multiply the output by options.factor", options=_ScaleOptions)
    def _scale(program, context):
        seen.append(context.options)
        assert context.pass_options() is context.options
        graph = program.graph_module.graph
        out = graph.output_node()
        (value,) = out.args[0]
        with graph.inserting_before(out):
            new = graph.call_function(torch.ops.aten.mul.Tensor, (value, context.options.factor))
        out.args = ((new,),)
        return True

    return seen


@pytest.mark.parametrize(
    "given, factor",
    [(None, 3.0), (_ScaleOptions(5.0), 5.0), ({"factor": 0.5}, 0.5)],
    ids=["default", "instance", "dict"],
)
def test_a_pass_gets_its_options(registry, given, factor):
    seen = _register_scale(registry)
    program = _tiny_program()
    options = PassOptions(pass_options={} if given is None else {"scale_output": given})
    run_pipeline(program, options, pipeline=("scale_output",))
    assert seen == [_ScaleOptions(factor)]
    assert program.graph_module(torch.ones(2))[0].tolist() == [2.0 * factor] * 2


def test_options_of_the_wrong_type_are_an_error(registry):
    _register_scale(registry)
    _noop_pass("pass_plain")
    with pytest.raises(PipelineError, match="must be a _ScaleOptions"):
        _order("scale_output", pass_options={"scale_output": 2.0})
    with pytest.raises(PipelineError, match="unexpected keyword argument 'factr'"):
        _order("scale_output", pass_options={"scale_output": {"factr": 2.0}})
    with pytest.raises(PipelineError, match="takes no options"):
        _order("pass_plain", pass_options={"pass_plain": {"x": 1}})


@dataclass(frozen=True)
class _CheckedOptions:
    factor: float = 1.0
    tag_nodes: bool = False

    def __post_init__(self) -> None:
        if self.factor <= 0:
            raise ValueError(f"factor must be positive, got {self.factor}")


def test_options_the_class_refuses_name_the_pass(registry):
    """A ValueError of the options class's own checks came out raw, and a dict's wrong
    field type ("no" for a bool: truthy) was taken; both name the pass now."""
    _noop_pass("pass_checked", options=_CheckedOptions)
    with pytest.raises(PipelineError, match="'pass_checked': factor must be positive, got -1"):
        _order("pass_checked", pass_options={"pass_checked": {"factor": -1.0}})
    with pytest.raises(PipelineError, match="'pass_checked': tag_nodes must be of type bool, got str"):
        _order("pass_checked", pass_options={"pass_checked": {"tag_nodes": "no"}})
    with pytest.raises(PipelineError, match="factor must be of type float, got str: '2'"):
        _order("pass_checked", pass_options={"pass_checked": {"factor": "2"}})
    _order("pass_checked", pass_options={"pass_checked": {"factor": 2, "tag_nodes": True}})


def test_the_same_pass_runs_in_two_pipelines_with_their_own_options(registry):
    seen = _register_scale(registry)
    first, second = _tiny_program(), _tiny_program()
    run_pipeline(
        first,
        PassOptions(pass_options={"scale_output": {"factor": 2.0}}),
        pipeline=("scale_output",),
    )
    run_pipeline(second, PassOptions(), pipeline=("scale_output",))
    assert seen == [_ScaleOptions(2.0), _ScaleOptions(3.0)]
    assert first.passes_applied == second.passes_applied == ["scale_output"]


def test_env_var_disables_several_passes(monkeypatch, registry):
    _noop_pass("pass_one")
    _noop_pass("pass_two")
    _noop_pass("pass_three")
    monkeypatch.setenv("SPMD_DISABLE_PASSES", " pass_one, pass_three ,")
    program = _tiny_program()
    run_pipeline(program, PassOptions(), pipeline=("pass_one", "pass_two", "pass_three"))
    assert program.passes_applied == ["pass_two"]


def test_describe_pipeline_lists_the_default_pipeline():
    from spmd_compiler.passes import DEFAULT_PIPELINE, describe_pipeline

    lines = describe_pipeline().splitlines()
    assert len(lines) == len(DEFAULT_PIPELINE)
    assert lines[0].split()[:2] == ["1.", DEFAULT_PIPELINE[0]]


# -------------------------------------------------------------------------------- checks


def _collective_program() -> _Program:
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(4)
    ar = graph.call_function(torch.ops._c10d_functional.all_reduce.default, (x, "sum", "0"))
    ar.meta["val"] = torch.empty(4)
    wait = graph.call_function(torch.ops._c10d_functional.wait_tensor.default, (ar,))
    graph.output((wait,))
    return _Program(torch.fx.GraphModule(torch.nn.Module(), graph))


def _register_reduce_op_change(registry, **kwargs):
    @register_pass("change_reduce_op", "turns sum into avg", **kwargs)
    def _change(program, context):
        for node in program.graph_module.graph.nodes:
            if node.target is torch.ops._c10d_functional.all_reduce.default:
                node.args = (node.args[0], "avg", node.args[2])
        return True


def test_changing_collectives_needs_a_declaration(registry):
    _register_reduce_op_change(registry)
    with pytest.raises(PassFailure, match=r"'change_reduce_op' broke") as info:
        run_pipeline(_collective_program(), PassOptions(), pipeline=("change_reduce_op",))
    assert info.value.check == "collective sequence unchanged"
    assert "'sum'" in str(info.value) and "'avg'" in str(info.value)


def test_declared_collective_changes_pass(registry):
    _register_reduce_op_change(registry, changes_collectives=True)
    program = _collective_program()
    run_pipeline(program, PassOptions(), pipeline=("change_reduce_op",))
    assert program.passes_applied == ["change_reduce_op"]


def test_collective_signature_describes_op_group_and_payload():
    from spmd_compiler.passes import collective_signature

    gm = _collective_program().graph_module
    assert collective_signature(gm) == [
        ("_c10d_functional.all_reduce", ("'sum'", "'0'"), ("float32[4]",))
    ]


def test_requires_and_ensures_name_the_check(registry):
    def graph_has_a_multiply(program):
        if not any(n.target is torch.ops.aten.mul.Tensor for n in program.graph_module.graph.nodes):
            raise AssertionError("no multiply in the graph")

    def never(program):
        raise AssertionError("this never holds")

    _noop_pass("pass_needs_mul", requires=graph_has_a_multiply)
    _noop_pass("pass_promises_too_much", ensures=(never,))
    run_pipeline(_tiny_program(), PassOptions(), pipeline=("pass_needs_mul",))
    with pytest.raises(PassFailure, match="requires .*graph_has_a_multiply") as info:
        run_pipeline(_collective_program(), PassOptions(), pipeline=("pass_needs_mul",))
    assert "no multiply in the graph" in str(info.value)
    with pytest.raises(PassFailure, match="ensures .*never"):
        run_pipeline(_tiny_program(), PassOptions(), pipeline=("pass_promises_too_much",))
    # without checks neither runs
    run_pipeline(_tiny_program(), PassOptions(check=False), pipeline=("pass_promises_too_much",))


def test_the_changed_flag_must_be_an_honest_bool(registry):
    @register_pass("pass_forgets_return", "returns None")
    def _none(program, context):
        return None

    @register_pass("pass_hides_change", "erases a node, says it did not")
    def _hides(program, context):
        program.graph_module.graph.eliminate_dead_code()
        return False

    with pytest.raises(PassFailure, match="pass_forgets_return") as info:
        run_pipeline(_tiny_program(), PassOptions(), pipeline=("pass_forgets_return",))
    assert "returned None" in str(info.value)
    with pytest.raises(PassFailure, match="pass_hides_change") as info:
        run_pipeline(_tiny_program(), PassOptions(), pipeline=("pass_hides_change",))
    assert "returned False but changed the graph" in str(info.value)


def test_a_pass_that_raises_is_named(registry):
    @register_pass("pass_crashes", "raises")
    def _crash(program, context):
        raise KeyError("boom")

    with pytest.raises(
        PassFailure, match=r"'pass_crashes' broke .*run before it: remove_dead_nodes"
    ) as info:
        run_pipeline(_tiny_program(), PassOptions(), pipeline=("remove_dead_nodes", "pass_crashes"))
    assert isinstance(info.value.__cause__, KeyError)
    assert info.value.ran_before == ("remove_dead_nodes",)
    assert "SPMD_DISABLE_PASSES=pass_crashes" in str(info.value)


# ---------------------------------------------------------------------------- cost model


def test_cost_model_is_alpha_plus_bytes_over_beta():
    from spmd_compiler.passes import CostModel

    model = CostModel(alpha_seconds=1e-5, beta_bytes_per_second=1e9)
    collective = next(
        n for n in _collective_program().graph_module.graph.nodes if n.op == "call_function"
    )
    assert model.collective_bytes(collective) == 16
    assert model.collective_seconds(collective) == pytest.approx(1e-5 + 16 / 1e9)
    placeholder = next(iter(_collective_program().graph_module.graph.nodes))
    assert model.collective_seconds(placeholder) == 0.0


# ------------------------------------------------------------------------------ numerics


def _sharded_program() -> _Program:
    """y = x * 2 on an input sharded over 2 simulated ranks."""
    from spmd_compiler.ir.signature import TensorMeta

    program = _tiny_program()
    program.local_inputs = [TensorMeta((2,), torch.float32, torch.device("cpu"))]
    program.input_placements = [(Shard(0),)]
    return program


def _register_rewrite(name: str, make):
    @register_pass(name, "replaces the multiply")
    def _rewrite(program, context):
        graph = program.graph_module.graph
        mul = next(n for n in graph.nodes if n.target is torch.ops.aten.mul.Tensor)
        with graph.inserting_after(mul):
            new = make(graph, mul.args[0])
        mul.replace_all_uses_with(new)
        graph.erase_node(mul)
        return True


def test_verify_numerics_catches_a_wrong_rewrite(registry):
    import spmd_compiler as sc

    _register_rewrite(
        "double_by_adding", lambda g, x: g.call_function(torch.ops.aten.add.Tensor, (x, x))
    )
    _register_rewrite(
        "double_wrongly", lambda g, x: g.call_function(torch.ops.aten.mul.Tensor, (x, 3.0))
    )
    options = PassOptions(verify_numerics=True)
    with sc.simulate(2):
        run_pipeline(_sharded_program(), options, pipeline=("double_by_adding",))
        with pytest.raises(PassFailure, match="'double_wrongly' broke") as info:
            run_pipeline(
                _sharded_program(), options, pipeline=("remove_dead_nodes", "double_wrongly")
            )
    assert info.value.check == "same numbers as before the pass"
    assert "output 0 on simulated rank 0 changed" in str(info.value)


def test_verify_numerics_on_a_compiled_step(registry):
    import torch.nn as nn
    import torch.nn.functional as F

    import spmd_compiler as sc

    def scale_first_output(factor):
        def rewrite(program, context):
            graph = program.graph_module.graph
            out = graph.output_node()
            values = list(out.args[0])
            with graph.inserting_before(out):
                values[0] = graph.call_function(torch.ops.aten.mul.Tensor, (values[0], factor))
            out.args = (tuple(values),)
            return True

        return rewrite

    register_pass("scale_loss_by_one", "multiplies the returned loss by 1")(scale_first_output(1.0))
    register_pass("scale_loss_by_two", "multiplies the returned loss by 2")(scale_first_output(2.0))

    def step(model, optim, x, y):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optim.step()
        optim.zero_grad()
        return loss

    for extra, fails in (("scale_loss_by_one", False), ("scale_loss_by_two", True)):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 3))
        optim = torch.optim.AdamW(model.parameters(), lr=0.1)
        compiled = sc.compile(verify_numerics=True, extra_passes=(extra,))(step)
        with sc.simulate(world_size=2):
            if fails:
                with pytest.raises(PassFailure, match="same numbers as before the pass"):
                    compiled(model, optim, torch.randn(4, 4), torch.randint(0, 3, (4,)))
            else:
                compiled(model, optim, torch.randn(4, 4), torch.randint(0, 3, (4,)))
                assert compiled.last_program.passes_applied[-1] == extra


def test_ranks_made_to_disagree_by_a_pass_name_the_output_and_the_passes(registry):
    """A pass that drops the gradients' all-reduce makes the simulated ranks' parameters,
    then their losses, differ; that was a bare AssertionError naming neither."""
    import torch.nn as nn

    import spmd_compiler as sc
    from spmd_compiler.errors import SPMDRuntimeError
    from spmd_compiler.parallel_modes import DataParallel
    from spmd_compiler.passes import collective_kind, is_wait
    from spmd_compiler.tools.demo.steps import classification_train_step

    @register_pass("drop_gradient_all_reduce", "drops the largest all-reduce (wrong on purpose)",
                   after="schedule_overlap", changes_collectives=True)
    def _drop(program, context):
        graph = program.graph_module.graph
        waits = [n for n in graph.nodes if is_wait(n) and collective_kind(n.args[0]) == "all_reduce"]
        wait = max(waits, key=lambda n: n.meta["val"].numel())
        collective = wait.args[0]
        wait.replace_all_uses_with(collective.args[0])
        graph.erase_node(wait)
        graph.erase_node(collective)
        return True

    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    compiled = sc.compile(DataParallel("replicate"), extra_passes="drop_gradient_all_reduce")(
        classification_train_step
    )
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    with sc.simulate(world_size=2), pytest.raises(SPMDRuntimeError) as info:
        for _ in range(2):
            compiled(model, optim, x, y)
    text = str(info.value)
    assert "different values on the simulated ranks for return[0]" in text
    assert "drop_gradient_all_reduce" in text and "verify_numerics=True" in text


# ---------------------------------------------------------------------------- debugging


def _register_append_multiply() -> None:
    @register_pass("append_multiply", "multiplies the output by 3")
    def _append(program, context):
        graph = program.graph_module.graph
        out = graph.output_node()
        (value,) = out.args[0]
        with graph.inserting_before(out):
            new = graph.call_function(torch.ops.aten.mul.Tensor, (value, 3.0))
        out.args = ((new,),)
        return True


def _placed_program() -> _Program:
    program = _tiny_program()
    for node in program.graph_module.graph.nodes:
        node.meta[PLACEMENT] = (Shard(0),)
    return program


def test_debug_level_1_logs_the_pass_list_with_times(monkeypatch, caplog, registry):
    _register_append_multiply()
    monkeypatch.setenv("SPMD_DEBUG", "1")
    with caplog.at_level(logging.INFO, logger="spmd_compiler.passes"):
        run_pipeline(
            _tiny_program(),
            PassOptions(disabled=frozenset({"append_multiply"})),
            pipeline=("remove_dead_nodes", "append_multiply"),
        )
    (summary,) = [r.getMessage() for r in caplog.records if "pass pipeline" in r.getMessage()]
    lines = summary.splitlines()
    assert lines[0].startswith("pass pipeline: 1 pass(es) in")
    assert re.match(r"\s+1\. remove_dead_nodes\s+[\d.]+ ms\s+changed", lines[1])
    assert re.match(r"\s+2\. append_multiply\s+[\d.]+ ms\s+disabled", lines[2])


def test_debug_level_2_logs_op_count_changes(monkeypatch, caplog):
    monkeypatch.setenv("SPMD_DEBUG", "2")
    with caplog.at_level(logging.INFO, logger="spmd_compiler.passes"):
        run_pipeline(_tiny_program(), PassOptions(), pipeline=("remove_dead_nodes",))
    messages = [r.getMessage() for r in caplog.records]
    assert "pass remove_dead_nodes: -1 aten.add" in messages


def test_debug_level_3_dumps_graphs_with_placements(monkeypatch, tmp_path, registry):
    _register_append_multiply()
    monkeypatch.setenv("SPMD_DEBUG", "3")
    monkeypatch.setenv("SPMD_DEBUG_DIR", str(tmp_path / "dumps"))
    run_pipeline(
        _placed_program(), PassOptions(), pipeline=("remove_dead_nodes", "append_multiply")
    )
    files = sorted(p.name for p in (tmp_path / "dumps").iterdir())
    assert files == [
        "01_remove_dead_nodes_after.txt",
        "01_remove_dead_nodes_before.txt",
        "02_append_multiply_after.txt",
        "02_append_multiply_before.txt",
    ]
    before = (tmp_path / "dumps" / "01_remove_dead_nodes_before.txt").read_text()
    after = (tmp_path / "dumps" / "01_remove_dead_nodes_after.txt").read_text()
    assert "aten.add(%x, 1.0)" in before and "aten.add" not in after
    assert re.search(r"^mul\w*\s+\[S\(0\)\]\s+= aten\.mul\(%x, 2\.0\)$", after, re.M)
    added = (tmp_path / "dumps" / "02_append_multiply_after.txt").read_text()
    assert re.search(r"= aten\.mul\(%mul\w*, 3\.0\)  # by append_multiply$", added, re.M)


# ------------------------------------------------------------------------- node values


def _program_with_values() -> _Program:
    """y = x * 2 with ``meta['val']`` on every node, as an expanded program has."""
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    program = _tiny_program()
    FakeTensorProp(program.graph_module).propagate(torch.empty(3, 4))
    return program


def test_a_pass_that_sets_no_value_gets_one_computed(registry):
    """Later passes read shapes and bytes in ``meta['val']``: a node a plugin made
    without one gets its op's result on its inputs' values."""
    _register_rewrite(
        "transpose_no_val", lambda g, x: g.call_function(torch.ops.aten.t.default, (x,))
    )
    program = _program_with_values()
    run_pipeline(program, PassOptions(), pipeline=("transpose_no_val",))
    made = next(n for n in program.graph_module.graph.nodes if n.target is torch.ops.aten.t.default)
    assert tuple(made.meta["val"].shape) == (4, 3)
    assert made.meta[CREATED_BY] == "transpose_no_val"


def test_a_node_whose_value_cannot_be_made_is_named(registry):
    _register_rewrite(
        "square_by_mm", lambda g, x: g.call_function(torch.ops.aten.mm.default, (x, x))
    )
    with pytest.raises(PassFailure, match="'square_by_mm' broke") as info:
        run_pipeline(_program_with_values(), PassOptions(), pipeline=("square_by_mm",))
    assert info.value.check == "new nodes carry meta['val']"
    assert "aten.mm" in str(info.value) and "new_node" in str(info.value)
