"""The ``pytest11`` entry point: decides whether a pytest session runs the conformance suite at all.

Installing hostoffload registers this module in *every* pytest session of the environment, including sessions of
projects that have nothing to do with hostoffload. So it does as little as a plugin can: it adds the
``--conformance-*`` options (they must exist before the command line is parsed) and imports nothing heavy. Only a
session that asks for the suite turns into a conformance run, and only then is :mod:`conformance.harness.plugin` (torch,
the accelerators, the hypothesis profiles, the report) registered. A session asks for the suite by

- giving any ``--conformance-*`` option,
- naming the package with ``--pyargs conformance`` (or one of its modules, ``conformance.suite.test_io_errors``), or
- naming a path inside the installed ``conformance`` package, or a directory that contains it (a source checkout
  of hostoffload; not through a hidden directory, ``site-packages`` or a virtual environment, which pytest does not
  collect either).

Everything else (an unrelated project's session) sees pytest's and hypothesis's own defaults.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conformance.harness import profiles

#: The module that does the work once a session asks for the suite.
PLUGIN_MODULE = "conformance.harness.plugin"
PACKAGE = "conformance"
PACKAGE_DIR = Path(__file__).resolve().parent

#: Why this session runs the suite (absent: it does not).
ACTIVATION_KEY = pytest.StashKey[str]()

#: (dest, flag) of every option this plugin adds; any of them given explicitly activates the suite.
OPTIONS: tuple[tuple[str, str], ...] = (
    ("conformance_impl", "--conformance-impl"),
    ("conformance_accelerator", "--conformance-accelerator"),
    ("conformance_list", "--conformance-list"),
    ("conformance_report", "--conformance-report"),
    ("conformance_profile", "--conformance-profile"),
    ("conformance_isolation", "--conformance-isolation"),
    ("conformance_xfails", "--conformance-xfails"),
    ("conformance_skips", "--conformance-skips"),
    ("conformance_xfails_nonstrict", "--conformance-xfails-nonstrict"),
)

#: ``--conformance-isolation`` values (conformance.harness.isolation reads the option; it is declared here with the
#: others because options must exist before the command line is parsed, and conformance.harness.isolation loads only
#: after).
ISOLATION_MODES = ("auto", "all", "off")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("hostoffload-conformance", "hostoffload conformance suite (active only when asked for)")
    group.addoption(
        "--conformance-impl",
        action="append",
        metavar="NAME[,NAME]",
        help="run only these implementations (entry points of hostoffload.implementations); default: all",
    )
    group.addoption(
        "--conformance-accelerator",
        action="append",
        metavar="NAME[,NAME]",
        help="run only on these accelerators (entry points of hostoffload.accelerators); each must be available "
        "here; default: every available one",
    )
    group.addoption(
        "--conformance-list",
        action="store_true",
        help="list discovered implementations (with areas) and accelerators (with capabilities), then exit",
    )
    group.addoption(
        "--conformance-report",
        metavar="DIR",
        help="write DIR/report.json and DIR/report.md: area x implementation x accelerator -> outcome",
    )
    group.addoption(
        "--conformance-profile",
        choices=profiles.PROFILES,
        help=f"hypothesis profile (default: ${profiles.PROFILE_ENV}, else 'ci' when $CI is set, else 'dev')",
    )
    group.addoption(
        "--conformance-isolation",
        choices=ISOLATION_MODES,
        default=None,
        help="run tests of the implementation under test in a child process, so a crash fails one test: auto "
        "(default: tests marked isolated, and every test of an implementation that does not opt out), all, off",
    )
    group.addoption(
        "--conformance-xfails",
        metavar="FILE",
        help="tests expected to fail: one test id or id prefix per line ('#' comments); counted as xfailed, and a "
        "listed test that passes fails the run (strict) unless --conformance-xfails-nonstrict",
    )
    group.addoption(
        "--conformance-skips",
        metavar="FILE",
        help="tests not to run: one test id or id prefix per line ('#' comments); counted apart from other skips",
    )
    group.addoption(
        "--conformance-xfails-nonstrict",
        action="store_true",
        help="a test listed in --conformance-xfails that passes is reported (xpassed) without failing the run",
    )


def _under(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def _reaches_package(folder: Path) -> bool:
    """True if collecting ``folder`` would reach the conformance package (pytest's own recursion rules)."""
    if not _under(PACKAGE_DIR, folder):
        return False
    current = folder
    for part in PACKAGE_DIR.relative_to(folder).parts:
        if part.startswith(".") or part in ("site-packages", "dist-packages") or (current / "pyvenv.cfg").exists():
            return False
        current = current / part
    return True


def _names_suite(arg: str, pyargs: bool, invocation_dir: Path) -> bool:
    target = arg.split("::", 1)[0]
    if pyargs and (target == PACKAGE or target.startswith(PACKAGE + ".")):
        return True
    if not target:
        return False
    path = Path(target)
    path = (path if path.is_absolute() else invocation_dir / path).resolve()
    if not path.exists():
        return False
    return _under(path, PACKAGE_DIR) or (path.is_dir() and _reaches_package(path))


def suite_requested(config: pytest.Config) -> str | None:
    """Why this session runs the conformance suite, or None when it does not."""
    for dest, flag in OPTIONS:
        if config.getoption(dest, default=None):
            return f"{flag} given"
    pyargs = bool(config.getoption("pyargs", default=False))
    invocation_dir = Path(config.invocation_params.dir)
    for arg in config.args:
        if _names_suite(str(arg), pyargs, invocation_dir):
            return f"{arg!r} is the conformance suite"
    return None


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """Register the conformance plugin when, and only when, the session asks for the suite.

    ``tryfirst`` so that the plugin's own ``pytest_configure`` (called at once on registration) runs before
    hypothesis's, which reads the seed the plugin settles.
    """
    reason = suite_requested(config)
    if reason is None:
        return
    config.stash[ACTIVATION_KEY] = reason
    # A bad selection is one line and exit status 4 before the plugin imports torch (a fraction of a second, not
    # three); what only the loaded plugins can tell (an accelerator not available here) the plugin checks next.
    from conformance.harness import option_checks
    from reference.contract.errors import ConfigurationError

    try:
        option_checks.check_options(config)
    except ConfigurationError as exc:
        raise pytest.UsageError(str(exc)) from None
    if not config.pluginmanager.has_plugin(PLUGIN_MODULE):
        config.pluginmanager.import_plugin(PLUGIN_MODULE)


def pytest_cmdline_main(config: pytest.Config) -> int | None:
    if not config.getoption("conformance_list"):
        return None
    config._do_configure()
    try:
        from conformance.harness.plugin import print_discovered

        print_discovered(config)
    finally:
        config._ensure_unconfigure()
    return 0
