"""Pinning API properties, for every implementation x accelerator x backend.

Each property states one clause of the pinning specification (docs/usage.md, "Pinning"); the docstrings name it.
A tensor with no elements is never pinned: it has no bytes to copy and torch reports its data pointer as 0.
"""

from __future__ import annotations

import gc
import itertools
import os
import subprocess
import sys
import warnings

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from conformance.areas.assertions import assert_bitwise_equal, assert_names_argument, assert_pinned
from conformance.areas.strategies import dtypes, filled, host_tensors, shapes, views_of
from conformance.harness.environment import patched_environment
from reference.contract.errors import ConfigurationError

pytestmark = pytest.mark.conformance_area("pinning")


@pytest.mark.requires(calls=("pinning.pin_memory",))
@given(t=host_tensors(), match_shape=st.booleans())
def test_pin_memory_copy_preserves_values_and_leaves_input(area_api, pin_backend, backend_pins, t, match_shape):
    """make_copy=True: a new tensor with t's values (flat when match_shape=False); t is untouched."""
    before = t.clone()
    ptr = t.data_ptr()
    out = area_api.pin_memory(t, make_copy=True, match_shape=match_shape)
    assert out is not t
    assert out.dtype == t.dtype and out.device.type == "cpu" and out.is_contiguous()
    expected_shape = t.shape if match_shape else (t.numel(),)
    assert tuple(out.shape) == tuple(expected_shape)
    assert_bitwise_equal(out.view(t.shape), t, "pin_memory(make_copy=True) values")
    assert_bitwise_equal(t, before, "input after pin_memory(make_copy=True)")
    assert t.data_ptr() == ptr
    if t.numel():
        assert out.data_ptr() != ptr
    assert_pinned(area_api, out, backend_pins and t.numel() > 0, "pin_memory result")


@pytest.mark.requires(calls=("pinning.pin_memory",))
@given(t=host_tensors(), match_shape=st.booleans(), whole=st.booleans())
def test_pin_memory_copy_of_pinned_memory_is_a_new_buffer(
    area_api, pin_backend, backend_pins, t, match_shape, whole
):
    """make_copy=True copies even when ``t`` is already pinned (a pinned buffer, or a view of one): the result
    is a new pinned buffer, and writing it leaves ``t`` alone. Returning ``t`` itself ("already pinned, nothing
    to do") is the make_copy=False answer, and here it would let the caller's copy alias the original."""
    pinned = area_api.pin_empty(*t.shape, dtype=t.dtype) if whole else area_api.pin_empty(
        t.numel() + 3, dtype=t.dtype)[3:].view(t.shape)
    pinned.copy_(t)
    before = pinned.clone()
    out = area_api.pin_memory(pinned, make_copy=True, match_shape=match_shape)
    assert out is not pinned, "pin_memory(make_copy=True) of pinned memory returned its input"
    assert_bitwise_equal(out.view(t.shape), before, "pin_memory(make_copy=True) values of pinned memory")
    if t.numel():
        assert out.data_ptr() != pinned.data_ptr(), "pin_memory(make_copy=True) of pinned memory shares its memory"
        out.view(-1)[0] = out.view(-1)[0] + 1 if out.dtype != torch.bool else ~out.view(-1)[0]
        assert_bitwise_equal(pinned, before, "pinned input after writing pin_memory(make_copy=True)'s result")
    assert_pinned(area_api, out, backend_pins and t.numel() > 0, "pin_memory result of pinned memory")


def _is_view_or_window(t: torch.Tensor) -> bool:
    """Observed here from torch alone: t is a view of another tensor, or does not span its storage from 0."""
    return (t._base is not None or t.storage_offset() != 0
            or t.untyped_storage().nbytes() != t.numel() * t.element_size())


@pytest.mark.requires(calls=("pinning.pin_memory",))
@given(t=host_tensors(), match_shape=st.booleans())
def test_pin_memory_in_place_moves_tensor(area_api, pin_backend, backend_pins, t, match_shape):
    """make_copy=False: t itself is returned, holding its values, now in pinned memory when the backend pins.

    Views and windows are the subject of test_pin_memory_in_place_never_detaches_a_view; here t owns its storage.
    """
    t = t.clone() if _is_view_or_window(t) else t
    expected = t.clone()
    out = area_api.pin_memory(t, make_copy=False, match_shape=match_shape)
    assert out is t
    assert tuple(t.shape) == (tuple(expected.shape) if match_shape else (expected.numel(),))
    assert_bitwise_equal(t.view(expected.shape) if t.is_contiguous() else t.reshape(expected.shape), expected,
                         "pin_memory(make_copy=False) values")
    assert_pinned(area_api, t, backend_pins and t.numel() > 0, "tensor pinned in place")


@pytest.mark.requires(calls=("pinning.pin_memory",))
@given(t=host_tensors(), match_shape=st.booleans())
def test_pin_memory_in_place_never_detaches_a_view(area_api, pin_backend, backend_pins, leak_check, t, match_shape):
    """make_copy=False on a view (or a window into a larger storage) whose memory is not pinned yet raises a
    ConfigurationError naming make_copy and t, pins nothing, and leaves t aliasing its base (docs/usage.md,
    "Pinning in place")."""
    base = t._base if t._base is not None else t
    if not _is_view_or_window(t):
        base = filled((t.numel() + 1,), t.dtype, 0)
        t = base[1:].view(t.shape) if t.dim() else base[1]
    ptr = t.data_ptr()
    with pytest.raises(ConfigurationError) as info:
        area_api.pin_memory(t, make_copy=False, match_shape=match_shape)
    assert_names_argument(info.value, "make_copy")
    assert_names_argument(info.value, "t")
    assert t.data_ptr() == ptr, "the refused call moved t"
    assert t.untyped_storage().data_ptr() == base.untyped_storage().data_ptr(), "t no longer aliases its base"
    assert_pinned(area_api, t, False, "a view refused by pin_memory(make_copy=False)")


@pytest.mark.requires(calls=("pinning.pin_memory",))
def test_pin_memory_in_place_of_a_pinned_view_keeps_it(area_api, pin_backend, backend_pins, leak_check):
    """A view whose memory is already pinned is returned as is by make_copy=False: still the same memory."""
    base = area_api.pin_empty(4, 256, dtype=torch.float32)
    view = base[1]
    if not backend_pins:
        with pytest.raises(ConfigurationError) as info:
            area_api.pin_memory(view, make_copy=False)
        assert_names_argument(info.value, "make_copy")
        return
    ptr = view.data_ptr()
    assert area_api.pin_memory(view, make_copy=False) is view
    assert view.data_ptr() == ptr and view.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
    view.fill_(3.0)
    assert float(base[1].sum()) == 3.0 * 256


@pytest.mark.requires(calls=("pinning.pin_memory", "pinning.unpin"))
def test_unpin_sees_the_memory_the_tensor_holds_now(area_api, pin_backend, backend_pins, leak_check):
    """unpin(t) unpins the allocation holding t's current byte extent: after t.data is replaced it acts on the
    new data, never on memory t held before (keep a reference to a buffer to unpin it later)."""
    first = area_api.pin_empty(1024, dtype=torch.float32)
    second = area_api.pin_empty(1024, dtype=torch.float32)
    p = torch.nn.Parameter(torch.zeros(1024), requires_grad=False)
    p.data = first
    p.data = torch.zeros(1024)
    assert area_api.unpin(p) is False, "p now holds pageable memory"
    assert_pinned(area_api, first, backend_pins, "the buffer p held before")
    p.data = second
    native = pin_backend == "native"
    assert area_api.unpin(p) is native
    assert_pinned(area_api, second, False if native else backend_pins, "the buffer p holds, after unpin(p)")
    assert_pinned(area_api, first, backend_pins, "the buffer p held before, after unpin(p)")
    assert area_api.unpin(first) is native
    # pin_memory(make_copy=False) then unpin: the buffer pin_memory made is the one unpinned.
    q = torch.arange(512, dtype=torch.float32)
    assert area_api.pin_memory(q, make_copy=False) is q
    assert area_api.unpin(q) is native
    assert_pinned(area_api, q, False if native else backend_pins, "pinned in place, then unpinned")
    assert torch.equal(q, torch.arange(512, dtype=torch.float32))
    # Pinned in place, then .data swapped for pageable memory: unpin(r) sees the pageable memory, not its history.
    r = torch.nn.Parameter(torch.ones(256), requires_grad=False)
    area_api.pin_memory(r, make_copy=False)
    held = r.data
    r.data = torch.zeros(256)
    assert area_api.unpin(r) is False, "unpin must act on r's current memory, not on the buffer pinned for it"
    assert_pinned(area_api, held, backend_pins, "the buffer pinned for r, after r.data was replaced")
    assert area_api.unpin(held) is native


@pytest.mark.requires(calls=("pinning.pin_empty", "pinning.pin_empty_like"))
@given(shape=shapes, dtype=dtypes)
def test_pin_empty_and_like(area_api, pin_backend, backend_pins, shape, dtype):
    """pin_empty/pin_empty_like: host memory of the requested shape and dtype, contiguous, pinned per backend."""
    for out in (area_api.pin_empty(*shape, dtype=dtype), area_api.pin_empty(shape, dtype=dtype)):
        assert tuple(out.shape) == shape and out.dtype == dtype and out.device.type == "cpu"
        assert out.is_contiguous()
        assert_pinned(area_api, out, backend_pins and out.numel() > 0, "pin_empty result")
    like = area_api.pin_empty_like(torch.empty(shape, dtype=dtype, device="meta"))
    assert tuple(like.shape) == shape and like.dtype == dtype
    assert_pinned(area_api, like, backend_pins and like.numel() > 0, "pin_empty_like(meta) result")
    other = area_api.pin_empty_like(torch.empty(shape, dtype=dtype), dtype=torch.float64)
    assert other.dtype == torch.float64 and tuple(other.shape) == shape


@given(base_shape=st.lists(st.integers(1, 64), min_size=1, max_size=3).map(tuple), data=st.data())
def test_views_and_narrows_are_recognised(area_api, pin_backend, backend_pins, base_shape, data):
    """Any view, slice, narrow or reshape of a pinned buffer is pinned; a pageable copy of it is not."""
    base = area_api.pin_empty(*base_shape, dtype=torch.float32)
    view = data.draw(views_of(base))
    assert_pinned(area_api, view, backend_pins and view.numel() > 0, "view of a pinned buffer")
    assert_pinned(area_api, view.clone(), False, "pageable clone of a pinned view")


@pytest.mark.requires(areas=("ranges",))
def test_extent_past_the_allocation_is_not_pinned(impl, area_api, pin_backend):
    """The whole extent must be inside one range: one byte past the locked pages is not pinned."""
    if pin_backend != "native":
        pytest.skip("the torch backend's extents are torch's own (its allocator rounds sizes)")
    registry = impl.load("ranges").global_registry()
    page = area_api.pin_empty(4096, dtype=torch.uint8)
    assert registry.contains(page.data_ptr(), 4096)
    assert not registry.contains(page.data_ptr(), 4097)
    assert not registry.contains(page.data_ptr() + 1, 4096)
    assert_pinned(area_api, page[4095:], True, "last byte of the pinned page")


def _data_pointer_guarded(t: torch.Tensor) -> torch.Tensor:
    """``t`` with reading its data pointer made an error (torch's own flag for tensors without data): torch only
    warns, once per process, when a fake tensor's pointer is read, so a warning cannot be relied on to show that
    the pointer was touched."""
    torch._C._set_throw_on_mutable_data_ptr(t)
    return t


def test_is_pinned_on_data_less_and_device_tensors(area_api, accelerator):
    """is_pinned returns False for meta, fake and non-CPU tensors without touching their data: reading the data
    pointer of a meta or fake tensor (and of a view of one) raises here, and any warning is an error."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake_cpu = torch.empty(8, 8)
    assert mode is not None
    data_less = {"meta": _data_pointer_guarded(torch.empty(8, 8, device="meta")),
                 "fake cpu": _data_pointer_guarded(fake_cpu)}
    data_less.update({f"a view of {name}": t[2:, 1:] for name, t in list(data_less.items())})
    for name, t in data_less.items():
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert area_api.is_pinned(t) is False, f"is_pinned of a {name} tensor"
    if accelerator.device_type != "cpu":
        assert area_api.is_pinned(torch.empty(4, device=accelerator.device())) is False
    with pytest.raises(ConfigurationError) as info:
        area_api.is_pinned([1, 2, 3])
    assert_names_argument(info.value, "t")


def test_pageable_tensors_are_not_pinned(area_api, pin_backend):
    assert_pinned(area_api, torch.empty(1024), False, "plain torch.empty")


@pytest.mark.requires(calls=("pinning.unpin",))
def test_unpin_semantics(area_api, pin_backend, backend_pins, leak_check):
    """unpin drops the pin at once (True), a second unpin is False, and surviving views stay valid."""
    buf = area_api.pin_empty(3, 1024, dtype=torch.float32)
    buf.copy_(torch.arange(3 * 1024, dtype=torch.float32).view(3, 1024))
    view = buf[1]
    if pin_backend == "torch":
        assert area_api.unpin(buf) is False, "torch-backend memory is owned by torch; unpin must report False"
        return
    assert area_api.unpin(view) is True
    assert area_api.unpin(buf) is False
    assert_pinned(area_api, buf, False, "buffer after unpin")
    assert_pinned(area_api, view, False, "view after unpin")
    del buf
    gc.collect()
    # The allocation is still mapped for the surviving view: reading and writing it must be safe and exact.
    assert_bitwise_equal(view, torch.arange(1024, 2048, dtype=torch.float32), "view surviving unpin")
    view.fill_(7.0)
    assert float(view.sum()) == 7.0 * 1024
    assert area_api.pinned_stats().unpinned_alive >= 1


@pytest.mark.requires(calls=("pinning.unpin",))
def test_unpin_of_unpinned_memory_is_false(area_api, pin_backend):
    assert area_api.unpin(torch.empty(16)) is False
    assert area_api.unpin(torch.empty(16, device="meta")) is False


def test_gc_releases_native_memory_and_stats_are_consistent(impl, area_api, pin_backend, accelerator, leak_check):
    """Stats count each live native allocation page-rounded; dropping the last view releases it and its range."""
    import mmap

    if pin_backend != "native":
        pytest.skip("the torch backend's memory is accounted by torch's allocator, not pinned_stats")
    page = mmap.PAGESIZE
    gc.collect()
    s0 = area_api.pinned_stats()
    a = area_api.pin_empty(page + 1, dtype=torch.uint8)
    b = area_api.pin_empty(10, dtype=torch.float64)
    s1 = area_api.pinned_stats()
    assert s1.allocations == s0.allocations + 2
    assert s1.bytes == s0.bytes + 3 * page, f"expected {3 * page} more locked bytes, stats {s0} -> {s1}"
    registered = accelerator.supports_host_registration
    assert s1.registered_bytes - s0.registered_bytes == (3 * page if registered else 0)
    view = a[10:20]
    ptr, nbytes = view.data_ptr(), 10
    del a
    gc.collect()
    assert area_api.pinned_stats().allocations == s0.allocations + 2, "a live view must keep its allocation"
    del view, b
    gc.collect()
    assert area_api.pinned_stats() == s0
    assert not area_api.is_pinned(torch.empty(0)), "sanity"
    if impl.provides("ranges"):
        registry = impl.load("ranges").global_registry()
        assert not registry.contains(ptr, nbytes), "a freed allocation's range is still registered"


def test_register_device_flag_off_skips_registration(area_api, pin_backend, accelerator, monkeypatch, leak_check):
    if pin_backend != "native":
        pytest.skip("registration is a native-backend step")
    monkeypatch.setenv("HOSTOFFLOAD_PIN_REGISTER_DEVICE", "off")
    s0 = area_api.pinned_stats()
    buf = area_api.pin_empty(100, dtype=torch.uint8)
    s1 = area_api.pinned_stats()
    assert s1.registered_bytes == s0.registered_bytes and s1.bytes > s0.bytes
    assert_pinned(area_api, buf, True, "locked but unregistered buffer")
    del buf


@pytest.mark.parametrize(
    ("variable", "value", "allowed"),
    [
        ("HOSTOFFLOAD_PIN_BACKEND", "cuda", ("torch", "native")),
        ("HOSTOFFLOAD_PIN_BACKEND", "natve", ("torch", "native")),
        ("HOSTOFFLOAD_PIN_REGISTER_DEVICE", "maybe", ("1", "0", "true", "false", "yes", "no", "on", "off")),
        ("HOSTOFFLOAD_PIN_REGISTER_DEVICE", "2", ("1", "0", "true", "false", "yes", "no", "on", "off")),
        ("HOSTOFFLOAD_ACCELERATOR", "tpu-v9", ("cpu",)),
    ],
)
def test_bad_environment_values_fail_at_first_call(impl, area_api, accelerator, monkeypatch, variable, value, allowed):
    """A bad variable raises a ValueError naming it and the allowed values at the first pinning call."""
    monkeypatch.setenv("HOSTOFFLOAD_PIN_BACKEND", "native")
    monkeypatch.setenv(variable, value)
    gc.collect()
    before = area_api.pinned_stats()
    with pytest.raises(ValueError) as info:
        area_api.pin_empty(16, dtype=torch.float32)
    assert_names_argument(info.value, variable, *allowed)
    assert value in str(info.value), f"the message does not show the bad value {value!r}: {info.value}"
    gc.collect()
    assert area_api.pinned_stats() == before, "a rejected call left pinned memory behind"


#: The native tuning variables with a value each must refuse (name, bad value, what the message must list).
_TUNING = [
    ("HOSTOFFLOAD_PIN_HUGE_PAGES", "always", ("auto", "thp", "hugetlb", "off")),
    ("HOSTOFFLOAD_PIN_POPULATE_THREADS", "-1", ("0",)),
    ("HOSTOFFLOAD_PIN_REGISTER_OVERLAP", "maybe", ("on", "off")),
]
#: The cases that exercise one call (skipped, with the reason, where an implementation declares it unsupported).
_USES_PIN_MEMORY = pytest.mark.requires(calls=("pinning.pin_memory",))
_USES_PIN_EMPTY_LIKE = pytest.mark.requires(calls=("pinning.pin_empty_like",))
#: Every pinning call, each from scratch (the environment is read at each of them, not only at the first).
_PIN_CALLS = {
    "pin_empty": lambda api: api.pin_empty(16, dtype=torch.float32),
    "pin_empty_like": lambda api: api.pin_empty_like(torch.empty(4, 4)),
    "pin_memory": lambda api: api.pin_memory(torch.ones(8), make_copy=True),
}


@pytest.mark.requires(calls=tuple(f"pinning.{c}" for c in _PIN_CALLS))
@pytest.mark.parametrize(("variable", "value", "allowed"), _TUNING, ids=[t[0] for t in _TUNING])
def test_native_tuning_variables_are_checked_at_every_pinning_call_with_any_backend(
    area_api, pin_backend, accelerator, monkeypatch, leak_check, variable, value, allowed
):
    """docs/usage.md: every pinning variable is checked at every pinning call whatever the backend. Issue 28:
    ``HUGE_PAGES=always`` or ``POPULATE_THREADS=-1`` under the default torch backend was accepted until the day
    the backend changed. A first call succeeds; after the variable is set, each pinning call raises a
    ConfigurationError naming it, its value and the allowed values, and pins nothing."""
    kept = area_api.pin_empty(4, dtype=torch.float32)  # the first call has happened: the check is not one-shot
    try:
        monkeypatch.setenv(variable, value)
        before = area_api.pinned_stats()
        for name, call in _PIN_CALLS.items():
            with pytest.raises(ConfigurationError) as info:
                call(area_api)
            assert_names_argument(info.value, variable, *allowed)
            assert value in str(info.value), f"{name}: the message does not show {value!r}: {info.value}"
        gc.collect()
        assert area_api.pinned_stats() == before, "a refused call left pinned memory behind"
    finally:
        monkeypatch.delenv(variable, raising=False)
        area_api.unpin(kept)
        del kept


#: Misspellings handed out so far: the warning comes once per process and name, so each test asks for names of its
#: own (a name already warned about in this process, by an earlier test, would stay silent).
_TYPOS = itertools.count()


def _fresh_typo() -> str:
    """``..._PIN_BACKND_<n>``: one letter missing and a suffix never used before in this process; still closest to
    ``HOSTOFFLOAD_PIN_BACKEND``."""
    from reference.contract import envvars

    return f"{envvars.PIN_BACKEND_ENV.replace('BACKEND', 'BACKND')}_{os.getpid()}_{next(_TYPOS)}"


def _typo_warnings(caught, typo: str) -> list[str]:
    return [str(w.message) for w in caught if typo in str(w.message)]


@pytest.mark.requires(calls=tuple(f"pinning.{c}" for c in _PIN_CALLS))
def test_a_misspelled_variable_warns_naming_the_closest_declared_one(
    area_api, pin_backend, accelerator, monkeypatch, leak_check
):
    """Issue 28: ``..._PIN_BACKND=native`` (one letter missing) was silently ignored, so the run used the torch
    backend without a word. Every pinning call, as the first call made with an undeclared ``HOSTOFFLOAD_*`` name
    set, warns, naming the variable and the closest name of reference/contract/envvars.py, and still pins (the
    prefix is not reserved: a warning, not an error, docs/usage.md)."""
    from reference.contract import envvars

    for name, call in _PIN_CALLS.items():
        typo = _fresh_typo()
        monkeypatch.setenv(typo, "native")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = call(area_api)
        texts = _typo_warnings(caught, typo)
        assert texts, f"{name}: no warning names {typo} (got {[str(w.message) for w in caught]})"
        assert envvars.PIN_BACKEND_ENV in texts[0], f"{name}: the warning does not name the closest variable"
        area_api.unpin(out)
        del out
        monkeypatch.delenv(typo)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        area_api.unpin(area_api.pin_empty(4, dtype=torch.float32))
    assert not [w for w in caught if "BACKND" in str(w.message)], "the warning outlives the variable"


@pytest.mark.requires(calls=tuple(f"pinning.{c}" for c in _PIN_CALLS))
def test_a_misspelled_variable_warns_once_per_process_and_name(
    area_api, pin_backend, accelerator, monkeypatch, leak_check
):
    """Issue 52, defect 10: one misspelled variable warned at every pinning call -- three or more times per
    construct-and-step of an engine, which pins several buffers -- so the one useful line drowned in copies.
    With every warning shown (``simplefilter("always")``, which defeats Python's once-per-call-site filter), a
    misspelled name warns exactly once per process however many pinning calls follow; a second misspelled name
    gets its own one warning."""
    first, second = _fresh_typo(), _fresh_typo()
    monkeypatch.setenv(first, "native")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            for call in _PIN_CALLS.values():
                area_api.unpin(call(area_api))
        monkeypatch.setenv(second, "native")
        for call in _PIN_CALLS.values():
            area_api.unpin(call(area_api))
    assert len(_typo_warnings(caught, first)) == 1, f"{first}: {_typo_warnings(caught, first)}"
    assert len(_typo_warnings(caught, second)) == 1, f"{second}: {_typo_warnings(caught, second)}"


def test_bad_environment_is_not_an_import_error(impl, monkeypatch):
    """Importing an implementation with bad variables set must succeed: errors belong to the first call."""
    module = impl.areas["pinning"]
    code = f"import {module} as m; print('imported')"
    env = {"HOSTOFFLOAD_PIN_BACKEND": "bogus", "HOSTOFFLOAD_PIN_REGISTER_DEVICE": "bogus",
           "HOSTOFFLOAD_ACCELERATOR": "bogus"}
    import os

    proc = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and "imported" in proc.stdout, proc.stderr


@pytest.mark.parametrize(
    ("call", "argument"),
    [
        (lambda api: api.pin_empty(4, dtype=torch.float32, device="meta"), "device"),
        (lambda api: api.pin_empty(4, dtype=torch.float32, device="cuda"), "device"),
        (lambda api: api.pin_empty(-1, dtype=torch.float32), "shape"),
        (lambda api: api.pin_empty(2.5, dtype=torch.float32), "shape"),
        (lambda api: api.pin_empty(4, dtype="float32"), "dtype"),
        pytest.param(lambda api: api.pin_memory(torch.empty(2, device="meta")), "t", marks=_USES_PIN_MEMORY),
        pytest.param(lambda api: api.pin_memory([1.0, 2.0]), "t", marks=_USES_PIN_MEMORY),
        pytest.param(lambda api: api.pin_memory(torch.empty(2), make_copy="yes"), "make_copy",
                     marks=_USES_PIN_MEMORY),
        pytest.param(lambda api: api.pin_memory(torch.empty(2), match_shape=None), "match_shape",
                     marks=_USES_PIN_MEMORY),
        pytest.param(lambda api: api.pin_empty_like(3), "t", marks=_USES_PIN_EMPTY_LIKE),
    ],
)
def test_bad_arguments_name_the_argument(area_api, pin_backend, leak_check, call, argument):
    """A bad argument is a ConfigurationError whose message names that argument (the wording is free)."""
    with pytest.raises(ConfigurationError) as info:
        call(area_api)
    assert_names_argument(info.value, argument)


def test_torch_backend_without_torch_pinning_is_a_noop(area_api, accelerator, monkeypatch):
    """On an accelerator without torch pinning, the torch backend pins nothing but keeps every other promise."""
    if accelerator.has_torch_pinning:
        pytest.skip(f"{accelerator.name} has torch pinning; the no-op clause does not apply")
    monkeypatch.setenv("HOSTOFFLOAD_PIN_BACKEND", "torch")
    t = filled((4, 5), torch.float32, 1)
    copy = area_api.pin_memory(t)
    assert copy is not t and torch.equal(copy, t) and area_api.is_pinned(copy) is False
    assert area_api.pin_memory(t, make_copy=False) is t
    assert area_api.is_pinned(area_api.pin_empty(3)) is False


def test_registration_failure_warns_once_and_keeps_lock(area_api, pin_backend, accelerator, leak_check):
    """A device that refuses registration gets one warning per process; the buffer stays locked and usable."""
    if pin_backend != "native" or not accelerator.supports_host_registration:
        pytest.skip("needs the native backend on an accelerator that registers host memory")
    original = type(accelerator).register_host_memory
    try:
        type(accelerator).register_host_memory = lambda self, ptr, nbytes: False
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            a = area_api.pin_empty(64, dtype=torch.uint8)
            b = area_api.pin_empty(64, dtype=torch.uint8)
        assert area_api.is_pinned(a) and area_api.is_pinned(b)
        assert len([w for w in caught if "register" in str(w.message)]) <= 1
    finally:
        type(accelerator).register_host_memory = original
    del a, b


@pytest.mark.parametrize("pin_backend", ["torch", "native"])
@pytest.mark.parametrize("value", ["maybe", "2"])
def test_bad_register_device_is_an_error_whatever_the_backend(impl, area_api, accelerator, monkeypatch, pin_backend,
                                                              value):
    """HOSTOFFLOAD_PIN_REGISTER_DEVICE is validated at every pinning call, also when the backend does not use it.
    (The ``pin_backend`` parameter is matched against the declared backends at collection.)"""
    monkeypatch.setenv("HOSTOFFLOAD_PIN_BACKEND", pin_backend)
    monkeypatch.setenv("HOSTOFFLOAD_PIN_REGISTER_DEVICE", value)
    gc.collect()
    before = area_api.pinned_stats()
    for call in (lambda: area_api.pin_empty(4), lambda: area_api.pin_memory(torch.ones(4))):
        with pytest.raises(ConfigurationError) as info:
            call()
        assert_names_argument(info.value, "HOSTOFFLOAD_PIN_REGISTER_DEVICE")
    gc.collect()
    assert area_api.pinned_stats() == before


@pytest.mark.parametrize("spell", [str.upper, str.title, lambda v: f"  {v.upper()} "])
def test_environment_values_are_case_insensitive(impl, area_api, accelerator, monkeypatch, spell, leak_check):
    """One rule for every HOSTOFFLOAD_* value with names: blanks stripped, case ignored (CPU == cpu)."""
    backend = "native" if impl.capabilities.declares("pin_backends", "native") else "torch"
    monkeypatch.setenv("HOSTOFFLOAD_ACCELERATOR", spell(accelerator.name))
    monkeypatch.setenv("HOSTOFFLOAD_PIN_BACKEND", spell(backend))
    monkeypatch.setenv("HOSTOFFLOAD_PIN_REGISTER_DEVICE", spell("off"))
    buf = area_api.pin_empty(64, dtype=torch.uint8)
    if backend == "native":
        assert_pinned(area_api, buf, True, f"buffer pinned with {spell(backend)!r} / {spell(accelerator.name)!r}")
    assert area_api.is_pinned(torch.empty(8)) is False
    del buf


@pytest.mark.parametrize(
    "call",
    [
        lambda api: api.pin_empty(2**62, 2**62),
        lambda api: api.pin_empty((2**62, 2**62), dtype=torch.uint8),
        lambda api: api.pin_empty(2**63, dtype=torch.uint8),
        lambda api: api.pin_empty(2**61, dtype=torch.float64),
    ],
)
def test_impossible_sizes_name_the_shape(area_api, pin_backend, leak_check, call):
    """A size no allocator can hold is a ConfigurationError naming the shape, on every backend; nothing pinned."""
    with pytest.raises(ConfigurationError) as info:
        call(area_api)
    assert_names_argument(info.value, "shape")


@pytest.mark.parametrize("call", ["pin_empty", "pin_empty_like"])
def test_a_size_no_machine_can_map_is_a_pinned_allocation_error(area_api, pin_backend, leak_check, call):
    """A size the arguments allow (under 2**63 bytes) but no allocator can give -- 2**60 bytes, beyond every
    x86-64 and arm64 user address space, so it fails on any machine and overcommit policy -- is the contract's
    ``PinnedAllocationError`` (a ``MemoryError`` and a ``HostOffloadError``) naming the size and what limits it,
    on every backend; not torch's raw ``RuntimeError: [enforce fail at alloc_cpu.cpp ...]`` nor a bare
    ``MemoryError: mmap ... failed``. Nothing is left pinned or registered (leak_check)."""
    from reference.contract.errors import HostOffloadError, PinnedAllocationError

    nbytes = 2**60
    with pytest.raises(PinnedAllocationError) as info:
        if call == "pin_empty":
            area_api.pin_empty(nbytes, dtype=torch.uint8)
        else:
            area_api.pin_empty_like(torch.empty(nbytes // 8, dtype=torch.float64, device="meta"))
    assert isinstance(info.value, MemoryError) and isinstance(info.value, HostOffloadError)
    message = str(info.value)
    assert str(nbytes) in message, message
    assert "RLIMIT_MEMLOCK" in message and "overcommit" in message and "MemAvailable" in message, message


@pytest.mark.parametrize("layout", ["sparse_coo", "sparse_csr"])
@pytest.mark.parametrize("call", ["is_pinned", "unpin", "pin_memory", "pin_empty_like"])
def test_sparse_tensors_are_refused_naming_the_argument(area_api, pin_backend, leak_check, layout, call):
    """Sparse tensors have no single byte extent: every call refuses them by name, the same way everywhere."""
    dense = torch.eye(4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "sparse CSR support is in beta"
        sparse = dense.to_sparse() if layout == "sparse_coo" else dense.to_sparse_csr()
    with pytest.raises(ConfigurationError) as info:
        getattr(area_api, call)(sparse)
    assert_names_argument(info.value, "t")


class _Subclass(torch.Tensor):
    """A plain tensor subclass (as wrappers such as parameters-with-metadata are): its data is its own."""


def _exotic(kind: str) -> torch.Tensor:
    """A pageable host tensor of ``kind`` (one of :data:`EXOTIC`)."""
    dense = torch.arange(12, dtype=torch.float32).view(3, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nested, sparse CSR, quantized creation warn (prototype, beta, deprecated)
        if kind == "nested":
            return torch.nested.nested_tensor([dense[:1], dense[1:]])
        if kind == "nested_jagged":
            return torch.nested.nested_tensor([dense[:1], dense[1:]], layout=torch.jagged)
        if kind == "sparse_coo":
            return dense.to_sparse()
        if kind == "sparse_csr":
            return dense.to_sparse_csr()
        if kind == "quantized":
            return torch.quantize_per_tensor(dense, 0.5, 0, torch.qint8)
        if kind == "subclass":
            return dense.clone().as_subclass(_Subclass)
        if kind == "meta":
            return torch.empty(3, 4, device="meta")
    raise AssertionError(kind)


#: For each kind: what is_pinned / unpin answer for a pageable one ("refused": ConfigurationError naming ``t``),
#: and whether pin_memory / pin_empty_like (no dtype) make a dense pinned tensor of it or refuse it naming ``t``.
#: Layouts without one strided host buffer (sparse, jagged) are refused by every call; a strided nested tensor
#: packs its components in one buffer, which the queries answer about, but has no single shape to copy into; a
#: quantized tensor is strided, but a pinned copy of its integers would lose its scale and zero point.
EXOTIC = {
    "nested": {"query": False, "pin_memory": "refused", "pin_empty_like": "refused"},
    "nested_jagged": {"query": "refused", "pin_memory": "refused", "pin_empty_like": "refused"},
    "sparse_coo": {"query": "refused", "pin_memory": "refused", "pin_empty_like": "refused"},
    "sparse_csr": {"query": "refused", "pin_memory": "refused", "pin_empty_like": "refused"},
    "quantized": {"query": False, "pin_memory": "refused", "pin_empty_like": "refused"},
    "subclass": {"query": False, "pin_memory": "dense", "pin_empty_like": "dense"},
    "meta": {"query": False, "pin_memory": "refused", "pin_empty_like": "dense"},
}


@pytest.mark.parametrize("kind", sorted(EXOTIC))
@pytest.mark.parametrize("call", ["is_pinned", "unpin", "pin_memory", "pin_empty_like"])
def test_exotic_tensors_get_the_same_answer_everywhere(area_api, pin_backend, backend_pins, leak_check, kind, call):
    """Nested (strided and jagged), sparse COO and CSR, quantized, tensor-subclass and meta tensors: every
    implementation answers each pinning call the one way docs/usage.md ("Tensors that are not plain") says --
    a value, or a ConfigurationError naming ``t`` -- never an error from inside torch. (``reference.is_pinned`` of
    a strided nested tensor raised torch's "NestedTensorImpl doesn't support sizes" while ``optimized`` said
    False.)"""
    t = _exotic(kind)
    expected = EXOTIC[kind]["query" if call in ("is_pinned", "unpin") else call]
    if expected == "refused":
        with pytest.raises(ConfigurationError) as info:
            getattr(area_api, call)(t)
        assert_names_argument(info.value, "t")
        return
    out = getattr(area_api, call)(t)
    if call in ("is_pinned", "unpin"):
        assert out is expected, f"{call}({kind}) returned {out!r}, expected {expected!r}"
        return
    assert type(out) is torch.Tensor and out.layout is torch.strided and not out.is_nested, type(out)
    assert tuple(out.shape) == tuple(t.shape) and out.dtype == t.dtype and out.device.type == "cpu"
    assert_pinned(area_api, out, backend_pins, f"{call}({kind})")
    if call == "pin_memory":
        assert_bitwise_equal(out, t.as_subclass(torch.Tensor), f"pin_memory({kind}) values")


def test_a_subclass_of_pinned_memory_is_pinned_and_quantized_dtypes_are_refused(area_api, pin_backend,
                                                                                 backend_pins, leak_check):
    """The queries look at the memory, whatever wraps it: a tensor subclass over a pinned buffer is pinned; a
    quantized dtype is refused by ``pin_empty`` naming ``dtype`` (nothing is allocated)."""
    base = area_api.pin_empty(3, 4)
    assert_pinned(area_api, base.as_subclass(_Subclass), backend_pins, "subclass view of a pinned buffer")
    with pytest.raises(ConfigurationError) as info:
        area_api.pin_empty(3, 4, dtype=torch.qint8)
    assert_names_argument(info.value, "dtype")
    del base
    gc.collect()


@pytest.mark.parametrize("call", ["is_pinned", "unpin"])
def test_sparse_tensors_off_the_cpu_are_refused_too(area_api, accelerator, call):
    """A non-CPU tensor is never pinned, but a sparse one is refused first, as on the CPU: the layout check comes
    before the device answer (a fast path that answers device tensors must not skip it)."""
    device = accelerator.device() if accelerator.device_type != "cpu" else torch.device("meta")
    sparse = torch.empty(4, 4, layout=torch.sparse_coo, device=device)
    with pytest.raises(ConfigurationError, match=r"t must be a dense \(strided\) tensor"):
        getattr(area_api, call)(sparse)
    assert area_api.is_pinned(torch.empty(4, 4, device=device)) is False
    assert area_api.is_pinned(torch.nn.Parameter(torch.empty(4, 4, device=device))) is False


class _HookRecorder:
    """Registration hooks patched onto the accelerator's class: they record what is registered and can fail."""

    def __init__(self, monkeypatch, accelerator, *, unregister_failures=0, register_error=None):
        self.registered: set[int] = set()
        self.unregister_failures = unregister_failures
        cls = type(accelerator)
        recorder = self

        def register(self, ptr, nbytes):
            if register_error is not None:
                raise register_error
            recorder.registered.add(ptr)
            return True

        def unregister(self, ptr):
            if recorder.unregister_failures:
                recorder.unregister_failures -= 1
                raise RuntimeError("device busy: cannot unregister now")
            recorder.registered.discard(ptr)

        monkeypatch.setattr(cls, "supports_host_registration", property(lambda self: True))
        monkeypatch.setattr(cls, "register_host_memory", register)
        monkeypatch.setattr(cls, "unregister_host_memory", unregister)


@pytest.mark.requires(pin_backends="native")
def test_a_buffer_freed_by_the_collector_inside_an_unpin_hook_does_not_deadlock(impl, area_api, accelerator,
                                                                               monkeypatch, leak_check):
    """The accelerator's unregister hook is arbitrary code: the garbage collector may run inside it and free another
    pinned buffer whose last reference sat in a cycle. That nested release must complete (no lock of the
    implementation may be held non-reentrantly around the hook), and both buffers end up unpinned."""
    import threading

    monkeypatch.setenv("HOSTOFFLOAD_PIN_BACKEND", "native")
    hooks = _HookRecorder(monkeypatch, accelerator)
    recorded_unregister = type(accelerator).unregister_host_memory

    def collecting_unregister(self, ptr):
        gc.collect()  # frees the cyclic buffer now, from inside the hook
        return recorded_unregister(self, ptr)

    monkeypatch.setattr(type(accelerator), "unregister_host_memory", collecting_unregister)
    gc.collect()
    s0 = area_api.pinned_stats()
    gc.disable()
    try:
        first = area_api.pin_empty(4096, dtype=torch.uint8)
        cycle: list = [area_api.pin_empty(4096, dtype=torch.uint8)]
        cycle.append(cycle)  # the second buffer is now reachable only through a cycle
        del cycle
        assert len(hooks.registered) == 2
        done = threading.Event()
        outcome: list = []

        def unpin_first():
            try:
                outcome.append(area_api.unpin(first))
            except BaseException as exc:  # reported below
                outcome.append(exc)
            done.set()

        threading.Thread(target=unpin_first, daemon=True).start()
        assert done.wait(30), "unpin did not return: a buffer freed by the collector inside its hook deadlocked it"
    finally:
        gc.enable()
    assert outcome == [True], outcome
    first = None  # the last reference: its pages are released now
    gc.collect()
    assert not hooks.registered and area_api.pinned_stats() == s0


@pytest.mark.requires(pin_backends="native")
def test_unpin_with_failing_unregister_hook_raises_keeps_the_pin_and_can_be_retried(
    impl, area_api, accelerator, monkeypatch, leak_check
):
    """docs/native.md, "When an accelerator hook fails": unpin raises the hook's error and changes nothing (still
    pinned, registered, locked, counted); a retry that succeeds unpins, and a third call answers False."""
    from conformance.areas.assertions import vm_locked_kib as locked_kib

    monkeypatch.setenv("HOSTOFFLOAD_PIN_BACKEND", "native")
    hooks = _HookRecorder(monkeypatch, accelerator, unregister_failures=1)
    gc.collect()
    s0 = area_api.pinned_stats()
    buf = area_api.pin_empty(3 * 4096, dtype=torch.uint8)
    s1, locked1 = area_api.pinned_stats(), locked_kib()
    assert s1.registered_bytes > s0.registered_bytes and len(hooks.registered) == 1, (s0, s1)
    with pytest.raises(RuntimeError, match="device busy"):
        area_api.unpin(buf[4096:])
    assert area_api.is_pinned(buf), "a failed unpin must leave the buffer pinned"
    assert area_api.pinned_stats() == s1, "a failed unpin changed the counters"
    assert locked_kib() == locked1, "a failed unpin unlocked pages"
    assert len(hooks.registered) == 1, "the registration must still be there"
    assert area_api.unpin(buf) is True, "the retry must unpin"
    assert not hooks.registered and area_api.is_pinned(buf) is False
    assert area_api.pinned_stats().allocations == s0.allocations and locked_kib() < locked1
    assert area_api.unpin(buf) is False
    del buf


@pytest.mark.requires(pin_backends="native")
def test_register_hook_that_raises_propagates_and_leaves_nothing(impl, area_api, accelerator, monkeypatch,
                                                                 leak_check):
    """A register hook must return False to refuse; one that raises is a broken plugin: the pinning call raises
    that error and nothing stays mapped, locked, registered or in the registry."""
    from conformance.areas.assertions import vm_locked_kib as locked_kib

    monkeypatch.setenv("HOSTOFFLOAD_PIN_BACKEND", "native")
    hooks = _HookRecorder(monkeypatch, accelerator, register_error=RuntimeError("plugin bug in register"))
    gc.collect()
    s0, locked0 = area_api.pinned_stats(), locked_kib()
    for call in (lambda: area_api.pin_empty(4096, dtype=torch.uint8), lambda: area_api.pin_memory(torch.ones(64))):
        with pytest.raises(RuntimeError, match="plugin bug in register"):
            call()
    gc.collect()
    assert area_api.pinned_stats() == s0 and locked_kib() == locked0 and not hooks.registered


def test_is_pinned_miss_follows_the_accelerator_variable(area_api, accelerator, backend_pins, pin_backend,
                                                         monkeypatch):
    """A miss (pageable tensor) may be answered from a cache, but never from a stale one: the accelerator variable
    is read at every call, a bad value raises even after many misses, and the answer comes back when it is fixed."""
    t, empty = torch.empty(64), torch.empty(0)
    pinned = area_api.pin_empty(64)
    for _ in range(3):
        assert area_api.is_pinned(t) is False and area_api.is_pinned(empty) is False
    monkeypatch.setenv("HOSTOFFLOAD_ACCELERATOR", "no-such-accelerator")
    for _ in range(2):
        with pytest.raises(ConfigurationError) as info:
            area_api.is_pinned(t)
        assert_names_argument(info.value, "HOSTOFFLOAD_ACCELERATOR")
    monkeypatch.setenv("HOSTOFFLOAD_ACCELERATOR", accelerator.name.upper())
    assert area_api.is_pinned(t) is False
    monkeypatch.setenv("HOSTOFFLOAD_ACCELERATOR", accelerator.name)
    assert area_api.is_pinned(t) is False and area_api.is_pinned(empty) is False
    assert area_api.is_pinned(pinned) is backend_pins
    del pinned


def test_is_pinned_miss_sees_every_change_of_the_environment(area_api, accelerator, monkeypatch):
    """The accelerator variable may be read from a cache only while the environment is unchanged (the optimized
    implementation re-scans the environment only when its array changed), so every way the variable can change
    must be seen by the very next miss: set by appending, its value replaced (also by a string the C library had
    already handed out once), entries before it removed (the rest shift down), other variables added and removed
    after it, and it removed, while it is set and while it is not. A bad value raises; a good or no value
    answers."""
    name, bad, t = "HOSTOFFLOAD_ACCELERATOR", "no-such-accelerator", torch.empty(64)

    def answers(expect_error: bool, step: str) -> None:
        for _ in range(2):  # the second call is the one a cache would answer
            if expect_error:
                with pytest.raises(ConfigurationError, match=name):
                    area_api.is_pinned(t)
            else:
                assert area_api.is_pinned(t) is False, step

    monkeypatch.delenv(name, raising=False)
    # Grow the environment array, then shrink it back: the C library's later additions then fit in the array it
    # already has and it stays where it is, which is when a cached picture of it can be fooled (below).
    padding = [f"ENVWALK_PAD{i}" for i in range(64)]
    for pad in padding:
        monkeypatch.setenv(pad, "1")
    for pad in padding:
        monkeypatch.delenv(pad)
    steps = [
        ("unset", lambda: None, False),
        ("another variable appended after the scan", lambda: monkeypatch.setenv("ENVWALK_BEFORE", "1"), False),
        ("set, appended last", lambda: monkeypatch.setenv(name, bad), True),
        ("value replaced by a good one", lambda: monkeypatch.setenv(name, accelerator.name), False),
        ("value replaced by the bad one again", lambda: monkeypatch.setenv(name, bad), True),
        ("a variable before it removed", lambda: monkeypatch.delenv("ENVWALK_BEFORE"), True),
        ("a variable appended after it", lambda: monkeypatch.setenv("ENVWALK_AFTER", "1"), True),
        ("removed while not last", lambda: monkeypatch.delenv(name), False),
        ("the last variable removed while it is unset", lambda: monkeypatch.delenv("ENVWALK_AFTER"), False),
        ("set again", lambda: monkeypatch.setenv(name, bad), True),
        ("removed while last", lambda: monkeypatch.delenv(name), False),
        ("set to a good value", lambda: monkeypatch.setenv(name, accelerator.name), False),
        ("the good value replaced by a bad one", lambda: monkeypatch.setenv(name, bad), True),
        ("removed again", lambda: monkeypatch.delenv(name), False),
        ("two variables appended while it is unset", lambda: (monkeypatch.setenv("ENVWALK_EARLIER", "1"),
                                                              monkeypatch.setenv("ENVWALK_LAST", "1")), False),
        # Between two calls: it is set (appended), the last variable is removed and set again to the same value
        # (the C library may hand back the very same string), and an earlier variable is removed. The array then
        # has its old length and its old last entry, yet the variable is set.
        ("set, then the last variable re-set and an earlier one removed", lambda: (
            monkeypatch.setenv(name, bad), monkeypatch.delenv("ENVWALK_LAST"),
            monkeypatch.setenv("ENVWALK_LAST", "1"), monkeypatch.delenv("ENVWALK_EARLIER")), True),
    ]
    for step, change, expect_error in steps:
        change()
        answers(expect_error, step)


_ENV_NAMES = ("HOSTOFFLOAD_ACCELERATOR", "ENVWALK_E1", "ENVWALK_E2", "ENVWALK_E3")
# The accelerator variable is drawn as often as the three others together: the changes that matter are its own.
# Most changes are followed by two misses (the second is the one a cache answers); the others are not, so that
# several changes can pile up between two calls.
_env_names_drawn = (_ENV_NAMES[0],) * 3 + _ENV_NAMES[1:]
_env_ops = st.lists(
    st.tuples(
        st.sampled_from(("set", "set", "unset")),
        st.sampled_from(_env_names_drawn),
        st.sampled_from(("bad", "good", "1")),
        st.sampled_from((True, True, True, False)),
    ),
    min_size=4,
    max_size=40,
)


@given(ops=_env_ops)
def test_is_pinned_miss_follows_any_sequence_of_environment_changes(area_api, accelerator, ops):
    """The walk above, generalised: any interleaving of setting and removing the accelerator variable and three
    others, with misses asked in between or not, and every miss answers for the environment of that moment (a bad
    value raises, a good one or none answers False). The walk pins down the sequences known to be tricky; this
    tries the interleavings nobody listed, on an array grown first as in the walk."""
    t = torch.empty(64)
    with patched_environment(dict.fromkeys(_ENV_NAMES)):  # all four unset, restored after
        for pad in (padding := [f"ENVWALK_PAD{i}" for i in range(64)]):  # see the walk above
            os.environ[pad] = "1"
        for pad in padding:
            del os.environ[pad]
        for op, name, value, ask in ops:
            if op == "set":
                if name == _ENV_NAMES[0]:
                    spelled = {"bad": "no-such-accelerator", "good": accelerator.name, "1": accelerator.name.upper()}
                    value = spelled[value]
                os.environ[name] = value
            else:
                os.environ.pop(name, None)
            for _ in range(2 if ask else 0):
                if os.environ.get(_ENV_NAMES[0]) == "no-such-accelerator":
                    with pytest.raises(ConfigurationError, match=_ENV_NAMES[0]):
                        area_api.is_pinned(t)
                else:
                    assert area_api.is_pinned(t) is False, f"after {ops}"
