"""schedule_overlap: collectives up to their inputs, waits down to their first use, under
the in-flight cap and never across a side effect; parity on simulated ranks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.fx
from collective_pass_harness import TOL, DataParallelWithPasses, TinyGraph, ops, train

from spmd_compiler import _torch_private as private
from spmd_compiler.ir.collectives import collective_stats
from spmd_compiler.passes import PassOptions, run_pipeline
from spmd_compiler.passes.collective_graph import payload_bytes, wait_of
from spmd_compiler.passes.manager import is_collective, is_wait
from spmd_compiler.passes.schedule_overlap import OverlapOptions, schedule_overlap

aten = torch.ops.aten
PASS = ("schedule_overlap",)
# what may sit between a collective and its last input once it is hoisted: its group
# nodes, views and a bucket's packing feeding it, other collectives hoisted to the same point
_FEEDERS = {
    aten.t.default,
    aten.reshape.default,
    aten.cat.default,
    private.mesh_group_op(),
}


def _in_flight_peak(graph: torch.fx.Graph) -> int:
    """The most payload bytes issued and not yet waited while any node runs."""
    nodes = list(graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    per_node = [0] * len(nodes)
    for c in filter(is_collective, nodes):
        for i in range(index[c] + 1, index[wait_of(c)]):
            per_node[i] += payload_bytes(c)
    return max(per_node)


def test_collective_moves_up_to_its_input_and_wait_down_to_its_use():
    g = TinyGraph()
    x = g.input("x", 8)
    grad = g.op("grad", aten.mul.Tensor, x, 2.0)
    h1 = g.op("h1", aten.mul.Tensor, x, 3.0)
    h2 = g.op("h2", aten.mul.Tensor, h1, 3.0)
    reduced = g.all_reduce("ar", grad)
    h3 = g.op("h3", aten.mul.Tensor, h2, 3.0)
    g.op("use", aten.add.Tensor, reduced, h3)
    program = g.program(g.graph.find_nodes(op="call_function", target=aten.add.Tensor)[0])
    assert program.names() == [
        "grad",
        "h1",
        "h2",
        "ar_mesh",
        "ar_group",
        "ar",
        "ar_wait",
        "h3",
        "use",
    ]

    run_pipeline(program, PassOptions(), pipeline=PASS)

    assert program.names() == [
        "grad",
        "ar_mesh",
        "ar_group",
        "ar",
        "h1",
        "h2",
        "h3",
        "ar_wait",
        "use",
    ]
    code = program.graph_module.code
    assert schedule_overlap(program, SimpleNamespace()) is False  # nothing left to move
    assert program.graph_module.code == code


def test_side_effects_are_not_crossed():
    g = TinyGraph()
    x, y = g.input("x", 8), g.input("y", 8)
    grad = g.op("grad", aten.mul.Tensor, x, 2.0)
    g.op("bump", aten.add_.Tensor, y, 1.0)  # in place: a side effect
    h = g.op("h", aten.mul.Tensor, x, 3.0)
    reduced = g.all_reduce("ar", grad)
    g.op("scale", aten.mul_.Tensor, y, 2.0)  # another one, before the first use
    use = g.op("use", aten.add.Tensor, reduced, h)
    program = g.program(use)

    run_pipeline(program, PassOptions(), pipeline=PASS)

    assert program.names() == [
        "grad",
        "bump",
        "ar_mesh",
        "ar_group",
        "ar",
        "h",
        "ar_wait",
        "scale",
        "use",
    ]


@pytest.mark.parametrize("cap", [500, 10_000])
def test_bytes_in_flight_stay_under_the_cap(cap):
    g = TinyGraph()
    x, y = g.input("x", 100), g.input("y", 100)  # 400 bytes each
    a = g.op("a", aten.mul.Tensor, x, 2.0)
    b = g.op("b", aten.mul.Tensor, y, 2.0)
    c1 = g.op("c1", aten.mul.Tensor, x, 3.0)
    c2 = g.op("c2", aten.mul.Tensor, c1, 3.0)
    wa, wb = g.all_reduce("ar_a", a), g.all_reduce("ar_b", b)
    both = g.op("both", aten.add.Tensor, wa, wb)
    program = g.program(g.op("use", aten.add.Tensor, both, c2))
    options = {"schedule_overlap": OverlapOptions(max_in_flight_bytes=cap)}

    run_pipeline(program, PassOptions(pass_options=options), pipeline=PASS)

    names = program.names()
    assert names[:4] == ["a", "ar_a_mesh", "ar_a_group", "ar_a"]
    if cap == 500:
        # both in flight across c1 and c2 would be 800 bytes: the second waits its turn
        assert _in_flight_peak(program.graph) <= cap
        assert names.index("ar_b") > names.index("c2")
    else:
        assert _in_flight_peak(program.graph) == 800
        assert names[4:8] == ["b", "ar_b_mesh", "ar_b_group", "ar_b"]


def _only_feeds_collectives(node: torch.fx.Node) -> bool:
    return bool(node.users) and all(
        is_collective(u) or _only_feeds_collectives(u) for u in node.users
    )


def _sources(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The inputs of ``node``, looking through feeders and group nodes."""
    out = []
    for a in node.all_input_nodes:
        feeder = a.op == "get_attr" or a.target in _FEEDERS
        out.extend(_sources(a) if feeder else [a])
    return out


def _check_schedule(graph: torch.fx.Graph) -> None:
    nodes = list(graph.nodes)
    for c in filter(is_collective, nodes):
        ready = max(nodes.index(n) for n in _sources(c))
        between = nodes[ready + 1 : nodes.index(c)]
        # only other collectives (issued first by priority) and what feeds them
        assert all(
            n.op in ("placeholder", "get_attr") or n.target in _FEEDERS or is_collective(n)
            or _only_feeds_collectives(n)
            for n in between
        ), f"{c.name} is not issued right after its inputs: {[n.name for n in between]}"
        wait = wait_of(c)
        first_use = min(nodes.index(u) for u in wait.users)
        between = nodes[nodes.index(wait) + 1 : first_use]
        assert all(is_wait(n) for n in between), f"{wait.name} waits early"


@pytest.mark.parametrize(
    "passes", [(), PASS, ("bucket_collectives", *PASS)], ids=["off", "on", "bucketed_on"]
)
@pytest.mark.parametrize("style", ["replicate", "fully_shard"])
def test_parity(style, passes):
    run = train(DataParallelWithPasses(style, passes))
    assert run.max_loss_difference < TOL and run.max_state_difference < TOL
    counts = collective_stats(run.step.last_program.graph_module).counts
    n_params = len(list(run.model.parameters()))
    if passes:
        _check_schedule(run.graph)
    if passes == PASS:
        want = (
            {"all_reduce": n_params + 2}
            if style == "replicate"
            else {
                "all_gather": n_params + 3,
                "reduce_scatter": n_params,
                "all_reduce": 2,
            }
        )
        assert counts == want
    if style == "replicate" and passes == PASS:
        # gradient reductions run during backward: the first is issued before the last
        # backward matmul (its wait is in the optimizer)
        nodes = list(run.graph.nodes)
        last_backward_mm = max(nodes.index(n) for n in ops(run.graph, "aten.mm"))
        reduces = [n for n in ops(run.graph, "all_reduce") if n.meta["val"].dim() > 0]
        assert min(nodes.index(n) for n in reduces) < last_backward_mm


_ALIASES = {
    aten.reshape.default, aten.view.default, aten.t.default, aten.split_with_sizes.default,
    aten.slice.Tensor, aten.select.int, aten.expand.default, aten.permute.default,
}


def _gathered_bytes_peak(graph: torch.fx.Graph) -> int:
    """The most gathered bytes alive at any node: each all_gather's result counts from its
    issue to the last use of the result or of a view of it."""
    nodes = list(graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    alive = [0] * len(nodes)
    for c in ops(graph, "all_gather"):
        stack, last = [wait_of(c)], index[wait_of(c)]
        while stack:
            n = stack.pop()
            for u in n.users:
                last = max(last, index[u])
                if u.target in _ALIASES or u.target.__name__ == "getitem":
                    stack.append(u)
        for i in range(index[c], last + 1):
            alive[i] += payload_bytes(c)
    return max(alive)


def _fsdp_with_prefetch(depth):
    from spmd_compiler.passes import BucketOptions

    # a bucket per parameter or two: several gathers to prefetch
    return train(DataParallelWithPasses(
        "fully_shard", ("bucket_collectives", *PASS),
        {"bucket_collectives": BucketOptions(cap_bytes=600),
         "schedule_overlap": OverlapOptions(prefetch_depth=depth)},
    ))


@pytest.mark.parametrize("depth", [0, 1, 2, None])
def test_fsdp_prefetch_depth(depth):
    run = _fsdp_with_prefetch(depth)
    assert run.max_loss_difference < TOL and run.max_state_difference < TOL
    nodes = list(run.graph.nodes)
    gathers = ops(run.graph, "all_gather")
    assert len(gathers) >= 4

    def first_use(c):
        return min(nodes.index(u) for u in wait_of(c).users)

    gathers.sort(key=first_use)
    for j, c in enumerate(gathers):
        issued = nodes.index(c)
        assert issued < first_use(c)
        if depth is None:
            continue
        if depth == 0:  # nothing runs ahead: no other gather's use between issue and use
            assert not any(issued < first_use(g) < first_use(c) for g in gathers[:j])
        elif j >= depth:  # issued once gather j - depth is being used, not before
            assert issued > first_use(gathers[j - depth])


def test_fsdp_prefetch_bounds_gathered_memory():
    peaks = {d: _gathered_bytes_peak(_fsdp_with_prefetch(d).graph) for d in (0, 1, None)}
    # issuing every gather at the start holds more gathered parameters at once
    assert peaks[0] <= peaks[1] < peaks[None]


def test_prefetch_depth_must_not_be_negative():
    with pytest.raises(ValueError, match="prefetch_depth"):
        OverlapOptions(prefetch_depth=-1)


@pytest.mark.parametrize("depth", [-1, 1.5, "2", True])
def test_data_parallel_refuses_a_bad_prefetch_depth_when_made(depth):
    """It was taken, and refused at the first call by schedule_overlap's options."""
    from spmd_compiler.parallel_modes import DataParallel

    with pytest.raises(ValueError, match=f"DataParallel prefetch_depth must be .*got {depth!r}"):
        DataParallel("fully_shard", prefetch_depth=depth)
    assert DataParallel("fully_shard", prefetch_depth=0).prefetch_depth == 0


@pytest.mark.parametrize("depth", [1, None])
def test_fully_shard_mode_prefetches_one_bucket_ahead_by_default(depth):
    """``DataParallel("fully_shard")`` passes its ``prefetch_depth`` (default 1, FSDP2's)
    to schedule_overlap when compile() gets no options for that pass."""
    from collective_pass_harness import classification_step, mlp_setup

    import spmd_compiler as sc
    from spmd_compiler.parallel_modes import DataParallel

    kwargs = {} if depth == 1 else {"prefetch_depth": depth}
    model, optim, batches = mlp_setup(2)
    step = sc.compile(
        DataParallel("fully_shard", **kwargs),
        pass_options={"bucket_collectives": {"cap_bytes": 600}},
    )(classification_step)
    with sc.simulate(4):
        for batch in batches:
            step(model, optim, *batch)
    graph = step.last_program.graph_module.graph
    nodes = list(graph.nodes)
    gathers = sorted(ops(graph, "all_gather"), key=lambda c: min(nodes.index(u) for u in wait_of(c).users))
    assert len(gathers) >= 4
    first_uses = [min(nodes.index(u) for u in wait_of(c).users) for c in gathers]
    ahead = [nodes.index(c) > first_uses[j - 1] for j, c in enumerate(gathers) if j >= 1]
    assert all(ahead) if depth == 1 else not all(ahead)


def _fully_shard_peak(mode, overlap_options):
    from collective_pass_harness import classification_step, mlp_setup

    import spmd_compiler as sc

    model, optim, batches = mlp_setup(2)
    pass_options = {"bucket_collectives": {"cap_bytes": 600}}
    if overlap_options is not None:
        pass_options["schedule_overlap"] = overlap_options
    step = sc.compile(mode, pass_options=pass_options)(classification_step)
    with sc.simulate(4):
        step(model, optim, *batches[0])
    return _gathered_bytes_peak(step.last_program.graph_module.graph)


def test_fully_shard_prefetch_depth_kept_beside_other_overlap_options():
    """NOTE: [prefetch depth beside other overlap options]: any ``schedule_overlap``
    option (here the default cap, or ``overlap_compute``) dropped the mode's depth, and
    the gathers ran as early as the cap allowed; the depth is merged in now. A depth
    given to the pass wins over the mode's default, and is refused when it differs from
    one given to the mode."""
    from spmd_compiler.parallel_modes import DataParallel

    unlimited = _fully_shard_peak(DataParallel("fully_shard", prefetch_depth=None), None)
    depth0 = _fully_shard_peak(DataParallel("fully_shard", prefetch_depth=0), None)
    assert depth0 < unlimited
    for given in ({"max_in_flight_bytes": 256 * 2**20}, OverlapOptions(overlap_compute=True)):
        assert _fully_shard_peak(DataParallel("fully_shard", prefetch_depth=0), given) == depth0
    assert _fully_shard_peak(DataParallel("fully_shard"), {"prefetch_depth": None}) == unlimited
    mode = DataParallel("fully_shard", prefetch_depth=0)
    assert mode._overlap_with_prefetch(OverlapOptions(prefetch_depth=0)).prefetch_depth == 0
    with pytest.raises(ValueError, match=r"prefetch_depth=0\).*prefetch_depth=2 disagree"):
        mode._overlap_with_prefetch({"prefetch_depth": 2})
    with pytest.raises(ValueError, match=r"prefetch_depth=1\).*prefetch_depth=None disagree"):
        DataParallel("fully_shard", prefetch_depth=1)._overlap_with_prefetch({"prefetch_depth": None})


def test_overlap_options_are_checked_when_made():
    """``kinds={"allgather"}`` moved no collective, silently; a non-positive cap too."""
    with pytest.raises(ValueError, match=r"'allgather'.*did you mean 'all_gather'"):
        OverlapOptions(kinds=frozenset({"allgather"}))
    with pytest.raises(ValueError, match="max_in_flight_bytes must be a positive int"):
        OverlapOptions(max_in_flight_bytes=-1)
    OverlapOptions(kinds=frozenset({"all_to_all", "broadcast"}))


def test_replicate_refuses_fully_shard_options():
    """``DataParallel("replicate", reshard_after_forward=False, prefetch_depth=3)`` was
    taken and both dropped; refused now, naming them. Their defaults stay accepted, and
    a fully_shard mode's repr shows a depth it was given."""
    from spmd_compiler.parallel_modes import DataParallel

    with pytest.raises(ValueError, match=r"reshard_after_forward=False, prefetch_depth=3\): these options apply to 'fully_shard' only"):
        DataParallel("replicate", reshard_after_forward=False, prefetch_depth=3)
    with pytest.raises(ValueError, match=r"'replicate', prefetch_depth=None\)"):
        DataParallel("replicate", prefetch_depth=None)
    DataParallel("replicate", reshard_after_forward=True, prefetch_depth=1)
    assert "prefetch_depth=2" in repr(DataParallel("fully_shard", prefetch_depth=2))
    assert "prefetch_depth" not in repr(DataParallel("fully_shard"))
