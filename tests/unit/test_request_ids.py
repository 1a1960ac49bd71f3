"""The IDs the router makes for requests without ``X-Request-ID`` (``api.proxy.new_request_id``): 32 hex
digits of the OS's random source, never predictable from earlier ones, and never shared with a forked
process. Such an ID is the turn's idempotency key when the client sends none: a predictable one let a
caller plant an answer under the next ID (a fresh-user run, against a counter), and a forked process
sharing the parent's random block would make the same IDs."""

from __future__ import annotations

import os
import re

from api import guard, proxy
from api.guard import _REQUEST_ID_RE


def test_made_ids_are_32_hex_digits_follow_the_header_rule_and_share_no_part() -> None:
    n = 3 * guard._RequestIds.BLOCK_BYTES // 16  # across several random blocks
    ids = [proxy.request_id({}) for _ in range(n)] + [proxy.request_id({"x-request-id": ""})]
    assert all(re.fullmatch(r"[0-9a-f]{32}", i) and _REQUEST_ID_RE.fullmatch(i) for i in ids)
    # nothing carries over from one ID to the next: no shared prefix, no counter in the low half
    assert len({i[:16] for i in ids}) == len(ids) and len({i[16:] for i in ids}) == len(ids)
    lows = [int(i[16:], 16) for i in ids]
    assert sum(b - a == 1 for a, b in zip(lows, lows[1:])) == 0
    assert proxy.request_id({"x-request-id": "client-1"}) == "client-1"


def test_a_forked_process_makes_other_ids_than_its_parent() -> None:
    proxy.new_request_id()  # the parent holds a random block with IDs left in it
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report its next ID and leave at once
        try:
            os.write(w, proxy.new_request_id().encode())
        finally:
            os._exit(0)
    os.close(w)
    child = os.read(r, 64).decode()
    os.close(r)
    os.waitpid(pid, 0)
    parent = proxy.new_request_id()  # the parent's next: what the child would have made from the same block
    assert re.fullmatch(r"[0-9a-f]{32}", child) and child != parent
