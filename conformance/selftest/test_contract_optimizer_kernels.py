"""The optimizer-kernel area's declarations (reference/contract/optimizer_kernels.py) refuse what they must.

A kernel that is not bitwise declares a :class:`Tolerance`; the suite then accepts any result within it. So the
ceiling on that tolerance (``MAX_RTOL``, ``MAX_ATOL``) is what stops a port from declaring its way past R16: a
tolerance just over it must be refused, one exactly at it accepted. And a declaration is a value the suite reads
once and trusts afterwards: it cannot be changed after it was checked. (Mutation testing found all of this
unjudged, issue 50: the cap could be loosened, the bound made strict, the classes made mutable.)
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from reference.contract.optimizer_kernels import MAX_ATOL, MAX_RTOL, AdamKernel, Tolerance

pytestmark = pytest.mark.conformance_area("harness")


def _step(*args, **kwargs) -> None:
    return None


@pytest.mark.parametrize("name", ["rtol", "atol"])
def test_tolerance_is_capped(name):
    """At the cap and at zero: accepted. Just over the cap, negative, NaN, infinite, a bool, a str: a ValueError
    naming the field and the cap's constant."""
    cap = MAX_RTOL if name == "rtol" else MAX_ATOL
    other = "atol" if name == "rtol" else "rtol"
    for ok in (0, 0.0, cap, cap / 2):
        assert getattr(Tolerance(**{name: ok, other: 0.0, "reason": "r"}), name) == ok
    for bad in (math.nextafter(cap, 1.0), cap * 2, 1.0, -1e-9, float("nan"), float("inf"), True, "1e-6", None):
        with pytest.raises(ValueError, match=rf"Tolerance\.{name}=.*MAX_{name.upper()}"):
            Tolerance(**{name: bad, other: 0.0, "reason": "r"})


def test_tolerance_needs_a_reason():
    for bad in ("", "   ", None, 3):
        with pytest.raises(ValueError, match=r"Tolerance\.reason"):
            Tolerance(rtol=1e-6, atol=1e-7, reason=bad)


def test_declarations_cannot_change_after_their_check():
    """Tolerance and AdamKernel are frozen: a field assigned after construction would skip the checks above."""
    tol = Tolerance(rtol=1e-6, atol=1e-7, reason="another operation order")
    kernel = AdamKernel(name="k", step=_step, arithmetic=tol)
    with pytest.raises(dataclasses.FrozenInstanceError):
        tol.rtol = 1.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        kernel.arithmetic = "anything"
    assert not kernel.bitwise and "rtol 1e-06" in kernel.describe()


@pytest.mark.parametrize("name", ["Upper", "with space", "", "-lead", "a/b", 3, None])
def test_a_kernel_name_is_a_lower_case_identifier(name):
    """The name is part of test ids and report keys: lower-case letters, digits, '_', '.', '-', not starting with
    a separator; anything else (a non-str too) is a ValueError naming the field."""
    with pytest.raises(ValueError, match=r"AdamKernel\.name="):
        AdamKernel(name=name, step=_step)
    assert AdamKernel(name="torch-optim.adam_2", step=_step).name == "torch-optim.adam_2"


@pytest.mark.parametrize(
    ("field", "value"),
    [("optimizers", ("sgd",)), ("optimizers", ()), ("optimizers", ["adam"]), ("state_precisions", ("fp8",)),
     ("state_precisions", ()), ("state_precisions", ["float32"])],
)
def test_a_kernel_claims_only_known_optimizers_and_precisions(field, value):
    """What a kernel claims to implement is a non-empty tuple of the names the suite knows how to judge; an
    unknown one would be judged against nothing."""
    with pytest.raises(ValueError, match=rf"AdamKernel 'k': {field}="):
        AdamKernel(name="k", step=_step, **{field: value})


@pytest.mark.parametrize(
    ("field", "value"),
    [("devices", "cpu"), ("devices", ("cpu", 3)), ("devices", ("",)), ("variants", ["a"]), ("variants", ("",)),
     ("requires", ("triton", None)), ("requires", ("",))],
)
def test_a_kernel_lists_names_as_tuples_of_non_empty_str(field, value):
    """devices, variants and requires are tuples of non-empty names (a bare str would be read letter by letter)."""
    with pytest.raises(ValueError, match=rf"AdamKernel 'k': {field}=.*tuple of names"):
        AdamKernel(name="k", step=_step, **{field: value})
    with pytest.raises(ValueError, match="at least one device type"):
        AdamKernel(name="k", step=_step, devices=())
