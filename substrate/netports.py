"""Free loopback ports that the kernel will not hand to someone else before we bind them.

The usual trick (bind port 0, read the port, close, pass the number on) picks from the kernel's
*ephemeral* range (``/proc/sys/net/ipv4/ip_local_port_range``, 32768-60999 on Linux). Between the close
and the real bind, that same port can be given to any outgoing connection or any other ``bind(0)``, such
as a worker starting in the meantime: CI saw ``[Errno 98] address already in use`` from exactly this.
Ports below the ephemeral range are only ever taken by an explicit bind, so picking there (at random,
never the same one twice in a process) leaves only a collision with another explicit picker.
"""

from __future__ import annotations

import errno
import os
import random
import re
import socket
import threading
from pathlib import Path

_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 10000  # below this live well-known services (Redis 6379, moto 5000, dev servers 8000-9000)
_handed_out: set[int] = set()
_lock = threading.Lock()
_rng = random.Random()
# a forked process (the zygote's workers) draws its own picks, not its siblings' same ones
os.register_at_fork(after_in_child=_rng.seed)


def ephemeral_range() -> tuple[int, int]:
    """``(low, high)`` of the kernel's ephemeral port range, inclusive; ``(32768, 60999)`` if unreadable."""
    try:
        lo, hi = (int(x) for x in _RANGE_FILE.read_text().split()[:2])
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1", *, high: int | None = None, attempts: int = 500) -> int:
    """A TCP port on ``host`` that nothing is bound to now, outside the kernel's ephemeral range.

    ``high`` (inclusive) caps the pick further, e.g. ``ephemeral_range()[0] - 10001`` for a Redis
    Cluster node whose bus port is ``port + 10000``. Each port is returned at most once per process.
    When no such port can be found (a machine whose ephemeral range starts low), falls back to the
    kernel's pick (``bind(0)``), which is racy in the way this module's docstring says.

    Raises ``OSError`` only if ``host`` cannot be bound at all.
    """
    lo_eph, hi_eph = ephemeral_range()
    spans = [(_LOWEST, lo_eph - 1), (hi_eph + 1, 65535)]
    if high is not None:
        spans = [(lo, min(hi, high)) for lo, hi in spans]
    spans = [(lo, hi) for lo, hi in spans if hi - lo >= 100]
    with _lock:
        for _ in range(attempts if spans else 0):
            lo, hi = _rng.choice(spans)
            port = _rng.randint(lo, hi)
            if port not in _handed_out and _bindable(host, port):
                _handed_out.add(port)
                return port
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def free_span(n: int, host: str = "127.0.0.1", *, high: int = 60000, attempts: int = 500) -> tuple[int, int]:
    """``(lo, hi)``: ``n`` consecutive ports (``hi = lo + n - 1``), below the kernel's ephemeral range and
    at most ``high``, none of them bound now nor handed out before by this process: a
    ``SUBSTRATE_WORKER__PORT_RANGE`` for a test, whose workers (and :func:`free_port_in`) pick in it
    themselves, so the span is not marked handed out. An explicit picker can still take one of them
    later, as for :func:`free_port`; checking the whole span (not only its first port) leaves out what
    is taken now.
    Raises ``ValueError`` for ``n < 1`` and ``OSError`` (``EADDRINUSE``) when no such span is found."""
    if n < 1:
        raise ValueError(f"a span has at least one port; got {n}")
    top = min(high, ephemeral_range()[0] - 1) - n + 1
    with _lock:
        for _ in range(attempts if top >= _LOWEST else 0):
            lo = _rng.randint(_LOWEST, top)
            span = range(lo, lo + n)
            if not _handed_out.intersection(span) and all(_bindable(host, p) for p in span):
                return lo, lo + n - 1
    raise OSError(errno.EADDRINUSE, f"no {n} consecutive free ports in {_LOWEST}-{min(high, 65535)} on {host}")


#: ``LO-HI``: decimal port numbers, no sign or space
_RANGE_TEXT = re.compile(r"(\d{1,5})-(\d{1,5})")


def parse_port_range(text: str) -> tuple[int, int]:
    """``"LO-HI"`` (inclusive, ``1 <= LO <= HI <= 65535``, e.g. ``"29610-29699"``) -> ``(LO, HI)``.
    Raises ``ValueError`` saying the form for anything else."""
    m = _RANGE_TEXT.fullmatch(text.strip())
    lo, hi = (int(m.group(1)), int(m.group(2))) if m else (0, 0)
    if not m or not 1 <= lo <= hi <= 65535:
        raise ValueError(f"a port range is LO-HI with 1 <= LO <= HI <= 65535, e.g. 29610-29699; got {text!r}")
    return lo, hi


def ports_in_random_order(lo: int, hi: int) -> list[int]:
    """The ports ``lo..hi`` (inclusive) from a random one on, wrapping round: processes starting at once
    in one range (a pool's workers) then rarely try the same port first."""
    start = _rng.randint(lo, hi)
    return [*range(start, hi + 1), *range(lo, start)]


def free_port_in(lo: int, hi: int, host: str = "127.0.0.1") -> int:
    """A TCP port in ``lo..hi`` that nothing is bound to now and this process has not handed out before
    (for a server another process starts on it: the embedded Redis). A process that binds it itself
    should bind in the range directly instead (``workers.server.listen_socket``): nothing can take the
    port between the pick and the bind then. Raises ``OSError`` (``EADDRINUSE``) when every port of
    the range is bound or handed out."""
    with _lock:
        for port in ports_in_random_order(lo, hi):
            if port not in _handed_out and _bindable(host, port):
                _handed_out.add(port)
                return port
    raise OSError(errno.EADDRINUSE, f"no free port in {lo}-{hi} on {host}")
