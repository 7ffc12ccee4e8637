"""Values the step draws from the OS's entropy are refused (NOTE: [host entropy at capture]).

A mixup weight from ``np.random.default_rng().beta(0.4, 0.4)``, an unseeded generator made
inside the step, was 0.568, 0.215, 0.936, 0.595 on four eager calls and 0.021891 on every
compiled one, with no error; ``random.SystemRandom()``, ``secrets`` and ``os.urandom``
gave a constant factor the same way.
"""

from __future__ import annotations

import os
import random
import secrets
import sysconfig
import threading
import uuid
from os import urandom  # by name: patched in this module's globals too

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd_compiler as sc
from spmd_compiler.errors import SPMDCompileError
from spmd_compiler.parallel_modes import make_mode

NO_SEED = None
DRAWS = {
    "default_rng": (lambda: float(np.random.default_rng().beta(0.4, 0.4)), "np.random.default_rng()"),
    "random_state": (lambda: float(np.random.RandomState().rand()), "np.random.RandomState()"),
    "random_state_none": (lambda: float(np.random.RandomState(NO_SEED).rand()), "np.random.RandomState()"),
    "bit_generator": (lambda: float(np.random.Generator(np.random.PCG64()).random()), "np.random.PCG64()"),
    "seed_sequence": (lambda: float(np.random.SeedSequence().entropy % 7), "np.random.SeedSequence()"),
    "system_random": (lambda: random.SystemRandom().random(), "random.SystemRandom().random()"),
    "secrets": (lambda: 1.0 + secrets.randbelow(1000) / 1000, "secrets.randbelow()"),
    "os_urandom": (lambda: 1.0 + os.urandom(1)[0] / 255, "(os.urandom())"),
    "urandom_by_name": (lambda: 1.0 + urandom(1)[0] / 255, "(os.urandom())"),
    "uuid4": (lambda: 1.0 + uuid.uuid4().int % 97 / 97, "uuid.uuid4()"),
}


def _make_step(draw):  # noqa: ANN001, ANN202
    def step(model, optim, x, y):  # noqa: ANN001, ANN202
        w = draw()
        loss = F.cross_entropy(model(x), y) * w
        loss.backward()
        optim.step()
        optim.zero_grad()
        return loss

    return step


def _setup():  # noqa: ANN202
    torch.manual_seed(0)
    model = nn.Linear(8, 4).double()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(4, 8, dtype=torch.float64), torch.randint(0, 4, (4,))
    return model, optim, x, y


@pytest.mark.parametrize("how", sorted(DRAWS))
def test_an_entropy_draw_in_the_step_is_refused(how):
    draw, named = DRAWS[how]
    model, optim, x, y = _setup()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    step = sc.compile(make_mode("ddp"))(_make_step(draw))
    with sc.simulate(world_size=2), pytest.raises(SPMDCompileError) as info:
        step(model, optim, x, y)
    message = str(info.value)
    assert "OS's entropy" in message and named in message, message
    assert 'test_host_entropy.py:' in message and f'"{how}": (lambda' in message  # the line
    assert "draw outside the step" in message and "torch.rand" in message
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert optim.state == {}
    # the reads are themselves again
    assert os.urandom is urandom and random._urandom is urandom  # type: ignore[attr-defined]


def test_an_unseeded_random_random_is_refused_at_its_draw():
    """It reads the entropy in C, unseen; its draw is refused (NOTE: [host random
    generator objects at capture])."""
    model, optim, x, y = _setup()
    step = sc.compile(make_mode("ddp"))(_make_step(lambda: random.Random().random()))
    with sc.simulate(world_size=2), pytest.raises(SPMDCompileError, match=r"random\.Random\.random"):
        step(model, optim, x, y)


SEED = 5
SEEDED = {
    "default_rng": lambda: float(np.random.default_rng(5).beta(0.4, 0.4)),
    "seed_sequence": lambda: float(np.random.default_rng(np.random.SeedSequence(5)).random()),
    # these read the entropy, then set the state from the seed
    "random_state": lambda: float(np.random.RandomState(5).uniform(0.5, 1.5)),
    "random_state_by_name": lambda: float(np.random.RandomState(seed=SEED).uniform(0.5, 1.5)),
    "reseeded": lambda: float(_reseeded(np.random.RandomState(1)).rand()),
    "jumped": lambda: float(np.random.Generator(np.random.PCG64(5).jumped()).random()),
}


def _reseeded(state: np.random.RandomState) -> np.random.RandomState:
    state.seed(7)
    return state


@pytest.mark.parametrize("make", sorted(SEEDED))
def test_a_generator_made_in_the_step_with_a_seed_matches_eager(make):
    """The same numbers every eager call, as the program reuses: not refused."""
    model, optim, x, y = _setup()
    eager_model = nn.Linear(8, 4).double()
    eager_model.load_state_dict(model.state_dict())
    eager_optim = torch.optim.SGD(eager_model.parameters(), lr=0.1)
    step = sc.compile(make_mode("ddp"))(_make_step(SEEDED[make]))
    with sc.simulate(world_size=2):
        compiled = [float(step(model, optim, x, y)) for _ in range(3)]
    eager = [float(_make_step(SEEDED[make])(eager_model, eager_optim, x, y).detach()) for _ in range(3)]
    assert compiled == pytest.approx(eager, abs=1e-12)
    assert compiled[0] != compiled[1]  # the steps moved


def test_a_librarys_own_entropy_read_goes_through():
    """The first frame outside the doors decides: here an installed package's."""
    library_file = os.path.join(sysconfig.get_paths()["purelib"], "some_library", "names.py")
    namespace: dict = {"os": os}
    exec(compile("def name():\n    return os.urandom(4).hex()\n", library_file, "exec"), namespace)
    model, optim, x, y = _setup()

    def draw() -> float:
        namespace["name"]()
        return 1.0

    with sc.simulate(world_size=2):
        assert torch.isfinite(sc.compile(make_mode("ddp"))(_make_step(draw))(model, optim, x, y))


def test_another_threads_entropy_read_goes_through():
    model, optim, x, y = _setup()

    def draw() -> float:
        drawn: list[bytes] = []
        worker = threading.Thread(target=lambda: drawn.append(os.urandom(4)))
        worker.start()
        worker.join()
        return 1.0 + 0.0 * len(drawn[0])

    with sc.simulate(world_size=2):
        assert torch.isfinite(sc.compile(make_mode("ddp"))(_make_step(draw))(model, optim, x, y))


def test_a_module_imported_in_the_step_draws_at_import_and_later_as_eager(tmp_path, monkeypatch):
    """A user module first imported inside the step, drawing at its top level (``SALT =
    urandom(4)``: eager draws it once too) compiles; it binds the patched ``urandom`` by
    name, and calling it after the compile, eagerly, draws (before: the module's import
    was refused, and its later eager calls raised SPMDCompileError outside any compile,
    a review)."""
    (tmp_path / "salted_helper.py").write_text(
        "from os import urandom\nSALT = urandom(4)\n\ndef token():\n    return urandom(8)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))

    def step(model, optim, x, y):  # noqa: ANN001, ANN202
        import salted_helper  # noqa: F401
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optim.step()
        optim.zero_grad()
        return loss

    model, optim, x, y = _setup()
    compiled = sc.compile(parallel_mode=make_mode("ddp"))(step)
    with sc.simulate(world_size=2):
        compiled(model, optim, x, y)
    import salted_helper
    assert len(salted_helper.SALT) == 4 and len(salted_helper.token()) == 8
