"""The order test files are handed to pytest-xdist workers: the slowest first.

``make test`` runs the suite on several workers with ``--dist loadfile --no-loadscope-reorder``: each file
goes whole to one worker (files share module-scoped runtimes, and a file's tests never run at the same
time as each other), in the order the workers collected them. Collected in name order, a 100 s file that
came last (``tests/unit/...`` is last, but ``tests/k8s/test_controller_ha.py`` is in the middle) ran alone
at the end while the other workers idled. In a worker, this sorts whole files by how long each took the
last time (within a file the order stays as written): the seconds of the last run on this machine
(pytest's cache, ``substrate/file-durations``), else ``tests/file_durations.json`` (a serial run's,
committed so a fresh checkout has them), else ``_UNKNOWN_S``. A serial run (no ``-n``) keeps name order.

The durations are written after every run that is not an xdist worker (a serial run or the xdist
controller), for the files that ran. Refresh the committed file after large changes to the suite with
``make test PYTEST_ARGS="--file-durations-out tests/file_durations.json"``.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import pytest

COMMITTED = Path(__file__).with_name("file_durations.json")
CACHE_KEY = "substrate/file-durations"
#: a file no record knows yet (a new one): ahead of the many quick unit files, behind the slow end-to-end ones
_UNKNOWN_S = 5.0

_took: Counter[str] = Counter()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--file-durations-out", default=None, metavar="PATH",
                     help="also write the per-file seconds of this run to PATH (JSON), e.g. tests/file_durations.json")


def _file(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def _known(config: pytest.Config) -> dict[str, float]:
    known: dict[str, float] = {}
    try:
        known.update(json.loads(COMMITTED.read_text()))
    except (OSError, ValueError):
        pass
    cache = getattr(config, "cache", None)
    if cache is not None:
        cached = cache.get(CACHE_KEY, {})
        if isinstance(cached, dict):
            known.update(cached)
    return known


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    known = _known(config)
    # stable: the tests of a file stay together and in their order; every worker sorts the same way
    items.sort(key=lambda item: -float(known.get(_file(item.nodeid), _UNKNOWN_S)))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        _took[_file(report.nodeid)] += report.duration


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER") or not _took or exitstatus == pytest.ExitCode.INTERRUPTED:
        return
    took = {f: round(s, 1) for f, s in sorted(_took.items(), key=lambda kv: -kv[1])}
    cache = getattr(session.config, "cache", None)
    if cache is not None:
        cached = cache.get(CACHE_KEY, {})
        cache.set(CACHE_KEY, {**(cached if isinstance(cached, dict) else {}), **took})
    out = session.config.getoption("--file-durations-out")
    if out:
        Path(out).write_text(json.dumps(took, indent=0) + "\n")
