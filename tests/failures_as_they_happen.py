"""A pytest plugin for runs that may be cut short (the device tool's lease): each failure's
traceback is appended to $FAILURE_LOG as soon as the test ends, not in pytest's final summary."""

import os


def pytest_runtest_logreport(report):
    # (with xdist, the controller writes: its workers would write each failure a second time)
    if report.failed and os.environ.get("FAILURE_LOG") and not os.environ.get("PYTEST_XDIST_WORKER"):
        with open(os.environ["FAILURE_LOG"], "a") as log:
            log.write(f"===== {report.nodeid} ({report.when}, {report.duration:.1f} s)\n{report.longreprtext}\n\n")
