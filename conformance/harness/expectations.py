"""Expected-failure and skip files: how a vendor's CI runs the suite green while its port has known gaps.

``--conformance-xfails FILE`` and ``--conformance-skips FILE`` each name a text file with one test id, or the
beginning of one, per line; ``#`` starts a comment, blank lines are ignored. A test the xfails file lists is run
and expected to fail (counted ``xfailed``); one the skips file lists is not run (counted ``skipped_by_file``, apart
from the suite's own skips). A test both files list is skipped: not running it is the stronger statement.

Ids are written as the report prints them: ``conformance/suite/<module>.py::<test>[<parameters>]``, the path from
the folder holding the ``conformance`` package, so one file works wherever the suite is installed and whatever
directory pytest runs in (pytest's own node id, which depends on both, is accepted too). An entry matches a test
whose id equals it or begins with it where a part of the id ends: after the entry comes ``::``, ``[``, ``/``, a
``-`` between parameters or ``]``, or the entry itself ends with one of them. So ``conformance/suite/test_io_errors.py``
lists a module, ``...::test_x`` a test with all its parameters, ``...::test_x[kernel=k`` those of one kernel; an
entry never matches a test whose name merely begins the same way (``test_x`` does not list ``test_x_other``).

Strict by default: a listed test that passes (XPASS) fails the run, so a fixed gap cannot stay hidden behind its
entry; ``--conformance-xfails-nonstrict`` reports it without failing (for a file shared by several versions).

An entry that matches no collected test is a warning (in the terminal and at the top of the report), not an error:
a vendor's run selects a part of the suite (``-k``, one implementation, one accelerator) with a file written for all
of it, so an unmatched entry is normal there; and a stale entry cannot hide anything, since the test it meant to
cover, renamed, runs and is judged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest

from reference.contract.errors import ConfigurationError

#: Where the package lives: ids are written relative to its parent folder.
_PACKAGE_PARENT = Path(__file__).resolve().parents[2]
#: How the reasons of the marks added here begin (the report tells a listed skip from the suite's own by it).
XFAIL_PREFIX = "listed in the xfails file"
SKIP_PREFIX = "listed in the skips file"
_BOUNDARY = ":[/-]"


@dataclass(frozen=True)
class Entry:
    text: str
    line: int


@dataclass
class ExpectationFile:
    """One xfails or skips file: its entries, and which of them matched a collected test."""

    option: str
    path: Path
    entries: list[Entry]
    matched: set[Entry] = field(default_factory=set)

    @classmethod
    def load(cls, option: str, path: str) -> ExpectationFile:
        """Read ``path``; ConfigurationError naming the option when it cannot be read or an entry is malformed."""
        try:
            text = Path(path).read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigurationError(f"{option}={path!r} cannot be read: {getattr(exc, 'strerror', None) or exc}") \
                from None
        entries = []
        for number, raw in enumerate(text.splitlines(), start=1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            if any(ch.isspace() for ch in line):
                raise ConfigurationError(f"{option}={path!r} line {number}: {line!r} is not one test id (ids "
                                         "have no spaces; one id or id prefix per line, '#' starts a comment)")
            entries.append(Entry(line, number))
        return cls(option, Path(path), entries)

    def match(self, ids: tuple[str, ...]) -> Entry | None:
        """The first entry that lists a test known by any of ``ids`` (recorded as matched), or None."""
        for entry in self.entries:
            if any(_matches(entry.text, one) for one in ids):
                self.matched.add(entry)
                return entry
        return None

    def unmatched(self) -> list[str]:
        return [f"{self.path}:{e.line}: {e.text}" for e in self.entries if e not in self.matched]

    def summary(self) -> dict[str, object]:
        return {"file": str(self.path), "entries": len(self.entries), "matched_entries": len(self.matched),
                "unmatched": self.unmatched()}


def _matches(entry: str, test_id: str) -> bool:
    if test_id == entry:
        return True
    if not test_id.startswith(entry):
        return False
    return entry[-1] in _BOUNDARY or entry.endswith("]") or test_id[len(entry)] in _BOUNDARY + "]"


def expectation_id(item: pytest.Item) -> str:
    """The id an expectation file uses for ``item``: its file from the folder holding the package, then pytest's
    ``::`` parts (the same wherever the suite is installed and wherever pytest runs)."""
    path = Path(str(item.path)).resolve()
    try:
        rel = path.relative_to(_PACKAGE_PARENT).as_posix()
    except ValueError:
        return item.nodeid
    rest = item.nodeid.split("::", 1)
    return f"{rel}::{rest[1]}" if len(rest) == 2 else rel


class Expectations:
    """The run's xfails and skips files, applied to the collected tests as pytest marks."""

    def __init__(self, xfails: ExpectationFile | None, skips: ExpectationFile | None, strict: bool) -> None:
        self.xfails, self.skips, self.strict = xfails, skips, strict

    @classmethod
    def from_options(cls, config: pytest.Config) -> Expectations:
        xfails = config.getoption("conformance_xfails", default=None)
        skips = config.getoption("conformance_skips", default=None)
        nonstrict = bool(config.getoption("conformance_xfails_nonstrict", default=False))
        if nonstrict and not xfails:
            raise ConfigurationError("--conformance-xfails-nonstrict needs --conformance-xfails FILE")
        return cls(ExpectationFile.load("--conformance-xfails", xfails) if xfails else None,
                   ExpectationFile.load("--conformance-skips", skips) if skips else None, not nonstrict)

    def apply(self, items: list[pytest.Item]) -> None:
        if self.xfails is None and self.skips is None:
            return
        for item in items:
            ids = (expectation_id(item), item.nodeid)
            if self.skips is not None and (entry := self.skips.match(ids)) is not None:
                item.add_marker(pytest.mark.skip(reason=f"{SKIP_PREFIX} {self.skips.path}:{entry.line}"),
                                append=False)
                continue
            if self.xfails is not None and (entry := self.xfails.match(ids)) is not None:
                item.add_marker(pytest.mark.xfail(reason=f"{XFAIL_PREFIX} {self.xfails.path}:{entry.line}",
                                                  strict=self.strict))

    def summary(self) -> dict[str, object]:
        """What the report's header shows: each file, how many entries matched, the unmatched ones."""
        out: dict[str, object] = {"strict": self.strict}
        for name, file in (("xfails", self.xfails), ("skips", self.skips)):
            if file is not None:
                out[name] = file.summary()
        return out

    def warnings(self) -> list[str]:
        return [f"{line} matches no collected test" for f in (self.xfails, self.skips) if f is not None
                for line in f.unmatched()]
