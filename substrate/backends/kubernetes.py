"""Kubernetes backend: each worker is a Pod owned by its WorkerPool (the ``Backend`` port of
``substrate.pool``).

* ``create`` builds the Pod (``substrate.k8s.pods``: hardened defaults, ownerReferences, DRA claims) and
  creates it; the Pod counts as running at once (before the watch sees it), so the pool controller's
  expectations never over-create. The controller runs up to ``kubernetes.create_concurrency`` creates at
  once (threads of their own).
* A watch of the namespace's worker Pods (label ``app.kubernetes.io/component=worker``) feeds
  ``running()``/``reap()``: a Pod that is gone, ``Failed``/``Succeeded`` (a crash, an eviction by the
  kubelet) or being deleted by someone else (an API eviction, a node drain) stops counting as running, so
  a replacement is created at once. It is reaped (its sessions recovered) only when its object is gone or
  Failed: while it terminates, its worker suspends its own sessions (graceful drain on SIGTERM). Pods this
  backend deletes are never reported as dead (they were drained first).
* ``Pending`` Pods the scheduler marked ``Unschedulable`` stay: they keep counting as starting capacity, so
  no endless re-creation; ``problems(pool)`` reports them for the pool's condition.
* Pods that fail repeatedly are re-created after a back-off (from the second in a row; ``failure_backoff_s`` doubling up to
  ``failure_backoff_max_s``; ``substrate.backends.backoff``, read by the pool controller as
  ``start_backoff``): meanwhile the controller asks for no Pod (and ``create`` would create nothing), and
  ``problems`` reports ``BackOff``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from substrate.backends.backoff import StartBackoff
from substrate.k8s.api import Informer, Kube
from substrate.k8s.pods import POOL_LABEL, build_worker_pod
from substrate.models import WorkerPool
from substrate.settings import Settings

log = logging.getLogger(__name__)


@dataclass
class PodProblem:
    """Why a worker Pod does not serve: ``reason`` (``Unschedulable``, ``Evicted``, ``Failed``), since when."""

    pod: str
    reason: str
    message: str
    since: float


@dataclass
class _Created:
    pool: str
    at: float = field(default_factory=time.monotonic)


def pod_failed(pod: dict[str, Any]) -> bool:
    return (pod.get("status") or {}).get("phase") in ("Failed", "Succeeded")


def unschedulable(pod: dict[str, Any]) -> dict[str, Any] | None:
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == "PodScheduled" and c.get("status") == "False" and c.get("reason") == "Unschedulable":
            return c
    return None


class KubernetesBackend:
    """Worker Pods in ``settings.kubernetes.namespace`` through ``kube`` (see the module docstring)."""

    def __init__(self, settings: Settings, kube: Kube, *, informer: Informer | None = None) -> None:
        self.settings = settings
        self.kube = kube
        self.namespace = settings.kubernetes.namespace
        self.pods = informer or Informer(kube, kube.core.list_namespaced_pod, self.namespace,
                                         label_selector="app.kubernetes.io/component=worker", name="pods")
        self._created: dict[str, _Created] = {}
        self._deleting: set[str] = set()
        self._reported: dict[str, str] = {}  # running() as last seen: worker -> pool
        k = settings.kubernetes
        self.start_backoff = StartBackoff(k.failure_backoff_s, k.failure_backoff_max_s, noun="worker Pod")
        self._first_seen_problem: dict[str, float] = {}
        self.gang_pools: set[str] = set()
        #: pool name -> the ActorTemplates it hosts (their isolation bounds the Pods); set by the controller
        self.templates_for: Any = lambda _pool: []
        self.creates = 0
        #: creates the pool controller may run at once; they get threads of their own (the default
        #: executor has cores + 4 threads, shared with every other blocking call of the process)
        self.create_concurrency = settings.kubernetes.create_concurrency
        self._create_threads = concurrent.futures.ThreadPoolExecutor(self.create_concurrency,
                                                                     thread_name_prefix="pod-create")

    async def start(self, sync_timeout_s: float = 30.0) -> None:
        """Start the Pod watch and wait for its first listing (called by ``PoolController.start``)."""
        if self.pods._thread is None:
            self.pods.start()
        if not await self.pods.wait_synced(sync_timeout_s):
            log.warning("worker Pods not listed yet from the API server")

    # --------------------------------------------------------------------------------------- port
    async def create(self, pool: WorkerPool, worker_id: str) -> None:
        if self.start_backoff.reason(pool.name):
            log.debug("create skipped: backing off", extra={"pool": pool.name})
            return
        body = build_worker_pod(pool, worker_id, self.settings, namespace=self.namespace,
                                gang=pool.name in self.gang_pools, templates=self.templates_for(pool.name))
        self._created[worker_id] = _Created(pool.name)
        try:
            await asyncio.get_running_loop().run_in_executor(self._create_threads, self.kube.create_pod,
                                                             self.namespace, body)
        except Exception:
            self._created.pop(worker_id, None)
            raise
        self.creates += 1
        log.info("worker pod created", extra={"worker": worker_id, "pool": pool.name})

    async def delete(self, worker_id: str, grace_s: int | None = None) -> None:
        self._deleting.add(worker_id)
        self._created.pop(worker_id, None)
        self._reported.pop(worker_id, None)
        await asyncio.to_thread(self.kube.delete_pod, self.namespace, worker_id, grace_s)

    def _pool_of(self, pod: dict[str, Any]) -> str | None:
        return ((pod.get("metadata") or {}).get("labels") or {}).get(POOL_LABEL)

    def running(self) -> dict[str, str]:
        out: dict[str, str] = {}
        items = self.pods.items
        now = time.monotonic()
        for name, c in list(self._created.items()):
            if name in items:
                self._created.pop(name)
            elif now - c.at < 120:  # created, not yet seen by the watch
                out[name] = c.pool
            else:
                self._created.pop(name)
        for name, pod in items.items():
            pool = self._pool_of(pod)
            if pool is None or name in self._deleting:
                continue
            if pod_failed(pod) or (pod.get("metadata") or {}).get("deletionTimestamp"):
                continue  # crashed, evicted, or being deleted by someone else: replace it
            out[name] = pool
        self._reported.update(out)
        for name in list(self._deleting):
            if name not in items:
                self._deleting.discard(name)
        return out

    def reap(self) -> list[str]:
        """Workers that ended since the last call (their Pod is gone or Failed); Failed Pods are deleted
        and their pool backs off before the next create."""
        items = self.pods.items
        dead: list[str] = []
        for name, pool in list(self._reported.items()):
            pod = items.get(name)
            if name in self._created:
                continue
            # a Pod being deleted by someone else (eviction, node drain) still runs its worker, which drains
            # itself on SIGTERM: it is dead only once its object is gone (the kubelet stopped it) or Failed
            gone = pod is None or pod_failed(pod)
            if gone:
                self._reported.pop(name)
                dead.append(name)
                if pod is not None and pod_failed(pod):
                    self.start_backoff.failed(pool)
                    self._deleting.add(name)
                    asyncio.ensure_future(asyncio.to_thread(self.kube.delete_pod, self.namespace, name, 0))
                log.warning("worker pod ended", extra={"worker": name, "pool": pool,
                                                        "reason": ((pod or {}).get("status") or {}).get("reason")})
        return dead

    async def close(self) -> None:
        self.pods.stop()
        self._create_threads.shutdown(wait=False, cancel_futures=True)

    # ----------------------------------------------------------------------------------- extras
    def pods_of(self, pool: str) -> dict[str, dict[str, Any]]:
        return {n: p for n, p in self.pods.items.items() if self._pool_of(p) == pool}

    def unplaceable(self, pool: str) -> tuple[set[str], str]:
        """Pods of ``pool`` the scheduler refuses right now (no grace period: a router deciding whether
        to wait for capacity must not wait for them) and why no new worker can come (the scheduler's
        message, or the failure back-off), for the capacity note routers read (``substrate.demand``)."""
        stuck: set[str] = set()
        why = ""
        for name, pod in self.pods_of(pool).items():
            c = unschedulable(pod)
            if c is not None:
                stuck.add(name)
                why = why or f"worker Pod {name} is Unschedulable: {c.get('message') or 'no node fits'}"
        why = why or self.start_backoff.reason(pool)
        return stuck, why

    def problems(self, pool: str) -> list[PodProblem]:
        """Pods of ``pool`` that do not serve and why (Unschedulable for longer than the grace period)."""
        out = []
        now = time.time()
        grace = self.settings.kubernetes.unschedulable_grace_s
        for name, pod in self.pods_of(pool).items():
            c = unschedulable(pod)
            if c is None:
                self._first_seen_problem.pop(name, None)
                continue
            since = self._first_seen_problem.setdefault(name, now)
            if now - since >= grace:
                out.append(PodProblem(name, "Unschedulable", c.get("message") or "", since))
        if why := self.start_backoff.failing(pool):  # through the retries too, until a Pod starts
            out.append(PodProblem("", "BackOff", why, now))
        return out
