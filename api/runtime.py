"""The composition root of one router process: everything the API needs, built from settings.

With ``embedded=True`` (``substrate up``) the same process also runs the state manager and the pool
controller with the local-process backend, so one command brings up the whole runtime.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import uuid
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from api.auth import AUTH_CLOSED_MARKER, Authenticator
from api.proxy import RouteCache
from api.workerhttp import WorkerHTTP
from snapshot.state_manager import StateManager
from snapshot.guard import GuardedStore
from snapshot.store import ObjectStore, make_store
from substrate import catalogcheck, storeloc
from substrate.catalogcheck import CatalogCheck
from substrate.activator import Activator, WorkerView
from substrate.leasewatch import LeaseWatch
from substrate.audit import AuditLog
from substrate.demand import DemandBoard
from substrate.backends.local import LocalBackend
from substrate.directory import Directory
from substrate.errors import SubstrateError
from substrate.gctune import tune_after_startup
from substrate.loops import cancel_and_wait, run_forever, watch_lag
from substrate.metrics import EVENT_LOOP_LAG_SECONDS
from substrate.pool import PoolController
from substrate.quotas import Quotas
from substrate.settings import Settings
from substrate.specs import Catalog, load_catalog
from substrate.tokens import SigningKeyRing, TokenMinter
from substrate.workerclient import WorkerClient

log = logging.getLogger(__name__)


@dataclass
class Runtime:
    settings: Settings
    directory: Directory
    catalog: Catalog
    view: WorkerView
    client: WorkerClient
    activator: Activator
    http: aiohttp.ClientSession
    store: ObjectStore | None
    auth: Authenticator
    signing: SigningKeyRing
    quotas: Quotas
    audit: AuditLog
    routes: RouteCache = field(default_factory=RouteCache)
    #: the invoke hot path's client for plain-JSON turns (``api.workerhttp``); ``http`` serves the rest
    worker_http: WorkerHTTP = field(default_factory=WorkerHTTP)
    state_manager: StateManager | None = None
    pools: PoolController | None = None
    kube_catalog: Any = None
    #: this process's part in the deployment's config agreement (``substrate.catalogcheck``); None with
    #: a catalog from Kubernetes
    catalog_check: CatalogCheck | None = None
    _tasks: list[asyncio.Task[Any]] = field(default_factory=list)
    #: this process holds its snapshot store in the directory (``substrate.storeloc.hold``): let go at stop
    _holding_store: bool = False

    @property
    def lease_watch(self) -> LeaseWatch:
        """Calls in flight to workers, abandoned when a worker's lease runs out (``substrate.leasewatch``):
        the activator's, which the router's turns share (``api.proxy``)."""
        return self.activator.lease_watch

    @classmethod
    async def build(cls, settings: Settings, *, embedded: bool = True, catalog: Catalog | None = None) -> "Runtime":
        if not settings.redis.url:
            raise RuntimeError("SUBSTRATE_REDIS_URL is not set (substrate up starts an embedded Redis)")
        directory = Directory(settings.redis.url, settings.redis.key_prefix,
                              socket_timeout_s=settings.redis.socket_timeout_s)
        kube_catalog = None
        if catalog is None and settings.catalog_source == "kubernetes":
            from substrate.k8s.api import Kube, make_api_client
            from substrate.k8s.controller import KubeCatalog

            kube_catalog = KubeCatalog(Kube(make_api_client(settings)), settings.kubernetes.namespace)
            kube_catalog.start()
            if not await kube_catalog.wait_synced(30):
                log.warning("WorkerPools/ActorTemplates not listed yet from the API server")
            catalog = kube_catalog.catalog
        # the embedded default's workers run this interpreter: an entrypoint module it cannot find is refused
        # here (substrate.specs: not for a router, whose workers may run another image)
        catalog = catalog or load_catalog(settings.config_dir, check_modules=embedded)
        view = WorkerView(directory, settings.api.worker_refresh_s)
        signing = SigningKeyRing(directory.redis, directory.keys, refresh_s=settings.auth.signing_refresh_s,
                                 pepper=settings.worker.internal_token)
        client = WorkerClient(TokenMinter(signing, ttl_s=settings.auth.activation_token_ttl_s),
                              timeout_s=settings.api.invoke_timeout_s)
        quotas = Quotas(directory.redis, directory.keys, settings.quota, retry_after_s=settings.api.retry_after_s)
        audit = AuditLog(directory.redis, directory.keys, settings.audit)
        activator = Activator(settings, directory, catalog, client, view, quotas=quotas, audit=audit)
        if not embedded:  # routers and the controller are separate processes: they meet in Redis
            activator.board = DemandBoard(directory.redis, directory.keys,
                                          f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}",
                                          ttl_s=settings.pool.demand_ttl_s)
        http = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=None, keepalive_timeout=60),
            timeout=aiohttp.ClientTimeout(total=settings.api.invoke_timeout_s, sock_connect=2),
            auto_decompress=False, skip_auto_headers=("User-Agent",))
        store = GuardedStore(make_store(settings.snapshot), directory.redis, directory.keys, settings.snapshot)
        auth = Authenticator(settings, directory.redis, directory.keys, http,
                             closed_marker=(settings.data_dir / f"{AUTH_CLOSED_MARKER}-{settings.redis.key_prefix}"
                                            if embedded else None))
        rt = cls(settings, directory, catalog, view, client, activator, http, store, auth, signing, quotas, audit)
        rt.kube_catalog = kube_catalog
        if embedded:
            rt.state_manager = StateManager(settings, directory, catalog, activator, store)
            rt.pools = PoolController(settings, directory, catalog, LocalBackend(settings), activator)
        return rt

    async def start(self) -> None:
        self._tasks.append(asyncio.create_task(watch_lag(EVENT_LOOP_LAG_SECONDS.observe)))
        # the signing keys and the API keys come first: nothing can call a worker or be served before
        await self.signing.load()
        self._tasks.append(asyncio.create_task(run_forever(
            lambda: self.signing.load(create=False), self.signing.refresh_s, "signing key refresh",
            first_delay=True)))
        await self.auth.start()
        if not self.auth.enabled:
            egress = sorted(t.name for t in self.catalog.templates.values() if t.spec.isolation.network == "egress")
            if egress:
                # an egress agent shares this machine's network, so it can call this very API, which
                # asks no credentials in open mode: any session of these templates can act on every
                # session (fresh-user round 14: one deleted another session through the API)
                log.warning("open mode (no API keys) with templates whose agents have network egress (%s): their "
                            "agents can call this API on loopback and act on every session; create an API key "
                            "(substrate keys create) or use isolation.network none/loopback", ", ".join(egress))
        if self.pools is not None:  # the embedded default: one store for every pool (Kubernetes applies each
            # pool's snapshotStorage to its worker Pods; here it was ignored without a word: fresh-user round 18)
            for pool in self.catalog.pools.values():
                if pool.spec.snapshotStorage:
                    log.warning("WorkerPool %s: spec.snapshotStorage %s is applied on Kubernetes only; substrate up "
                                "keeps every session's snapshots in %s (SUBSTRATE_SNAPSHOT__*)", pool.name,
                                pool.spec.snapshotStorage, storeloc.location_of(self.settings.snapshot))
        if why := await storeloc.check(self.directory.redis, self.directory.keys, self.settings.snapshot,
                                       holding=True):
            raise RuntimeError(why)  # a configuration error: nothing has started (substrate/storeloc.py)
        self._holding_store = True
        self._tasks.append(asyncio.create_task(run_forever(
            self._hold_store, storeloc.HOLD_S / 3, "snapshot store hold", first_delay=True)))
        if self.kube_catalog is None:
            self.catalog_check = CatalogCheck(self.directory.redis, self.directory.keys, self.catalog)
            self._tasks.append(asyncio.create_task(run_forever(
                self.catalog_check.check, catalogcheck.PUBLISH_S, "catalog check")))
        if getattr(self.store, "ready", None) is not None:
            # in the background: a store that accepts connections but never answers held the API's start
            # for 90 s with nothing served (fresh-user round 21); every store call checks it anyway
            self._tasks.append(asyncio.create_task(self._check_store()))
        try:
            await self.view.refresh()
        except Exception:  # noqa: BLE001 - Redis may come later; /readyz says so
            log.warning("initial worker view failed", exc_info=True)
        self.view.start()
        if self.pools is not None:
            await self.pools.start()
        elif self.activator.board is not None:
            # a router: the pool controller runs elsewhere and must see what this process waits for
            self._tasks.append(asyncio.create_task(run_forever(
                self.activator.publish_demand, self.settings.pool.demand_publish_s, "demand publish")))
        if self.state_manager is not None:
            self.state_manager.start()
        tune_after_startup()  # the router's request path: see substrate/gctune.py

    async def _hold_store(self) -> None:
        """Renew this process's hold of its snapshot store (``substrate.storeloc.hold``)."""
        other = await storeloc.hold(self.directory.redis, self.directory.keys, self.settings.snapshot)
        if other is not None:  # it lapsed (Redis out for HOLD_S) and another store was started meanwhile
            log.warning("another runtime of this directory now runs with its snapshots in %s, not in this "
                        "runtime's %s: stop one of them", other.rpartition("#")[0],
                        storeloc.location_of(self.settings.snapshot))

    async def _check_store(self) -> None:
        """Check the snapshot store's marker once at start (``snapshot.guard``): in a new directory this
        makes the bucket (with ``snapshot.create_bucket``) and the marker; a fenced store has said why in
        the log already; an unreachable one is said here (suspends fail and are retried until it answers)."""
        try:
            await self.store.ready()  # type: ignore[attr-defined]
        except SubstrateError as e:  # the store's own error says what is wrong: one line, no traceback
            if (e.details or {}).get("reason") != "store_not_verified":
                log.warning("could not check the snapshot store: %s (suspends fail and are retried until the "
                            "store answers; check SUBSTRATE_SNAPSHOT__ENDPOINT_URL and its credentials)", e.message)
        except Exception:  # noqa: BLE001 - suspends fail (and retry) until the store is reachable
            log.warning("could not check the snapshot store", exc_info=True)

    async def wait_ready(self, timeout_s: float = 30.0) -> bool:
        """Wait until every pool has a READY worker (embedded mode)."""
        if self.pools is None:
            return True
        ok = await self.pools.wait_ready(timeout_s)
        await self.view.refresh()
        return ok

    async def stop(self) -> None:
        if self.state_manager is not None:
            await self.state_manager.stop()
        if self.pools is not None:
            await self.pools.stop()
        await self.view.stop()
        await self.auth.stop()
        await cancel_and_wait(self._tasks)
        if self._holding_store:  # a clean stop: another store may start on this directory at once
            try:
                await storeloc.release(self.directory.redis, self.directory.keys)
            except Exception:  # noqa: BLE001 - the hold lapses on its own after storeloc.HOLD_S
                log.warning("could not let go of the snapshot store hold", exc_info=True)
        if self.catalog_check is not None:
            try:
                await self.catalog_check.withdraw()
            except Exception:  # noqa: BLE001 - the entry goes stale and the next reader removes it
                log.info("could not withdraw this process's catalog fingerprint", exc_info=True)
        if self.kube_catalog is not None:
            self.kube_catalog.stop()
        await self.http.close()
        await self.worker_http.close()
        self.lease_watch.close()
        await self.client.close()
        await self.directory.close()

    async def snapshot_gc(self, sid: str, up_to_epoch: int | None = None) -> None:
        """Delete the snapshot objects of a deleted session up to its last epoch (object deletes only: no
        bytes pass; ``snapshot.commit.delete_session_objects`` says what is left alone and why)."""
        if self.store is None:
            return
        from snapshot.commit import delete_session_objects

        await delete_session_objects(self.store, self.settings.snapshot.prefix, sid, up_to_epoch=up_to_epoch)
