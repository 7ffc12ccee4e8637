"""What a rank whose call failed says of its peers (NOTE: [fault attribution] and NOTE:
[ranks that fail alike] in ``spmd_compiler/runtime/faults.py``), composed from the
failure records in a store (a HashStore standing in for the launch parent's; the real
ranks: ``tests/dist/test_faults.py``)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from spmd_compiler.runtime import faults


@pytest.fixture
def store():
    store = dist.HashStore()
    faults.use_launch_store(store)
    yield store
    faults._LAUNCH_STORE.clear()


def test_ranks_that_fail_alike_name_each_other(store) -> None:
    """Both of 2 gloo ranks failed outside their programs' fx nodes (a parameter subclass
    the state writes could not handle) and each said "No other rank recorded a failure:
    one may be stuck elsewhere" (sixty-first session). Each records its failure as
    uncertain before it waits, and names the other's."""
    what = "raised RuntimeError: Attempted to access the data pointer on an invalid python storage"
    faults.record_failure(store, 1, what, uncertain=True)  # rank 1, first
    said = faults.attribution(0, wait_s=0.05, own=what)  # rank 0
    assert said.startswith("Rank 1 failed too, also outside its program's collectives: it raised RuntimeError")
    assert "No other rank recorded a failure" not in said
    # rank 1, waiting in turn, finds rank 0's record
    assert faults.attribution(1, wait_s=0.05).startswith("Rank 0 failed too")


def test_a_certain_record_is_named_before_an_uncertain_one(store) -> None:
    faults.record_failure(store, 2, "raised RuntimeError: Connection closed by peer", uncertain=True)
    faults.record_failure(store, 1, "raised IndexError: Target 7 is out of bounds")
    assert faults.attribution(0, wait_s=0.05).startswith("Rank 1 failed first: it raised IndexError")


def test_with_no_record_a_failure_outside_the_collectives_may_be_this_ranks_own(store) -> None:
    said = faults.attribution(0, wait_s=0.05, own="raised RuntimeError: boom")
    assert "No other rank recorded a failure within 0.05 s" in said
    assert "may be this rank's own" in said
    # a failure in a collective still blames a peer
    assert faults.attribution_of(None, 0.05, own_possible=False).startswith(
        "No other rank recorded a failure: one may be stuck elsewhere"
    )
