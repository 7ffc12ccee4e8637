# ruff: noqa: B009 (getattr with a constant name is the case under test)
"""``reads_computed_attributes``: which code reads an attribute through a name it
computes (NOTE: [guards on the names the code reads] in ``spmd_compiler/capture/guards.py``:
such code turns the walk by name off). A name the code holds as a string constant is not
computed; anything the stack walk cannot follow counts as computed."""

from __future__ import annotations

import functools
import operator

import pytest

from spmd_compiler.capture.code_names import reads_computed_attributes


def helper(value: object) -> object:
    return value


def constant(self):  # noqa: ANN001, ANN201
    return getattr(self, "scale")


def constant_with_default(self):  # noqa: ANN001, ANN201
    return getattr(self.inner.cfg, "scale", None)


def constant_on_a_call(self, k):  # noqa: ANN001, ANN201
    return getattr(helper(k), "scale")


def nested_constants(self):  # noqa: ANN001, ANN201
    return getattr(getattr(self, "inner"), "scale")


def default_with_a_call(self):  # noqa: ANN001, ANN201
    return getattr(self, "a", helper(getattr(self, "b", 0)))


def method_constant(self):  # noqa: ANN001, ANN201
    return self.__getattribute__("scale") + hasattr(self, "bias")


def concatenated(self, kind):  # noqa: ANN001, ANN201
    return getattr(self, "gain_" + kind)


def f_string(self, kind):  # noqa: ANN001, ANN201
    return hasattr(self, f"use_{kind}")


def variable(self, names):  # noqa: ANN001, ANN201
    return [getattr(self, n) for n in names]  # in a comprehension: nested code


def handed_on(self, path):  # noqa: ANN001, ANN201
    return functools.reduce(getattr, path.split("."), self)


def chosen(self, flag):  # noqa: ANN001, ANN201
    return getattr(self, "a" if flag else "b")


def method_variable(self, name):  # noqa: ANN001, ANN201
    return self.__getattribute__(name)


def unbound_variable(self, name):  # noqa: ANN001, ANN201
    return object.__getattribute__(self, name)


def not_an_identifier(self):  # noqa: ANN001, ANN201
    return getattr(self, "a.b")


def attrgetter_any(self):  # noqa: ANN001, ANN201
    return operator.attrgetter("a.b")(self)


def in_a_lambda(self, kind):  # noqa: ANN001, ANN201
    return (lambda: getattr(self, kind))()


@pytest.mark.parametrize(
    "fn", [constant, constant_with_default, constant_on_a_call, nested_constants, default_with_a_call, method_constant]
)
def test_constant_names_are_not_computed(fn):  # noqa: ANN001
    assert not reads_computed_attributes(fn.__code__)


@pytest.mark.parametrize(
    "fn",
    [concatenated, f_string, variable, handed_on, chosen, method_variable, unbound_variable, not_an_identifier,
     attrgetter_any, in_a_lambda],
)
def test_computed_names_are_found(fn):  # noqa: ANN001
    assert reads_computed_attributes(fn.__code__)
