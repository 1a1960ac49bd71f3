"""A small test kubelet: runs a real ``substrate worker`` process for every worker Pod in the emulator.

It watches Pods over HTTP (the runtime's own ``Informer``), and for each new Pod: gives it a Pod IP of its
own (127.0.0.N: loopback addresses stand in for Pod network namespaces, so every worker can listen on the
same port), maps each volume mount to a fresh host folder, resolves the container's env like a kubelet
(values, ``fieldRef`` metadata.name/namespace/status.podIP, ``secretKeyRef`` from Secrets in the emulator),
starts the container command (``substrate ...`` runs this venv's ``python -m substrate.cli ...``) with only
that env, and marks the Pod ``Running`` + ``Ready`` once ``/healthz`` answers. A Pod deleted from the API
(``deletionTimestamp``) gets SIGTERM, SIGKILL after its grace period, then the Pod object is removed; a
process that exits by itself marks its Pod ``Failed``. Pods with
``spec.nodeSelector`` ``test/unschedulable: "true"``, and Pods beyond ``max_pods`` (the node is full), are
marked ``Unschedulable`` instead of started.
"""

from __future__ import annotations

import base64
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from kubernetes import client

from substrate.k8s.api import Informer, Kube


class TestKubelet:
    def __init__(self, api_url: str, namespace: str, root: Path, max_pods: int = 50) -> None:
        self.max_pods = max_pods
        cfg = client.Configuration()
        cfg.host = api_url
        self.kube = Kube(client.ApiClient(cfg))
        self.namespace = namespace
        self.root = root
        self.pods = Informer(self.kube, self.kube.core.list_namespaced_pod, namespace, name="kubelet")
        self.procs: dict[str, tuple[subprocess.Popen[bytes], str, int]] = {}
        self.ips: dict[str, str] = {}
        self._next_ip = 2
        self._stop = threading.Event()
        self._terminating: set[str] = set()
        self.thread = threading.Thread(target=self._loop, name="kubelet", daemon=True)
        self.started = 0
        self.log_dir = root / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)

    def start(self) -> "TestKubelet":
        self.pods.start()
        self.pods.synced.wait(10)
        self.thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(10)
        self.pods.stop()
        for name in list(self.procs):
            self._kill(name, grace_s=1)  # teardown: no need to wait for graceful drains

    # ------------------------------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._sync()
            except Exception as e:  # noqa: BLE001 - a kubelet keeps going
                print("kubelet error:", repr(e), file=sys.stderr)
            time.sleep(0.05)

    def _sync(self) -> None:
        items = dict(self.pods.items)
        for name, pod in items.items():
            phase = (pod.get("status") or {}).get("phase")
            if name not in self.procs and phase in (None, "Pending") and not (pod.get("metadata") or {}).get(
                    "deletionTimestamp"):
                full = len(self.procs) >= self.max_pods
                if full or ((pod.get("spec") or {}).get("nodeSelector") or {}).get("test/unschedulable") == "true":
                    if not (pod.get("status") or {}).get("conditions"):
                        self._status(name, {"phase": "Pending", "conditions": [
                            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                             "message": "0/3 nodes are available: 3 Insufficient gpu.nvidia.com."}]})
                    continue
                self._start(pod)
        for name, pod in items.items():  # terminating Pods without a process: remove them
            if (pod.get("metadata") or {}).get("deletionTimestamp") and name not in self.procs \
                    and name not in self._terminating:
                self._remove(name)
        for name, (proc, ip, _port) in list(self.procs.items()):
            pod = items.get(name)
            if pod is None or (pod.get("metadata") or {}).get("deletionTimestamp"):
                if name in self._terminating:
                    continue
                grace = int(((pod or {}).get("spec") or {}).get("terminationGracePeriodSeconds") or 30)
                self._terminating.add(name)
                threading.Thread(target=self._terminate, args=(name, min(grace, 30), pod is not None),
                                 daemon=True).start()
                continue
            if proc.poll() is not None:
                self.procs.pop(name)
                self._status(name, {"phase": "Failed", "reason": "Error",
                                    "message": f"container exited with {proc.returncode}",
                                    "conditions": [{"type": "Ready", "status": "False"}]})
                continue
            if (pod.get("status") or {}).get("phase") != "Running":
                port = self.procs[name][2]
                try:
                    ok = httpx.get(f"http://{ip}:{port}/healthz", timeout=0.5).status_code == 200
                except httpx.HTTPError:
                    ok = False
                if ok:
                    self._status(name, {"phase": "Running", "podIP": ip, "conditions": [
                        {"type": "PodScheduled", "status": "True"}, {"type": "Ready", "status": "True"}]})

    def _terminate(self, name: str, grace_s: float, remove: bool) -> None:
        """SIGTERM, SIGKILL after the grace period, then remove the Pod object (as a kubelet does)."""
        try:
            self._kill(name, grace_s)
            if remove:
                self._remove(name)
        finally:
            self._terminating.discard(name)

    def _remove(self, name: str) -> None:
        try:
            self.kube.core.delete_namespaced_pod(name, self.namespace, grace_period_seconds=0)
        except client.ApiException:
            pass

    def _status(self, name: str, status: dict[str, Any]) -> None:
        try:
            self.kube.core.patch_namespaced_pod_status(name, self.namespace, {"status": status})
        except client.ApiException:
            pass

    def _env(self, pod: dict[str, Any], container: dict[str, Any], ip: str, mounts: dict[str, str]) -> dict[str, str]:
        env = {"PATH": os.environ.get("PATH", ""), "HOME": str(self.root), "LANG": "C.UTF-8"}
        meta = pod["metadata"]
        for e in container.get("env") or []:
            if "value" in e and e["value"] is not None:
                v = str(e["value"])
            else:
                src = e.get("valueFrom") or {}
                if "fieldRef" in src:
                    v = {"metadata.name": meta["name"], "metadata.namespace": meta.get("namespace", ""),
                         "status.podIP": ip}[src["fieldRef"]["fieldPath"]]
                elif "secretKeyRef" in src:
                    ref = src["secretKeyRef"]
                    sec = self.kube.core.read_namespaced_secret(ref["name"], self.namespace)
                    v = base64.b64decode((sec.data or {})[ref["key"]]).decode()
                else:
                    continue
            for path, host in mounts.items():  # a path under a mount lives in that volume's host folder
                if v == path or v.startswith(path + "/"):
                    v = host + v[len(path):]
            env[e["name"]] = v
        env["SUBSTRATE_WORKER_LISTEN_HOST"] = ip  # the Pod's own network namespace, as a loopback address
        return env

    def _start(self, pod: dict[str, Any]) -> None:
        name = pod["metadata"]["name"]
        container = pod["spec"]["containers"][0]
        ip = self.ips.get(name) or f"127.0.0.{self._next_ip}"
        self._next_ip += 1
        self.ips[name] = ip
        mounts = {}
        for m in container.get("volumeMounts") or []:
            if m["mountPath"] == "/tmp":  # the host's /tmp stands in for it (test paths live there)
                continue
            host = self.root / "pods" / name / m["name"]
            host.mkdir(parents=True, exist_ok=True)
            mounts[m["mountPath"]] = str(host)
        env = self._env(pod, container, ip, mounts)
        cmd = list(container.get("command") or []) + list(container.get("args") or [])
        if cmd and cmd[0] == "substrate":
            cmd = [sys.executable, "-m", "substrate.cli", *cmd[1:]]
        port = int(next((p["containerPort"] for p in container.get("ports") or [] if p.get("name") == "http"), 8081))
        log = open(self.log_dir / f"{name}.log", "wb")  # noqa: SIM115
        # SIGTERM when the kubelet's thread (so the test run) is gone: a test run killed mid-way left its
        # Pods' worker processes running for good (they have no lifeline, as on a real node)
        cmd = ["/usr/bin/setpriv", "--pdeathsig", "TERM", "--", *cmd]
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                cwd=str(self.root))
        self.procs[name] = (proc, ip, port)
        self.started += 1

    def _kill(self, name: str, grace_s: float) -> None:
        entry = self.procs.get(name)
        if entry is None:
            return
        proc = entry[0]
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.procs.pop(name, None)
        shutil.rmtree(self.root / "pods" / name, ignore_errors=True)
