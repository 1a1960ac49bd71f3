"""Leaks a fresh-user break-it run found (issue 7, second round), attacked from inside real ``shell`` and
``notebook`` sessions on a real runtime whose log goes to a file (as with ``make dev > dev.log 2>&1``):

* the agent host's fd 2 was the runtime's own stderr: an agent read the whole log through
  ``/proc/2/fd/2`` and wrote raw (forged) lines into it;
* kernel keyrings are per uid and a slot's uid is fixed: a key stored by one session was read by the
  next session in that slot; ``unshare -Ur`` worked (no seccomp filter at all);
* kept answers (idempotency) had no byte bound in the worker's memory.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator

import pytest

from substrate.client import ApiError
from tests.conftest import RuntimeProc

#: small answer bounds so the tests move little data (see README "Limits of a turn's answer")
MAX_ANSWER = 1_000_000
KEEP_BYTES = 300_000


@pytest.fixture(scope="module")
def rt(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[RuntimeProc]:
    # one worker with two slots: a session created after another's DELETE lands in a slot (a uid) used before
    r = RuntimeProc(tmp_path_factory.mktemp("leak"), redis_url, replicas=1, slots=2,
                    env={"SUBSTRATE_LOG_LEVEL": "INFO", "SUBSTRATE_WORKER__MAX_ANSWER_BYTES": str(MAX_ANSWER),
                         "SUBSTRATE_WORKER__ANSWER_KEEP_BYTES": str(KEEP_BYTES)})
    yield r
    r.stop()


def log_bytes(rt: RuntimeProc) -> bytes:
    rt.log.flush()
    return open(rt.log.name, "rb").read()  # noqa: SIM115


# ------------------------------------------------------------------------------------ H1: the log
SCAN_FDS = """
import os
found, targets = [], []
for pid in [p for p in os.listdir('/proc') if p.isdigit()]:
    try:
        fds = os.listdir(f'/proc/{pid}/fd')
    except OSError:
        continue
    for fd in fds:
        p = f'/proc/{pid}/fd/{fd}'
        try:
            targets.append(os.readlink(p))
            f = os.open(p, os.O_RDONLY | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            data = os.read(f, 1 << 24)
        except OSError:
            data = b''
        finally:
            os.close(f)
        if MARK.encode() in data:
            found.append(p)
(found, targets)
"""


def test_agent_cannot_read_the_runtime_log_through_its_descriptors(rt):
    mark = f"AUDIT-{uuid.uuid4().hex}"
    rt.log.write(f'{{"event": "audit", "tenant": "other", "secret": "{mark}"}}\n'.encode())
    rt.log.flush()
    nb = rt.client.create_session("notebook")["id"]
    sh = rt.client.create_session("shell")["id"]
    try:
        # the marker is built inside the cell, so the cell's own text holds no copy of it
        cell = rt.client.invoke(nb, f"MARK = {mark[:10]!r} + {mark[10:]!r}\n" + SCAN_FDS)
        found, targets = eval(cell["repr"])  # noqa: S307 - a repr of two lists of str, made by our test
        assert found == [], f"the runtime's log is readable from the sandbox via {found}"
        assert rt.log.name not in targets, targets
        assert not any(t.startswith("/") and not t.startswith(("/workspace", "/slot", "/tmp", "/dev/null", "/proc"))
                       for t in targets), f"a host file of the worker's leaked into the sandbox: {targets}"
        out = rt.client.invoke(sh, "ls -l /proc/[0-9]*/fd/ 2>/dev/null; wc -c < /proc/2/fd/2 & sleep 0.2; kill %1 2>/dev/null; true")
        assert rt.log.name not in out["stdout"] + out["stderr"]
    finally:
        rt.client.delete_session(nb)
        rt.client.delete_session(sh)


def test_the_sandbox_init_command_line_names_no_host_path_of_the_worker(rt):
    """A fresh-user run: the sandbox's PID 1 is a fork of bwrap, and its /proc/1/cmdline (readable by
    the agent) held every bwrap option: the slot's folder on the host, /etc files, the venv's binds.
    Those options go through ``bwrap --args FD`` now."""
    sh = rt.client.create_session("shell")["id"]
    try:
        out = rt.client.invoke(sh, "tr '\\0' ' ' < /proc/1/cmdline")
        line = out["stdout"]
        bwrap_part = line.split(" -- ", 1)[0].split()
        assert bwrap_part[0].endswith("bwrap") and bwrap_part[1] == "--args", line
        assert [w for w in bwrap_part[1:] if w.startswith("--")] in (["--args"], ["--args", "--seccomp"]), line
        root = str(rt.var)
        assert root not in line and "--bind" not in line and "/slot" not in line, line
        assert rt.client.invoke(sh, "pwd")["stdout"].strip() == "/workspace", "the options still took effect"
    finally:
        rt.client.delete_session(sh)


def test_agent_stderr_is_logged_as_escaped_data_never_as_raw_lines(rt):
    m = uuid.uuid4().hex
    forged = f'{{"level": "critical", "logger": "substrate.audit", "event": "FORGED-{m}"}}'
    nb = rt.client.create_session("notebook")["id"]
    try:
        cell = (f"import os, sys\nos.write(2, b'\\n' + {forged.encode()!r} + b'\\n\\x1b[2J\\x1b]0;pwn\\x07after-{m}\\n')\n"
                f"os.write(2, b'x' * 100000 + b'\\nlast-{m}\\n')\n1")
        assert rt.client.invoke(nb, cell)["repr"] == "1"
        rt.wait_for(lambda: f"last-{m}".encode() in log_bytes(rt), timeout_s=10, what="agent stderr logged")
        data = log_bytes(rt)
        lines = data.splitlines()
        assert forged.encode() not in lines, "a raw agent line became a log line"
        assert b"\x1b" not in data and b"\x07" not in data, "terminal escapes reached the log"
        recs = [json.loads(x) for x in lines if x.startswith(b"{") and f"-{m}".encode() in x]
        agent = [r for r in recs if r.get("logger") == "substrate.agent"]
        assert any(f"FORGED-{m}" in r["text"] and r["session"] == nb for r in agent), recs
        assert any(r["text"] == f"\\x1b[2J\\x1b]0;pwn\\x07after-{m}" for r in agent), agent
        assert all(r.get("logger") == "substrate.agent" for r in recs if f"FORGED-{m}" in json.dumps(r)), recs
        # the 100 kB line was cut
        assert max(len(x) for x in lines) < 20_000
    finally:
        rt.client.delete_session(nb)


def test_a_chatty_agent_neither_floods_the_log_nor_hangs_its_turn(rt):
    nb = rt.client.create_session("notebook")["id"]
    try:
        before = len(log_bytes(rt))
        # 16 MiB of stderr, far more than a pipe holds: the worker keeps draining it, logs its first 256 KiB
        out = rt.client.invoke(nb, "import os\nfor i in range(4096):\n    os.write(2, b'z' * 4095 + b'\\n')\n'done'")
        assert out["repr"] == "'done'"
        rt.wait_for(lambda: b"over its budget" in log_bytes(rt)[before:], timeout_s=10, what="the budget notice")
        assert len(log_bytes(rt)) - before < 1_000_000, "the log grew by the agent's whole output"
        assert rt.client.invoke(nb, "1 + 1")["repr"] == "2"
    finally:
        rt.client.delete_session(nb)


# ------------------------------------------------------------------------- H2: keyrings, namespaces
KEYS = """
import ctypes, errno
libc = ctypes.CDLL(None, use_errno=True)
def call(nr, *args):
    r = libc.syscall(nr, *args)
    return r, errno.errorcode.get(ctypes.get_errno(), '') if r < 0 else ''
KEY_SPEC_USER_KEYRING = -4
"""


def test_a_key_stored_by_one_session_is_not_read_by_the_next_in_its_slot(rt):
    secret = f"KEY-{uuid.uuid4().hex}"
    first = [rt.client.create_session("notebook")["id"] for _ in range(2)]  # both slots: both uids
    stored = [rt.client.invoke(sid, KEYS + f"call(248, b'user', b'leak', {secret.encode()!r}, {len(secret)}, "
                                            "KEY_SPEC_USER_KEYRING)")["repr"] for sid in first]
    assert all("EPERM" in s for s in stored), f"add_key was allowed: {stored}"
    for sid in first:
        rt.client.delete_session(sid)
    nxt = rt.client.create_session("notebook")["id"]
    try:
        src = KEYS + ("buf = ctypes.create_string_buffer(4096)\n"
                      "kid = call(249, b'user', b'leak', None, 0)\n"                      # request_key
                      "n = libc.syscall(250, 11, kid[0], buf, 4096) if kid[0] > 0 else -1\n"  # KEYCTL_READ
                      "(kid, buf.raw[:max(n, 0)])")
        out = rt.client.invoke(nxt, src)["repr"]
        assert secret not in out and "EPERM" in out, out
        shell = rt.client.create_session("shell")["id"]
        r = rt.client.invoke(shell, "unshare -Ur id; echo rc=$?; unshare -n true; echo rc=$?")
        assert "uid=0" not in r["stdout"] and r["stdout"].count("rc=0") == 0, r
        rt.client.delete_session(shell)
    finally:
        rt.client.delete_session(nxt)


def test_the_filter_denies_namespaces_ptrace_bpf_but_normal_work_goes_on(rt):
    nb = rt.client.create_session("notebook")["id"]
    try:
        src = KEYS + ("import os, subprocess, threading\n"
                      "c = call(56, 0x10000000 | 17, 0, 0, 0, 0)\n"  # clone(CLONE_NEWUSER | SIGCHLD)
                      "if c[0] == 0:\n    os._exit(0)\n"
                      "res = {'unshare': call(272, 0x10000000), 'setns': call(308, 0, 0), 'clone_newuser': c,\n"
                      "       'clone3': call(435, 0, 0), 'ptrace': call(101, 16, 1, 0, 0),\n"
                      "       'bpf': call(321, 0, 0, 0), 'perf': call(298, 0, 0, -1, -1, 0),\n"
                      "       'userfaultfd': call(323, 0), 'mount': call(165, b'x', b'/tmp', b'tmpfs', 0, 0),\n"
                      "       'personality': call(135, 0x0040000), 'kexec': call(246, 0, 0, 0, 0),\n"
                      "       'keyctl': call(250, 0, -4, 0)}\n"
                      "t = []\nth = threading.Thread(target=lambda: t.append(1)); th.start(); th.join()\n"
                      "sub = subprocess.run(['sh', '-c', 'echo $((6*7)) | cat'], capture_output=True, text=True).stdout\n"
                      "pid = os.fork()\nif pid == 0:\n    os._exit(7)\n"
                      "res['ok'] = (t, sub, os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), call(135, 0xffffffff)[0] >= 0)\n"
                      "res")
        res = eval(rt.client.invoke(nb, src)["repr"])  # noqa: S307 - our own cell's dict repr
        for name in ("unshare", "setns", "clone_newuser", "ptrace", "bpf", "perf", "userfaultfd", "mount",
                     "personality", "kexec", "keyctl"):
            assert res[name] == (-1, "EPERM"), (name, res[name])
        assert res["clone3"] == (-1, "ENOSYS")
        assert res["ok"] == ([1], "42\n", 7, True), res["ok"]
    finally:
        rt.client.delete_session(nb)


# ------------------------------------------------------------------------ M1: answers in the worker
def invoke_raw(rt: RuntimeProc, sid: str, src: str, key: str):
    return rt.client.http.post(f"/v1/sessions/{sid}/invoke", json={"input": src}, headers={"Idempotency-Key": key})


def test_an_answer_over_the_limit_is_refused_and_the_session_goes_on(rt):
    nb = rt.client.create_session("notebook")["id"]
    sh = rt.client.create_session("shell")["id"]
    try:
        rt.client.invoke(nb, "x = 5")
        with pytest.raises(ApiError) as e:
            rt.client.invoke(nb, f"'1' * {2 * MAX_ANSWER}")
        assert e.value.code == "output_too_large" and e.value.status == 422, e.value
        assert rt.client.invoke(nb, "x")["repr"] == "5", "the agent kept its state (it was not killed)"
        with pytest.raises(ApiError) as e:
            rt.client.invoke(sh, f"head -c {2 * MAX_ANSWER} /dev/zero | tr '\\0' a")
        assert e.value.code == "output_too_large"
        assert rt.client.invoke(sh, "echo ok")["stdout"] == "ok\n"
    finally:
        rt.client.delete_session(nb)
        rt.client.delete_session(sh)


def test_kept_answers_are_bounded_in_bytes_and_a_retry_never_runs_the_turn_twice(rt):
    nb = rt.client.create_session("notebook")["id"]
    try:
        turn = "n = globals().get('n', 0) + 1\n'y' * {size}"
        big = invoke_raw(rt, nb, turn.format(size=KEEP_BYTES + 1000), "k-big")
        assert big.status_code == 200 and len(big.json()["output"]["repr"]) > KEEP_BYTES
        again = invoke_raw(rt, nb, turn.format(size=KEEP_BYTES + 1000), "k-big")
        assert again.status_code == 410 and again.json()["code"] == "answer_not_kept", again.text
        # five answers of 100 kB: their sum is over the budget, so the oldest become markers
        for i in range(5):
            assert invoke_raw(rt, nb, turn.format(size=100_000), f"k{i}").status_code == 200
        first, last = invoke_raw(rt, nb, turn.format(size=100_000), "k0"), invoke_raw(rt, nb, turn.format(size=100_000), "k4")
        assert first.status_code == 410 and first.json()["code"] == "answer_not_kept"
        assert last.status_code == 200 and last.headers.get("x-substrate-replayed") == "1"
        assert rt.client.invoke(nb, "n")["repr"] == "6", "no turn ran twice"
        # the same bound holds for the snapshot's copy and after a resume
        rt.client.suspend(nb)
        assert invoke_raw(rt, nb, turn.format(size=100_000), "k4").headers.get("x-substrate-replayed") == "1"
        assert invoke_raw(rt, nb, turn.format(size=KEEP_BYTES + 1000), "k-big").status_code == 410
        assert rt.client.invoke(nb, "n")["repr"] == "6"
    finally:
        rt.client.delete_session(nb)
