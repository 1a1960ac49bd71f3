"""The IDs the router makes for requests without ``X-Request-ID`` (``api.proxy.new_request_id``): 32 hex
digits, never repeated within a process, and another random half in every process, a forked one
included; such an ID is the turn's idempotency key when the client sends none, so two processes
sharing the random half could answer one client's turn with another's."""

from __future__ import annotations

import os
import re

from api import proxy
from api.guard import _REQUEST_ID_RE


def test_made_ids_are_32_hex_digits_follow_the_header_rule_and_never_repeat() -> None:
    ids = [proxy.request_id({}) for _ in range(10_000)] + [proxy.request_id({"x-request-id": ""})]
    assert len(set(ids)) == len(ids)
    assert all(re.fullmatch(r"[0-9a-f]{32}", i) and _REQUEST_ID_RE.fullmatch(i) for i in ids)
    assert len({i[:16] for i in ids}) == 1  # one random half per process, then a counter
    assert proxy.request_id({"x-request-id": "client-1"}) == "client-1"


def test_a_forked_process_draws_its_own_random_half() -> None:
    parent = proxy.new_request_id()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report one ID and leave at once
        try:
            os.write(w, proxy.new_request_id().encode())
        finally:
            os._exit(0)
    os.close(w)
    child = os.read(r, 64).decode()
    os.close(r)
    os.waitpid(pid, 0)
    assert re.fullmatch(r"[0-9a-f]{32}", child)
    assert child[:16] != parent[:16]
