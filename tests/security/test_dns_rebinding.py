"""DNS rebinding against an open-mode API (fresh-user run): a page whose name was rebound to 127.0.0.1 is
same-origin with the API in the browser's eyes, so the Origin / Fetch Metadata check let it create a shell
session and run ``id`` in it, and read every session. Its requests still name its own host in ``Host``."""

from __future__ import annotations

import pytest

from api.guard import rebinding

LOCAL = ("127.0.0.1", 8080)


@pytest.mark.parametrize("host", [b"localhost:8080", b"LOCALHOST", b"127.0.0.1:8080", b"127.1.2.3", b"[::1]:8080",
                                  b"[::1]", b"::1", b"Trusted.Example:8080"])
def test_loopback_names_and_allowed_hosts_pass(host: bytes) -> None:
    assert rebinding({b"host": host}, LOCAL, frozenset({"trusted.example"})) is None


@pytest.mark.parametrize("host", [b"attacker.example:8080", b"attacker.example", b"192.168.1.5:8080",
                                  b"localhost.attacker.example", b"127.0.0.1.nip.io:8080", b"[2001:db8::1]:8080"])
def test_other_names_are_refused_on_a_loopback_address(host: bytes) -> None:
    assert rebinding({b"host": host}, LOCAL, frozenset()) == host.decode().lower()


def test_only_requests_that_came_in_on_loopback_are_checked() -> None:
    # a server on 0.0.0.0 reached over the network answers to whatever name leads there (and is exposed
    # to that network anyway); no Host header (HTTP/1.0) is not a browser
    assert rebinding({b"host": b"my-box.lan:8080"}, ("10.0.0.5", 8080), frozenset()) is None
    assert rebinding({}, LOCAL, frozenset()) is None
    assert rebinding({b"host": b"attacker.example"}, ("::1", 8080), frozenset()) == "attacker.example"


def test_a_rebound_page_can_neither_create_run_nor_read(runtime_factory) -> None:
    rt = runtime_factory(replicas=1, slots=2)  # open mode: no credentials
    c = rt.client
    mine = c.create_session("counter")["id"]
    page = {"Host": f"attacker.example:{rt.port}", "Origin": f"http://attacker.example:{rt.port}",
            "Sec-Fetch-Site": "same-origin"}
    r = c.http.post("/v1/sessions", json={"actorTemplate": "shell"}, headers=page)
    assert r.status_code == 403 and r.json()["code"] == "host_not_allowed", r.text
    assert "attacker.example" in r.json()["message"]
    assert "reaches the server on a loopback address" in r.json()["message"]  # true of a 0.0.0.0 listener too
    r = c.http.post(f"/v1/sessions/{mine}/invoke", json={"input": "increment"}, headers=page)
    assert r.status_code == 403 and r.json()["code"] == "host_not_allowed"
    assert c.http.get("/v1/sessions", headers={"Host": "attacker.example"}).status_code == 403
    assert [s["id"] for s in c.list_sessions()["items"]] == [mine], "nothing was created"
    assert c.invoke(mine, "get") == {"count": 0}, "no turn ran"
    # the names the server has: loopback literals and localhost
    for host in (f"localhost:{rt.port}", f"127.0.0.1:{rt.port}"):
        assert c.http.get(f"/v1/sessions/{mine}", headers={"Host": host}).status_code == 200


def test_allowed_hosts_add_names(runtime_factory) -> None:
    rt = runtime_factory(replicas=1, slots=2, env={"SUBSTRATE_API__ALLOWED_HOSTS": '["dev.internal"]'})
    assert rt.client.http.get("/v1/sessions", headers={"Host": "dev.internal:1"}).status_code == 200
    assert rt.client.http.get("/v1/sessions", headers={"Host": "other.internal"}).status_code == 403


def test_with_credentials_the_host_is_not_checked(runtime_factory) -> None:
    rt = runtime_factory(replicas=1, slots=2, env={"SUBSTRATE_API__AUTH_TOKEN": "t0ken-for-tests-0123456789"})
    r = rt.client.http.get("/v1/sessions", headers={"Host": "router.example", "Authorization": "Bearer t0ken-for-tests-0123456789"})
    assert r.status_code == 200, r.text
