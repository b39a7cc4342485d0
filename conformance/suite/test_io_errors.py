"""Every error of the swap I/O area, on every implementation providing "io".

Bad arguments and knobs raise ConfigurationError at once, naming the argument and its allowed values, and submit
nothing. Everything the file decides (missing directory or file, short file, foreign or incomplete record, dtype
or size mismatch, out of space, a write failing half way) is raised by ``wait()`` as the reference's error class,
leaves no file at the path for a failed new file, marks an in-place record incomplete, and returns every bounce
buffer. Failures half way are real kernel failures: the file-size limit (RLIMIT_FSIZE, with SIGXFSZ ignored) makes
the kernel refuse the write past a given byte, and /dev/full refuses every write with ENOSPC.
"""

from __future__ import annotations

import contextlib
import errno
import os
import resource
import signal

import pytest
import torch

from conformance.areas.assertions import assert_names_argument
from conformance.areas.io_assertions import assert_round_trip, assert_swap_error
from conformance.areas.io_strategies import BAD_KNOBS
from reference.contract import io_errors
from reference.contract.envvars import PIN_BACKEND_ENV, PIN_REGISTER_DEVICE_ENV
from reference.contract.errors import ConfigurationError, HostOffloadError, UnsupportedOperationError

pytestmark = pytest.mark.conformance_area("io")


def _raised(request) -> BaseException | None:
    try:
        request.wait()
    except Exception as exc:  # the test inspects whatever came out
        return exc
    return None


@contextlib.contextmanager
def file_size_limit(nbytes: int):
    """Make the kernel refuse writes past ``nbytes`` in this process (EFBIG) for the duration of the block."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old_handler)


@pytest.fixture
def pin_empty(impl, accelerator, monkeypatch):
    monkeypatch.setenv(PIN_BACKEND_ENV, "native")
    return impl.load("pinning").pin_empty


# -- configuration and arguments ----------------------------------------------------------------------------------
@pytest.mark.parametrize(("knob", "value"), [(k, v) for k, vs in BAD_KNOBS.items() for v in vs])
def test_bad_knob_is_a_configuration_error_naming_it(area_api, knob, value):
    with pytest.raises(ConfigurationError) as info:
        area_api.SwapHandle(**{knob: value})
    assert_names_argument(info.value, knob, *(("True", "False") if knob == "use_o_direct" else ()))


def test_good_knobs_are_accepted(area_api):
    for kw in ({"queue_depth": 1}, {"queue_depth": 1024, "num_threads": 1}, {"block_size": 4096},
               {"block_size": 256 << 20}, {"num_threads": 64, "queue_depth": 2}, {"use_o_direct": False}):
        with area_api.SwapHandle(**kw) as h:
            assert getattr(h.config, next(iter(kw))) == kw[next(iter(kw))]


@pytest.mark.parametrize(
    ("argument", "call"),
    [
        ("tensor", lambda h, p: h.write([1.0, 2.0], p)),
        ("tensor", lambda h, p: h.read(torch.empty(3, device="meta"), p)),
        ("path", lambda h, p: h.write(torch.ones(3), 7)),
        ("path", lambda h, p: h.write(torch.ones(3), b"/tmp/x")),
        ("path", lambda h, p: h.read(torch.ones(3), "")),
        ("offset", lambda h, p: h.write(torch.ones(3), p, -1)),
        ("offset", lambda h, p: h.write(torch.ones(3), p, True)),
        ("offset", lambda h, p: h.read(torch.ones(3), p, 1.5)),
    ],
)
def test_bad_argument_raises_at_once_and_submits_nothing(area_api, tmp_path, argument, call):
    with area_api.SwapHandle() as h:
        with pytest.raises(ConfigurationError) as info:
            call(h, str(tmp_path / "x"))
        assert_names_argument(info.value, argument)
        s = h.stats()
        assert (s.requests, s.in_flight) == (0, 0), s
    assert os.listdir(tmp_path) == []


def test_closed_handle_refuses_requests(area_api, tmp_path):
    h = area_api.SwapHandle()
    h.close()
    h.close()  # idempotent
    assert h.closed
    with pytest.raises(area_api.HandleClosedError) as info:
        h.write(torch.ones(4), str(tmp_path / "x"))
    assert isinstance(info.value, UnsupportedOperationError)
    with pytest.raises(UnsupportedOperationError):
        h.read(torch.ones(4), str(tmp_path / "x"))


# -- errors raised by wait() --------------------------------------------------------------------------------------
def test_missing_directory_on_write(area_api, reference_api, tmp_path):
    path = str(tmp_path / "no" / "such" / "dir" / "f.bin")
    with area_api.SwapHandle() as h:
        req = h.write(torch.ones(100), path)
        exc = _raised(req)
        assert_swap_error(exc, reference_api.SwapFileNotFoundError, path, "write into a missing directory")
        assert isinstance(exc, FileNotFoundError) and isinstance(exc, OSError) and exc.errno == errno.ENOENT
        assert exc.request is req
    assert os.listdir(tmp_path) == []


def test_missing_file_on_read(area_api, reference_api, tmp_path):
    path = str(tmp_path / "absent.bin")
    with area_api.SwapHandle() as h:
        exc = _raised(h.read(torch.empty(10), path))
    assert_swap_error(exc, reference_api.SwapFileNotFoundError, path, "read of a missing file")


@pytest.mark.parametrize("cut", ["inside-payload", "inside-header", "empty", "offset-past-end"])
def test_short_file(area_api, reference_api, tmp_path, cut):
    path = str(tmp_path / "short.bin")
    t = torch.arange(3000, dtype=torch.float32)
    with area_api.SwapHandle(block_size=4096) as h:
        h.write(t, path).wait()
        full = reference_api.record_nbytes(t.numel() * 4)
        offset = 0
        if cut == "inside-payload":
            os.truncate(path, full - 1)
        elif cut == "inside-header":
            os.truncate(path, reference_api.HEADER_SIZE - 10)
        elif cut == "empty":
            os.truncate(path, 0)
        else:
            offset = full
        exc = _raised(h.read(torch.empty(3000), path, offset))
        assert_swap_error(exc, reference_api.ShortFileError, path, f"short file ({cut})")
        assert isinstance(exc, EOFError)


@pytest.mark.parametrize(
    ("dtype", "numel", "error"),
    [
        (torch.int32, 1000, "DtypeMismatchError"),  # same byte count, other dtype
        (torch.float64, 500, "DtypeMismatchError"),
        (torch.float32, 999, "SizeMismatchError"),
        (torch.float32, 1001, "SizeMismatchError"),
    ],
)
def test_dtype_or_size_mismatch(area_api, reference_api, tmp_path, dtype, numel, error):
    path = str(tmp_path / "m.bin")
    with area_api.SwapHandle() as h:
        h.write(torch.ones(1000, dtype=torch.float32), path).wait()
        dst = torch.full((numel,), 7, dtype=dtype)
        exc = _raised(h.read(dst, path))
        assert_swap_error(exc, getattr(reference_api, error), path, f"read into {numel} x {dtype}")
        assert isinstance(exc, ValueError) and isinstance(exc, reference_api.RecordError)
        assert str(dtype).removeprefix("torch.") in str(exc) or str(numel * dst.element_size()) in str(exc), exc


def test_no_record_at_offset(area_api, reference_api, tmp_path):
    path = str(tmp_path / "r.bin")
    with area_api.SwapHandle() as h:
        h.write(torch.ones(10), path, 3 * 4096).wait()  # bytes before the record are a hole (zeros)
        exc = _raised(h.read(torch.empty(10), path, 0))
        assert_swap_error(exc, reference_api.RecordFormatError, path, "read of a hole")
        other = str(tmp_path / "garbage.bin")
        with open(other, "wb") as f:
            f.write(os.urandom(3 * 4096))
        exc = _raised(h.read(torch.empty(10), other, 0))
        assert_swap_error(exc, reference_api.RecordFormatError, other, "read of a foreign file")


@pytest.mark.parametrize("memory", ["pageable", "pinned"])
@pytest.mark.requires(areas=("pinning",))
def test_new_file_write_refused_by_the_kernel_leaves_no_file(area_api, reference_api, pin_empty, tmp_path, memory):
    """A new file that cannot be written in full (the kernel refuses bytes past the limit, part way through the
    payload or, where an implementation reserves the file's size first, up front): no file at the path, no
    temporary left, nothing leaked, and the handle keeps working."""
    path = str(tmp_path / "new.bin")
    n = 64 * 1024
    src = pin_empty(n, dtype=torch.uint8) if memory == "pinned" else torch.empty(n, dtype=torch.uint8)
    src.copy_(torch.arange(n) % 256)
    with area_api.SwapHandle(block_size=4096, queue_depth=2, num_threads=2) as h:
        with file_size_limit(6 * 4096):
            req = h.write(src, path)
            exc = _raised(req)
        assert_swap_error(exc, reference_api.SwapIOError, path, "write past the file-size limit")
        assert exc.errno == errno.EFBIG, exc.errno
        assert os.listdir(tmp_path) == [], f"left behind: {os.listdir(tmp_path)}"
        s = h.stats()
        assert (s.bounce_in_use, s.in_flight, s.failed_requests) == (0, 0, 1), s
        # The handle keeps working after a failed request.
        h.write(src, path).wait()
        out = torch.empty_like(src)
        h.read(out, path).wait()
        assert_round_trip(out, src, "write after a failed one")


@pytest.mark.parametrize("memory", ["pageable", "pinned"])
@pytest.mark.parametrize("where", ["overwrite", "append"])
@pytest.mark.requires(areas=("pinning",))
def test_in_place_update_failing_half_way_is_incomplete_not_data(area_api, reference_api, pin_empty, tmp_path,
                                                                 where, memory):
    """Updating a record of an existing file dies half way: that record reads as incomplete, others stay good.

    ``overwrite`` rewrites an existing record inside the file, so the kernel refuses the payload after its first
    blocks (a failure in the middle of the request, whatever the implementation does up front); ``append`` adds a
    record past the end of the file.
    """
    path = str(tmp_path / "packed.bin")
    first, second = torch.arange(1000, dtype=torch.float32), torch.arange(16384, dtype=torch.float32)
    off2 = reference_api.record_span(first.numel() * 4)
    off3 = off2 + reference_api.record_span(second.numel() * 4)
    target = off2 if where == "overwrite" else off3
    update = pin_empty(16384, dtype=torch.float32) if memory == "pinned" else torch.empty(16384)
    update.copy_(second * 2)
    with area_api.SwapHandle(block_size=4096, queue_depth=2, num_threads=2) as h:
        h.write(first, path).wait()
        h.write(second, path, off2).wait()
        with file_size_limit(target + reference_api.HEADER_SIZE + 3 * 4096):
            exc = _raised(h.write(update, path, target))  # the header fits, the payload is refused half way
        assert_swap_error(exc, reference_api.SwapIOError, path, f"in-place write past the limit ({where})")
        assert exc.errno == errno.EFBIG, exc.errno
        assert h.stats().bounce_in_use == 0
        if where == "append":
            # A full disk must not stay full: the failed append gives back its payload bytes (only the header,
            # marked incomplete, may stay past the old end of the file).
            size = os.path.getsize(path)
            assert size <= target + reference_api.HEADER_SIZE, f"the failed append left the file at {size} bytes"
        exc = _raised(h.read(torch.empty(16384), path, target))
        assert_swap_error(exc, reference_api.IncompleteRecordError, path, "read of the failed record")
        intact = ((first, 0),) if where == "overwrite" else ((first, 0), (second, off2))
        for t, off in intact:
            out = torch.empty_like(t)
            h.read(out, path, off).wait()
            assert_round_trip(out, t, f"untouched record at {off}")
        h.write(update, path, target).wait()  # a later complete write makes the record good again
        out = torch.empty(16384)
        h.read(out, path, target).wait()
        assert_round_trip(out, update, "record rewritten after the failure")


def test_out_of_space(area_api, reference_api):
    if not os.path.exists("/dev/full"):
        pytest.skip("/dev/full (a device that answers every write with ENOSPC) is not available")
    with area_api.SwapHandle() as h:
        exc = _raised(h.write(torch.ones(5000), "/dev/full"))
        assert_swap_error(exc, reference_api.SwapNoSpaceError, "/dev/full", "write to a full device")
        assert exc.errno == errno.ENOSPC
        assert h.stats().bounce_in_use == 0


def test_handle_wait_raises_the_first_failure_once(area_api, reference_api, tmp_path):
    good = str(tmp_path / "good.bin")
    missing = [str(tmp_path / f"m{k}.bin") for k in range(3)]
    with area_api.SwapHandle() as h:
        h.write(torch.ones(10), good)
        reqs = [h.read(torch.empty(10), p) for p in missing]
        with pytest.raises(reference_api.SwapFileNotFoundError) as info:
            h.wait()
        assert info.value.request is reqs[0], "handle.wait() must raise the earliest submitted failure"
        assert [e.request for e in info.value.other_failures] == reqs[1:]
        h.wait()  # already reported: nothing more to raise
        for r in reqs:  # each request keeps its own error
            assert isinstance(_raised(r), reference_api.SwapFileNotFoundError)
        # A failure already seen through request.wait() is not raised again by handle.wait().
        late = h.read(torch.empty(10), missing[0])
        assert _raised(late) is not None
        h.wait()
        stats = h.stats()
        assert (stats.requests, stats.failed_requests) == (5, 4), stats


def test_bad_pinning_variable_met_by_the_bounce_pool(area_api, tmp_path, monkeypatch):
    """The bounce pool is pinned lazily, at the first bounced request, reading the pinning variables then: a bad
    value is that request's error, raised by wait() as the ConfigurationError naming the variable."""
    path = str(tmp_path / "x.bin")
    monkeypatch.setenv(PIN_REGISTER_DEVICE_ENV, "maybe")
    with area_api.SwapHandle(block_size=4096) as h:
        exc = _raised(h.write(torch.ones(3000), path))
        assert isinstance(exc, ConfigurationError) and PIN_REGISTER_DEVICE_ENV in str(exc), repr(exc)
        assert "allowed values" in str(exc)
        assert not os.path.exists(path) and os.listdir(tmp_path) == []
        monkeypatch.delenv(PIN_REGISTER_DEVICE_ENV)
        h.write(torch.ones(3000), path).wait()
        out = torch.empty(3000)
        h.read(out, path).wait()
        assert_round_trip(out, torch.ones(3000), "after the variable was fixed")


def test_errors_are_hostoffload_errors(area_api):
    for name in io_errors.__all__:
        assert issubclass(getattr(area_api, name), HostOffloadError), name
    assert issubclass(area_api.SwapIOError, OSError)
    assert issubclass(area_api.SwapFileNotFoundError, FileNotFoundError)
