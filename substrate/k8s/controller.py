"""The pool controller over the Kubernetes API (what ``substrate controller`` runs while it leads).

* ``KubeCatalog``: WorkerPools and ActorTemplates are watched from the API server and kept in a
  ``Catalog`` updated in place (routers use it too). Documents are normalised like files
  (``substrate.specs.normalize``); a document that does not load is left out and logged.
* ``KubePoolController`` extends ``PoolController`` (same pure ``reconcile``) with what a cluster needs:
  - a finalizer ``substrate.agent.dev/suspend-sessions`` on every WorkerPool: deleting a pool first drains
    its workers (sessions suspended to the store; they stay SUSPENDED in Redis and wake wherever their
    template's pool runs again), deletes their Pods, then removes the finalizer;
  - rolling replacement: Pods carry the hash of what built them (``substrate.k8s.pods.template_hash``); while
    a pool has outdated workers, up to ``kubernetes.max_surge`` of them are drained at a time, and only when
    the pool has its desired number of serving workers, so capacity dips by at most ``max_surge`` workers;
    replacements come from the normal scale-up (a drained worker no longer counts as serving);
  - per-pool objects: the ResourceClaimTemplate compiled from ``spec.accelerators`` and the gang PodGroup
    (``substrate.k8s.dra``; its ``minCount`` follows the pool's desired worker count as it scales), and a
    HorizontalPodAutoscaler when ``spec.autoscaling.metrics`` is set;
  - status through the status subresource (``substrate.k8s.status``), written only when it changed; a
    WorkerPool that does not load gets ``Valid=False InvalidSpec`` with the loader's message;
  - every ActorTemplate gets a ``Valid`` condition in its status, also written only when it changed: True
    ``Loaded``, or False ``InvalidSpec`` (the loader's message) or ``UnknownWorkerPool`` (its
    ``workerPool`` names no pool that loaded; logged once, as ``substrate up`` refuses such a template);
  - ``spec.replicas`` defaulting: the CRD has none (the API server would add it to autoscaled pools too,
    where it is unused), so a pool without one that the built-in autoscaler does not size gets the model's
    default (2, as a file's pool) written once, which ``/scale`` needs.
* Replica count: without ``spec.autoscaling`` (or with HPA ``metrics``) the count is ``spec.replicas``, which
  ``/scale`` writes (``kubectl scale``, HPA, KEDA); with the built-in autoscaling the slot autoscaler decides
  between min and max and ``spec.replicas`` is ignored (the ``ScalingManaged`` condition says so). One writer
  either way.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from substrate.backends.kubernetes import KubernetesBackend, unschedulable
from substrate.directory import Directory
from substrate import metrics
from substrate.k8s import dra, gpu, status as kstatus
from substrate.k8s.api import GROUP, VERSION, Informer, Kube, KubeError
from substrate.loops import cancel_and_wait
from substrate.errors import InvalidInput
from substrate.k8s.pods import HASH_LABEL, owner_reference, template_hash
from substrate.models import ActorTemplate, WarmPool, WorkerPool, WorkerPoolSpec, WorkerState
from substrate.pool import PoolController, desired_replicas
from substrate.settings import Settings
from substrate.specs import Catalog, SpecError, load_documents

log = logging.getLogger(__name__)

FINALIZER = "substrate.agent.dev/suspend-sessions"


class KubeCatalog:
    """WorkerPools/ActorTemplates of one namespace from the API server, into ``catalog`` in place."""

    def __init__(self, kube: Kube, namespace: str, catalog: Catalog | None = None) -> None:
        self.kube = kube
        self.namespace = namespace
        self.catalog = catalog or Catalog()
        lister = kube.custom.list_namespaced_custom_object

        def lf(plural: str) -> Any:
            def fn(ns: str, **kw: Any) -> Any:
                return lister(GROUP, VERSION, ns, plural, **kw)
            fn.__name__ = plural
            return fn

        self.pools = Informer(kube, lf("workerpools"), namespace, name="workerpools")
        self.templates = Informer(kube, lf("actortemplates"), namespace, name="actortemplates")
        self.raw_pools: dict[str, dict[str, Any]] = {}
        self.deleting: dict[str, dict[str, Any]] = {}
        self.errors: dict[str, str] = {}
        #: templates that load but name a pool the catalog lacks: name -> message (as ``substrate up`` says it)
        self.unknown_pools: dict[str, str] = {}
        self._warned: set[tuple[str, Any]] = set()
        for inf in (self.pools, self.templates):
            inf.add_listener(self.rebuild)

    def start(self) -> None:
        self.pools.start()
        self.templates.start()

    async def wait_synced(self, timeout_s: float = 30.0) -> bool:
        return await self.pools.wait_synced(timeout_s) and await self.templates.wait_synced(timeout_s)

    def stop(self) -> None:
        self.pools.stop()
        self.templates.stop()

    def rebuild(self) -> None:
        pools: dict[str, WorkerPool] = {}
        templates: dict[str, ActorTemplate] = {}
        self.deleting = {}
        errors: dict[str, str] = {}
        for src, out in ((self.pools.items, pools), (self.templates.items, templates)):
            for name, doc in list(src.items()):
                if (doc.get("metadata") or {}).get("deletionTimestamp"):
                    if doc.get("kind") == "WorkerPool" or src is self.pools.items:
                        self.deleting[name] = doc
                    continue
                doc = {k: v for k, v in doc.items() if k != "status"}
                try:
                    part = load_documents([doc], f"{doc.get('kind')}/{name}", log_warnings=False)
                except SpecError as e:
                    errors[f"{doc.get('kind')}/{name}"] = e.message
                    continue
                gen = (doc.get("metadata") or {}).get("generation")
                for w in part.warnings:  # once per object generation, not on every status update
                    if (w, gen) not in self._warned:
                        self._warned.add((w, gen))
                        log.warning(w)
                out.update(part.pools if src is self.pools.items else part.templates)  # type: ignore[arg-type]
        self.raw_pools = dict(self.pools.items)
        for n, e in errors.items():
            if self.errors.get(n) != e:
                log.warning("spec not loaded", extra={"object": n, "error": e})
        self.errors = errors
        self.catalog.pools.clear()
        self.catalog.pools.update(pools)
        self.catalog.templates.clear()
        self.catalog.templates.update(templates)
        unknown: dict[str, str] = {}
        # judged only once both lists arrived: templates listed before the pools would all read as unknown
        if self.pools.synced.is_set() and self.templates.synced.is_set():
            for name, t in templates.items():
                try:
                    self.catalog.pool_for(t)
                except InvalidInput as e:
                    unknown[name] = e.message
        for n, msg in unknown.items():
            if self.unknown_pools.get(n) != msg:  # once, not on every rebuild
                log.warning(msg, extra={"object": f"ActorTemplate/{n}"})
        self.unknown_pools = unknown

    def template_valid(self, name: str) -> tuple[bool, str, str]:
        """The ``Valid`` condition of ActorTemplate ``name``: (ok, reason, message)."""
        err = self.errors.get(f"ActorTemplate/{name}")
        if err is not None:
            return False, "InvalidSpec", err
        if name in self.unknown_pools:
            return False, "UnknownWorkerPool", self.unknown_pools[name]
        return True, "Loaded", "spec loaded"


class KubePoolController(PoolController):
    """``PoolController`` + finalizer, rollout, per-pool objects and status (module docstring)."""

    def __init__(self, settings: Settings, directory: Directory, kcat: KubeCatalog, backend: KubernetesBackend,
                 activator: Any = None, **kw: Any) -> None:
        super().__init__(settings, directory, kcat.catalog, backend, activator, **kw)
        self.kcat = kcat
        self.kbackend = backend
        self.kube = backend.kube
        self.namespace = settings.kubernetes.namespace
        self._ensured: dict[str, str] = {}
        self._finalizing: set[str] = set()
        self._last_status: dict[str, dict[str, Any]] = {}
        self._last_template_status: dict[str, dict[str, Any]] = {}
        self._rolling: set[str] = set()
        #: gang pools: the PodGroup minCount last written, per pool
        self._gang_min: dict[str, int] = {}
        backend.templates_for = self._templates_for
        # DRA allocations and the drivers' device inventory, for the GPU memory gauges (substrate.k8s.gpu)
        res = self.kube.resource
        self.claims = Informer(self.kube, lambda ns, **kw: res.list_namespaced_resource_claim(ns, **kw),
                               self.namespace, name="resourceclaims")
        self.slices = Informer(self.kube, lambda _ns, **kw: res.list_resource_slice(**kw), self.namespace,
                               name="resourceslices")

    async def start(self) -> None:
        self.claims.start()
        self.slices.start()
        await super().start()

    async def stop(self) -> None:
        # leave worker Pods running: a controller restart or failover must not touch serving workers
        await cancel_and_wait([self._task, self._follow])
        self.claims.stop()
        self.slices.stop()
        await self.backend.close()

    def _templates_for(self, pool: str) -> list[ActorTemplate]:
        out = []
        for t in self.catalog.templates.values():
            try:
                if self.catalog.pool_for(t).name == pool:
                    out.append(t)
            except Exception:  # noqa: BLE001 - a template naming an unknown pool hosts nowhere
                continue
        return out

    def effective_spec(self, pool: WorkerPool) -> WorkerPoolSpec:
        """While a pool rolls, ``max_surge`` extra workers (new template) so capacity never dips."""
        if pool.name not in self._rolling:
            return pool.spec
        surge = self.settings.kubernetes.max_surge
        spec = pool.spec.model_copy(update={"replicas": pool.spec.replicas + surge})
        a = spec.autoscaling
        if a is not None and not a.metrics:
            spec.autoscaling = a.model_copy(update={"maxReplicas": a.maxReplicas + surge})
            spec.warmPool = (spec.warmPool.model_copy(update={"readyReplicas": spec.warmPool.readyReplicas + surge})
                             if spec.warmPool else WarmPool(readyReplicas=surge))
        return spec

    async def _api(self, fn: Any, *args: Any) -> Any:
        return await asyncio.to_thread(fn, *args)

    async def tick(self) -> None:
        for name, raw in list(self.kcat.raw_pools.items()):
            try:
                await self._default_replicas(name, raw)
                await self._ensure_pool_objects(name, raw)
            except Exception:  # noqa: BLE001 - a control loop never dies
                log.warning("ensuring pool objects failed", extra={"pool": name}, exc_info=True)
        for name, raw in list(self.kcat.templates.items.items()):
            try:
                await self._template_status(name, raw)
            except Exception:  # noqa: BLE001 - a control loop never dies
                log.warning("template status failed", extra={"template": name}, exc_info=True)
        for name, raw in list(self.kcat.deleting.items()):
            if name not in self._finalizing:
                self._finalizing.add(name)
                asyncio.create_task(self._finalize(name, raw))
        for key, message in list(self.kcat.errors.items()):
            kind, _, name = key.partition("/")
            if kind == "WorkerPool":
                try:
                    await self._invalid_status(name, message)
                except Exception:  # noqa: BLE001
                    log.warning("status of an invalid pool failed", extra={"pool": name}, exc_info=True)
        await super().tick()
        for pool in list(self.catalog.pools.values()):
            # each step on its own: a failing PodGroup patch must not hold back the rollout or the status
            for step in (self._sync_gang, self._trim_unregistered, self._rollout, self._write_status):
                try:
                    await step(pool)
                except Exception:  # noqa: BLE001 - a control loop never dies
                    log.warning("pool step failed", extra={"pool": pool.name, "step": step.__name__},
                                exc_info=True)

    async def _default_replicas(self, name: str, raw: dict[str, Any]) -> None:
        """Write the model's default ``spec.replicas`` into a pool that has none and is not sized by the
        built-in autoscaler. The CRD has no default (the API server would add it to autoscaled pools too,
        where it is not used); without a value ``/scale`` cannot be read (``kubectl scale``, the HPA of
        ``autoscaling.metrics``). The ``resourceVersion`` precondition loses to a concurrent writer (409:
        retried next tick, by when the pool has its own value)."""
        meta = raw.get("metadata") or {}
        spec = raw.get("spec")
        if meta.get("deletionTimestamp") or not isinstance(spec, dict) or "replicas" in spec:
            return
        auto = spec.get("autoscaling")
        if isinstance(auto, dict) and not auto.get("metrics"):
            return
        if name not in self.catalog.pools:
            return  # a pool that does not load gets its Valid=False status, not a spec write
        replicas = WorkerPoolSpec.model_fields["replicas"].default
        await self._api(self.kube.patch_pool, self.namespace, name,
                        {"metadata": {"resourceVersion": meta.get("resourceVersion")}, "spec": {"replicas": replicas}})
        log.info("spec.replicas defaulted", extra={"pool": name, "replicas": replicas})

    async def _template_status(self, name: str, raw: dict[str, Any]) -> None:
        """An ActorTemplate's ``Valid`` condition (``KubeCatalog.template_valid``), written to its status
        subresource only when it changed (not every round)."""
        meta = raw.get("metadata") or {}
        if meta.get("deletionTimestamp"):
            return
        ok, reason, message = self.kcat.template_valid(name)
        old = raw.get("status") or {}
        gen = int(meta.get("generation") or 1)
        cond = kstatus.condition("Valid", ok, reason, message[:1000], old.get("conditions") or [], gen)
        new = {**old, "observedGeneration": gen, "conditions": [cond]}
        if old == new or self._last_template_status.get(name) == new:
            return
        await self._api(self.kube.patch_template_status, self.namespace, name, new)
        self._last_template_status[name] = new

    async def _ensure_pool_objects(self, name: str, raw: dict[str, Any]) -> None:
        meta = raw.get("metadata") or {}
        if meta.get("deletionTimestamp"):
            return
        if FINALIZER not in (meta.get("finalizers") or []):
            await self._api(self.kube.patch_pool, self.namespace, name,
                            {"metadata": {"finalizers": [*(meta.get("finalizers") or []), FINALIZER]}})
        pool = self.catalog.pools.get(name)
        if pool is None:
            return
        key = f"{meta.get('uid')}/{template_hash(pool)}/{pool.spec.replicas}"
        if self._ensured.get(name) == key:
            return
        owner = owner_reference(pool)
        acc = pool.spec.accelerators
        if acc:
            await self._api(self.kube.create_object,
                            dra.claim_template(name, self.namespace, acc, owner), "resourceclaimtemplates")
            if acc.get("gang"):
                self.kbackend.gang_pools.add(name)
                await self._api(self.kube.create_object,
                                dra.pod_group(name, self.namespace, desired_replicas(pool.spec, 0), owner),
                                "podgroups")
        if pool.spec.autoscaling and pool.spec.autoscaling.metrics:
            await self._api(self.kube.create_object, kstatus.hpa(pool, self.namespace, owner),
                            "horizontalpodautoscalers")
        self._ensured[name] = key

    async def _sync_gang(self, pool: WorkerPool) -> None:
        """Keep a gang pool's PodGroup ``minCount`` at the pool's desired worker count (surge included
        while it rolls) as the pool scales: ``minCount`` is mutable in ``scheduling.k8s.io/v1beta1`` and
        the scheduler applies a change in its next cycles. Written only when the count changes (a
        PodGroup found missing then is created with it)."""
        if pool.name not in self.kbackend.gang_pools or not (pool.spec.accelerators or {}).get("gang"):
            self._gang_min.pop(pool.name, None)
            return
        st = self._state.get(pool.name)
        want = max(1, st.desired if st else desired_replicas(self.effective_spec(pool), 0))
        if self._gang_min.get(pool.name) == want:
            return
        try:
            await self._api(self.kube.patch_object, "scheduling.k8s.io/v1beta1", "podgroups", self.namespace,
                            pool.name, {"spec": {"schedulingPolicy": {"gang": {"minCount": want}}}})
        except KubeError as e:
            if e.status != 404:
                raise
            await self._api(self.kube.create_object, dra.pod_group(pool.name, self.namespace, want,
                                                                   owner_reference(pool)), "podgroups")
        self._gang_min[pool.name] = want
        log.info("gang minCount", extra={"pool": pool.name, "minCount": want})

    async def _trim_unregistered(self, pool: WorkerPool) -> None:
        """A pool scaled below the Pods it has, some of which never registered (Pending, Unschedulable,
        still starting): delete the excess among those, Unschedulable first, then the newest. They hold
        no session (a worker that registers meanwhile gets SIGTERM and suspends its own sessions), and
        the reconciler cannot remove them: it drains only READY workers, and counts these as capacity on
        its way, which would keep the pool above its desired size for good."""
        st = self._state.get(pool.name)
        if st is None:
            return
        mine = [wid for wid, p in self.kbackend.running().items() if p == pool.name]
        excess = len(mine) - st.desired
        if excess <= 0:
            return
        registered = {w.id for w in await self.directory.list_workers() if w.pool == pool.name}
        pods = self.kbackend.pods_of(pool.name)
        spare = [wid for wid in mine if wid not in registered and wid not in self._draining]
        spare.sort(key=lambda w: ((pods.get(w) or {}).get("metadata") or {}).get("creationTimestamp") or "~",
                   reverse=True)
        spare.sort(key=lambda w: unschedulable(pods.get(w) or {}) is None)  # stable: newest first within
        for wid in spare[:excess]:
            st.expectations.pop(wid, None)
            log.info("deleting an unregistered worker Pod beyond the pool's size",
                     extra={"pool": pool.name, "worker": wid, "desired": st.desired})
            await self.kbackend.delete(wid)

    async def _finalize(self, name: str, raw: dict[str, Any]) -> None:
        """Drain every worker of a pool being deleted, delete its Pods, then drop the finalizer."""
        try:
            self.catalog.pools.pop(name, None)
            for _ in range(600):
                workers = [w for w in await self.directory.list_workers() if w.pool == name]
                for w in workers:
                    if w.id not in self._draining:
                        self._draining.add(w.id)
                        await self._drain(w.id)
                # Pods that never registered (Pending) have no sessions: delete them directly
                for pod in list(self.kbackend.pods_of(name)):
                    if pod not in {w.id for w in workers}:
                        await self.kbackend.delete(pod)
                left = [w for w in await self.directory.list_workers() if w.pool == name]
                running = [s for s in await self._pool_sessions(name)]
                if not left and not running:
                    break
                await asyncio.sleep(0.2)
            meta = raw.get("metadata") or {}
            fins = [f for f in meta.get("finalizers") or [] if f != FINALIZER]
            await self._api(self.kube.patch_pool, self.namespace, name, {"metadata": {"finalizers": fins}})
            self._state.pop(name, None)
            self._ensured.pop(name, None)
            self._gang_min.pop(name, None)
            log.warning("pool deleted after its sessions were suspended", extra={"pool": name})
        except Exception:  # noqa: BLE001 - retried on the next tick
            log.warning("pool finalizer failed", extra={"pool": name}, exc_info=True)
        finally:
            self._finalizing.discard(name)

    async def _pool_sessions(self, pool: str) -> list[str]:
        out = []
        for w in await self.directory.list_workers():
            if w.pool == pool:
                out += list((await self.directory.worker_slots(w.id)).values())
        return out

    async def _rollout(self, pool: WorkerPool) -> None:
        """Replace workers built from an older pod template, ``max_surge`` at a time (module docstring)."""
        want = template_hash(pool)
        pods = self.kbackend.pods_of(pool.name)
        outdated = [n for n, p in pods.items()
                    if ((p.get("metadata") or {}).get("labels") or {}).get(HASH_LABEL) != want
                    and not (p.get("metadata") or {}).get("deletionTimestamp")]
        if not outdated:
            self._rolling.discard(pool.name)
            return
        self._rolling.add(pool.name)
        workers = {w.id: w for w in await self.directory.list_workers() if w.pool == pool.name}
        budget = self.settings.kubernetes.max_surge - sum(1 for n in outdated if n in self._draining)
        if budget <= 0:
            return
        st = self._state.get(pool.name)
        desired = st.desired if st else desired_replicas(self.effective_spec(pool), 0)
        serving = [w for w in workers.values() if w.state == WorkerState.READY and w.id not in self._draining]
        # the next old worker goes only once the surge worker(s) serve: capacity never dips below desired
        if len(serving) < desired:
            return
        for name in outdated:
            if budget <= 0:
                break
            if name in self._draining:
                continue
            if name not in workers:  # never registered (Pending or crashed): nothing to drain
                await self.kbackend.delete(name)
            else:
                self._draining.add(name)
                asyncio.create_task(self._drain(name))
                log.info("rolling worker", extra={"pool": pool.name, "worker": name})
            budget -= 1

    def _gpu_metrics(self, pool: WorkerPool, workers: list[Any]) -> None:
        pods = self.kbackend.pods_of(pool.name)
        reported = {w.id: w.gpuMemoryBytes for w in workers if w.gpuMemoryBytes}
        if not reported and (not self.claims.items or not self.slices.items):
            total = fragmented = 0
        else:
            serving = {w.id for w in workers if w.state == WorkerState.READY and w.id not in self._draining}
            total, fragmented = gpu.pool_gpu_memory(pods, serving, self.claims.items,
                                                    gpu.device_memory(self.slices.items.values()), reported)
        metrics.GPU_MEMORY_TOTAL.labels(pool=pool.name).set(total)
        metrics.GPU_MEMORY_FRAGMENTED.labels(pool=pool.name).set(fragmented)

    async def _invalid_status(self, name: str, message: str) -> None:
        """A WorkerPool that does not load gets ``Valid=False`` with the loader's message (naming the field)."""
        raw = self.kcat.raw_pools.get(name) or {}
        old = raw.get("status") or {}
        gen = int((raw.get("metadata") or {}).get("generation") or 1)
        cond = kstatus.condition("Valid", False, "InvalidSpec", message[:1000], old.get("conditions") or [], gen)
        new = {**old, "observedGeneration": gen, "conditions": [cond]}
        if old != new and self._last_status.get(name) != new:
            await self._api(self.kube.patch_pool_status, self.namespace, name, new)
            self._last_status[name] = new

    async def _write_status(self, pool: WorkerPool) -> None:
        raw = self.kcat.raw_pools.get(pool.name) or {}
        workers = [w for w in await self.directory.list_workers() if w.pool == pool.name]
        self._gpu_metrics(pool, workers)
        st = self._state.get(pool.name)
        new = kstatus.compute(pool, raw, workers, self.kbackend.pods_of(pool.name),
                              self.kbackend.problems(pool.name), expectations=len(st.expectations) if st else 0,
                              draining=self._draining)
        old = raw.get("status") or {}
        if kstatus.same(old, new) or kstatus.same(self._last_status.get(pool.name, {}), new):
            return
        await self._api(self.kube.patch_pool_status, self.namespace, pool.name, new)
        self._last_status[pool.name] = new

