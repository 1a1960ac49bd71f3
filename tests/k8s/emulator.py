"""A thin adapter over kmock's ``KubernetesEmulator`` for what it lacks and the runtime relies on:

* ``metadata.uid``, ``creationTimestamp``, ``generation`` (bumped when ``spec`` changes) and a global
  ``resourceVersion`` (bumped on every write, also in list metadata);
* ``resourceVersion`` in a PATCH body as a precondition (409 Conflict when stale), as the API server does;
* the status subresource: a PATCH of ``.../status`` changes only ``status``; a PATCH of the object ignores
  ``status`` (``/scale`` patches ``spec.replicas``);
* ``labelSelector`` (equality terms) on list and watch;
* graceful Pod deletion: a DELETE marks the Pod (``deletionTimestamp``); the kubelet removes it with
  ``gracePeriodSeconds=0`` once its containers stopped;
* speed: kmock keeps every request and scans them all on each dispatch; only recent ones are kept.

``EmulatedCluster`` runs it on a real HTTP port in a background thread with its own event loop, so tests
and child processes talk to it over HTTP like to an API server.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import itertools
import threading
import uuid
from typing import Any

import aiohttp.web
import kmock
from kmock._internal import enums
from kmock._internal.k8s import KubernetesError

RESOURCES = {
    "v1/pods": ("Pod", True),
    "v1/secrets": ("Secret", True),
    "coordination.k8s.io/v1/leases": ("Lease", True),
    "substrate.agent.dev/v1/workerpools": ("WorkerPool", True),
    "substrate.agent.dev/v1/actortemplates": ("ActorTemplate", True),
    "resource.k8s.io/v1/resourceclaimtemplates": ("ResourceClaimTemplate", True),
    "resource.k8s.io/v1/resourceclaims": ("ResourceClaim", True),
    "resource.k8s.io/v1/resourceslices": ("ResourceSlice", False),
    "scheduling.k8s.io/v1beta1/podgroups": ("PodGroup", True),
    "autoscaling/v2/horizontalpodautoscalers": ("HorizontalPodAutoscaler", True),
}


def _matches(labels: dict[str, str], selector: str | None) -> bool:
    if not selector:
        return True
    for term in selector.split(","):
        term = term.strip()
        if "!=" in term:
            k, v = term.split("!=", 1)
            if labels.get(k) == v:
                return False
        elif "=" in term:
            k, v = term.replace("==", "=").split("=", 1)
            if labels.get(k) != v:
                return False
        elif term and term not in labels:
            return False
    return True


class Emulator(kmock.KubernetesEmulator):
    """See the module docstring."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self._rv = itertools.count(1)
        self.rv = 0
        for res, (kind, namespaced) in RESOURCES.items():
            self.resources[res] = kmock.ResourceInfo(kind=kind, namespaced=namespaced,
                                                     subresources={"status", "scale"})

    def _get_resources(self) -> list[Any]:
        # kmock adds every stored object's resource by scanning all objects on each request (O(n)); every
        # resource used here is declared up front, so the declared ones are the answer
        return list(self.resources)

    def _next_rv(self) -> str:
        self.rv = next(self._rv)
        return str(self.rv)

    def _stored(self, request: Any) -> Any:
        key = (request.resource, request.namespace, request.name)
        return self.objects[key] if key in self.objects else None

    async def _handle(self, request: Any) -> Any:
        # kmock keeps every request and dispatches by scanning them all (O(requests) per request, so a
        # long test slows down quadratically); keep the recent ones only (the current one is the last)
        if len(self._requests) > 16:
            del self._requests[:-4]
            for payload in self._payloads:
                del payload._requests[:-4]
        if (request.action == enums.action.DELETE and request.name is not None
                and str(request.resource) == str(kmock.resource("v1/pods"))
                and (request.params or {}).get("gracePeriodSeconds") != "0"):
            # graceful deletion, as the API server does for Pods: mark it; the kubelet stops the containers
            # and then removes the object (a delete with gracePeriodSeconds=0)
            obj = self._stored(request)
            if obj is not None and not obj.deleted and not (obj.last.raw.get("metadata") or {}).get("deletionTimestamp"):
                async with self._lock:
                    obj.patch({"metadata": {"deletionTimestamp": dt.datetime.now(dt.timezone.utc).strftime(
                        "%Y-%m-%dT%H:%M:%SZ"), "resourceVersion": self._next_rv()}})
                    raw = obj.raw
                    await self._buses[request.resource].put({"type": "MODIFIED", "object": raw})
                return aiohttp.web.json_response(raw)
        if request.resource is not None and isinstance(request.data, dict):
            meta = request.data.setdefault("metadata", {}) if request.action == enums.action.CREATE else None
            if request.action == enums.action.CREATE:
                meta["uid"] = str(uuid.uuid4())
                meta["creationTimestamp"] = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
                meta["generation"] = 1
                meta["resourceVersion"] = self._next_rv()
                if request.namespace and not meta.get("namespace"):
                    meta["namespace"] = request.namespace
            elif request.action == enums.action.UPDATE and request.name is not None:
                obj = self._stored(request)
                if obj is not None and not obj.deleted:
                    cur = dict(obj.last.raw)
                    want_rv = (request.data.get("metadata") or {}).get("resourceVersion")
                    if want_rv is not None and str(want_rv) != str((cur.get("metadata") or {}).get("resourceVersion")):
                        raise KubernetesError(status=409, reason="Conflict",
                                              message="the object has been modified; please apply your changes "
                                                      "to the latest version and try again")
                    if request.subresource == "status":
                        for k in [k for k in request.data if k != "status"]:
                            del request.data[k]
                    else:
                        request.data.pop("status", None)
                    patch_meta = request.data.setdefault("metadata", {})
                    patch_meta["resourceVersion"] = self._next_rv()
                    if "spec" in request.data:
                        new_spec = _merged(cur.get("spec") or {}, request.data["spec"])
                        if new_spec != (cur.get("spec") or {}):
                            patch_meta["generation"] = int((cur.get("metadata") or {}).get("generation") or 1) + 1
        return await super()._handle(request)

    async def _serve_list(self, request: Any) -> Any:
        out = await super()._serve_list(request)
        sel = (request.params or {}).get("labelSelector")
        out["items"] = [o for o in out["items"] if _matches((o.get("metadata") or {}).get("labels") or {}, sel)]
        out["metadata"] = {"resourceVersion": str(self.rv)}
        return out

    async def _serve_watch(self, request: Any) -> Any:
        sel = (request.params or {}).get("labelSelector")
        async for ev in super()._serve_watch(request):
            if isinstance(ev, dict):
                labels = ((ev.get("object") or {}).get("metadata") or {}).get("labels") or {}
                if not _matches(labels, sel):
                    continue
            yield ev


def _merged(base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        elif isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merged(out[k], v)
        else:
            out[k] = v
    return out


class EmulatedCluster:
    """The emulator on ``url`` in a background thread (own event loop). ``count(resource)`` for tests."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.emulator: Emulator | None = None
        self.url = ""
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self.thread = threading.Thread(target=self._run, name="k8s-emulator", daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._main())

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        async with Emulator() as k, kmock.Server(k) as srv:
            self.emulator = k
            self.url = str(srv.url).rstrip("/")
            self._ready.set()
            await self._stop.wait()

    def start(self) -> "EmulatedCluster":
        self.thread.start()
        self._ready.wait(10)
        return self

    def stop(self) -> None:
        if self._stop is not None:
            self.loop.call_soon_threadsafe(self._stop.set)
        # open watch streams keep the server's graceful shutdown waiting (~10 s); the thread is a daemon
        # and finishes on its own, the test need not wait for it
        self.thread.join(1)

    def objects(self, resource: str, namespace: str | None = None) -> list[dict[str, Any]]:
        """Live objects of ``resource`` (e.g. ``v1/pods``)."""
        assert self.emulator is not None
        out = []
        for (res, ns, _name), obj in list(self.emulator.objects.items()):
            if str(res) == str(kmock.resource(resource)) and not obj.deleted and (namespace is None or ns == namespace):
                out.append(dict(obj.last.raw))
        return out
