"""``wrk`` as a load generator: its Lua request script, one bounded run, and its report read back.

``wrk`` (Debian package ``wrk``, https://github.com/wg/wrk) is a C HTTP/1.1 client with keep-alive
connections on one event loop. Its cost per request is a few microseconds of CPU, against roughly a
hundred for a Python client, so on a machine whose cores the load generator shares with the system under
test (2 cores here), it leaves more of them to that system: the only way such a machine comes near
saturating one router process (``loadtest.bench``, ``loadtest.router_ab``). Traffic goes where the URL
says; callers pass loopback URLs only, and every run is bounded by its duration.
"""

from __future__ import annotations

import asyncio
import json
import re
import resource
import shutil
from dataclasses import dataclass
from pathlib import Path

#: what to install when ``wrk`` is missing (said in every refusal and every fallback note)
INSTALL_HINT = "apt-get install wrk (Debian) or your system's package"


def available() -> bool:
    """Whether ``wrk`` is on ``PATH``."""
    return shutil.which("wrk") is not None


def write_script(path: Path, body: str, headers: dict[str, str] | None = None) -> Path:
    """Write a wrk Lua script to ``path`` that sends every request as ``POST`` with ``body`` (a string,
    sent as is) and ``Content-Type: application/json`` plus ``headers``. Values are written as JSON
    strings, which Lua reads as the same string for the printable ASCII that HTTP headers and these
    bodies use. Returns ``path``. Raises ``ValueError`` for a header name or value with a control
    character (it would split the request)."""
    all_headers = {"Content-Type": "application/json", **(headers or {})}
    lines = ['wrk.method = "POST"', f"wrk.body = {json.dumps(body)}"]
    for name, value in all_headers.items():
        if any(ord(c) < 32 or ord(c) == 127 for c in name + value):
            raise ValueError(f"header {name!r}: control characters cannot be sent")
        lines.append(f"wrk.headers[{json.dumps(name)}] = {json.dumps(value)}")
    path.write_text("\n".join(lines) + "\n")
    return path


def parse_report(out: str) -> tuple[int, float]:
    """(requests answered, seconds taken) from ``wrk``'s report ``out``. Raises ``RuntimeError`` if any
    answer was not 2xx or a socket failed (``Non-2xx``, ``Socket errors``), or the count is missing:
    a server answering errors fast would look fast."""
    if "Non-2xx" in out or "Socket errors" in out:
        raise RuntimeError(f"wrk saw errors:\n{out}")
    m = re.search(r"(\d+) requests in ([\d.]+)(ms|s|m)\b", out)
    if m is None:
        raise RuntimeError(f"wrk printed no request count:\n{out}")
    return int(m.group(1)), float(m.group(2)) * {"ms": 0.001, "s": 1.0, "m": 60.0}[m.group(3)]


@dataclass(frozen=True)
class Run:
    """One wrk run: ``requests`` answered (all 2xx) in ``seconds``, and ``cpu_s``, the CPU seconds (user +
    system) the wrk process itself used."""

    requests: int
    seconds: float
    cpu_s: float

    @property
    def per_s(self) -> float:
        """Requests answered per second of the run."""
        return self.requests / self.seconds


async def run(url: str, script: Path, *, connections: int, seconds: int) -> Run:
    """Load ``url`` with one wrk thread over ``connections`` keep-alive connections for ``seconds``
    (whole seconds, 1-60) with the requests of ``script`` (:func:`write_script`). Its CPU is read from
    ``RUSAGE_CHILDREN`` around the run, so no other child of this process may end meanwhile (the
    benchmarks run one wrk at a time per process, or read only the count). Raises ``RuntimeError``
    (:func:`parse_report`) if any answer failed, ``ValueError`` for arguments out of range and
    ``FileNotFoundError`` if wrk is not installed."""
    if not 1 <= seconds <= 60 or connections < 1:
        raise ValueError("wrk: seconds must be 1-60 and connections >= 1")
    if not available():
        raise FileNotFoundError(f"wrk is not installed: {INSTALL_HINT}")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = await asyncio.create_subprocess_exec(
        "wrk", "-t1", f"-c{connections}", f"-d{seconds}s", "--timeout", "10s", "-s", str(script), url,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out = (await proc.communicate())[0].decode(errors="replace")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    n, s = parse_report(out)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return Run(requests=n, seconds=s, cpu_s=cpu)
