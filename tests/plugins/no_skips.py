"""pytest plugin: a run that skipped anything fails.

Loaded by scripts/test.sh (`-p no_skips`, with tests/plugins on PYTHONPATH), so the
README's test command and CI fail when a test was skipped, xfailed or xpassed, or a
module was skipped at collection: every test here is meant to run on a CPU-only machine,
and a skip would hide a missing dependency or an untested path behind a green run. Plain
`pytest` runs (without `-p no_skips`) are unaffected.
"""

from __future__ import annotations

import pytest

_not_run: list[str] = []


def _why(report: pytest.CollectReport | pytest.TestReport) -> str:
    if hasattr(report, "wasxfail"):
        return "xpassed" if report.passed else "xfailed"
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return str(reason)  # "Skipped: <why>"


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # Setup (a skip marker) or call (pytest.skip(), xfail, xpass); teardown never skips.
    not_run = report.skipped or (report.passed and hasattr(report, "wasxfail"))
    if not_run and report.when != "teardown":
        _not_run.append(f"{report.nodeid} ({_why(report)})")


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.skipped:
        _not_run.append(f"{report.nodeid} ({_why(report)})")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _not_run and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _not_run:
        terminalreporter.section("no_skips: every test must run", sep="=", red=True, bold=True)
        for line in _not_run:
            terminalreporter.line(line)
