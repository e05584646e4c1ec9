"""A pytest plugin of the GPU check (``-p gpu_check_results``): one JSON line per finished test, appended to
``$MINIKV_TEST_RESULTS`` the moment the test finishes, so that a run killed by its time limit still says
which tests passed and which failed. Under pytest-xdist the reports reach the controller process, which
writes every line (workers write none: ``workerinput`` marks them)."""

from __future__ import annotations

import json
import os
import time


def pytest_runtest_logreport(report) -> None:
    path = os.environ.get("MINIKV_TEST_RESULTS")
    if not path or (report.when != "call" and not (report.failed or report.skipped)):
        return  # one line per test: its call, or the setup/teardown that failed or skipped it
    line = {"nodeid": report.nodeid, "outcome": report.outcome if report.when == "call" or report.skipped else "error",
            "when": report.when, "seconds": round(float(report.duration), 3), "time": time.time()}
    if report.failed:
        line["message"] = str(getattr(report, "longreprtext", ""))[-1500:]
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")
        f.flush()


def pytest_configure(config) -> None:
    if hasattr(config, "workerinput"):  # an xdist worker: the controller writes
        os.environ.pop("MINIKV_TEST_RESULTS", None)
