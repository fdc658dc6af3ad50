"""The suite's skip policy, a pytest plugin (``tests/conftest.py`` imports its hooks).

With ``CI`` set to ``true``/``1`` (``.ci/run`` sets it) or ``KVCOMM_NO_SKIPS=1``, every skip is
reported as a failure that names the skip's reason: a test skipped at collection (a
module-level ``importorskip``), in a fixture's setup (``importorskip`` inside a fixture) or in
its body (``pytest.skip``), and an ``xfail`` that failed. A broken install then fails CI
instead of passing with "N skipped". Without the flags, skips stay skips (a developer's
machine may lack vLLM). Deselection (``-m "not slow"``) is not a skip and is untouched.
"""

from __future__ import annotations

import os

import pytest

NO_SKIPS_ENV = "KVCOMM_NO_SKIPS"


def skips_are_failures() -> bool:
    """True when ``CI`` is ``true`` or ``1`` (any case), or ``KVCOMM_NO_SKIPS`` is ``1``."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1") or os.environ.get(NO_SKIPS_ENV, "").strip() == "1"


def _reason(report) -> str:
    if getattr(report, "wasxfail", None) is not None:
        return f"expected to fail (xfail: {report.wasxfail or 'no reason given'})"
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # (path, line, "Skipped: reason")
        return f"{longrepr[2]} (at {longrepr[0]}:{longrepr[1]})"
    return str(longrepr)


def _as_failure(report, what: str) -> None:
    reason = _reason(report)
    if hasattr(report, "wasxfail"):
        del report.wasxfail
    report.outcome = "failed"
    report.longrepr = (
        f"{what} was skipped, and skips are failures here (CI=true or {NO_SKIPS_ENV}=1): {reason}. "
        "Install what the test needs (`make test` sets up everything) or remove the cause of the skip."
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and skips_are_failures():
        _as_failure(report, item.nodeid)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and skips_are_failures():
        _as_failure(report, collector.nodeid)
