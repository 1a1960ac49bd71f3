"""``substrate controller``: the pool controller and the state manager of a Kubernetes deployment.

Every replica runs a leader election on a Lease (``substrate.k8s.leader``); only the leader watches
WorkerPools/ActorTemplates/Pods and runs the pool controller (``substrate.k8s.controller``) and the state
manager. Standbys wait and take over within the lease duration. A leader that loses its lease exits
(code 3) so that its Deployment restarts it as a standby: no two controllers ever act at once. On SIGTERM
the leader stops its loops (worker Pods keep serving) and releases the lease so a standby takes over at once.
Serves ``/healthz``, ``/readyz`` and ``/metrics`` (global gauges) on ``--host``/``--port``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from api.runtime import Runtime
from snapshot.state_manager import StateManager
from substrate.backends.kubernetes import KubernetesBackend
from substrate.k8s.api import Kube, make_api_client
from substrate.k8s.controller import KubeCatalog, KubePoolController
from substrate.k8s.leader import LeaderElector
from substrate.settings import Settings

log = logging.getLogger("substrate.controller")


async def _serve_probes(host: str, port: int, elector: LeaderElector) -> web.AppRunner:
    async def healthz(_: web.Request) -> web.Response:
        return web.json_response({"ok": True, "leader": elector.is_leader, "identity": elector.identity})

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=generate_latest(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", healthz)
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner


async def run(settings: Settings, host: str, port: int, identity: str | None = None) -> int:
    """Run until SIGTERM/SIGINT (0) or until leadership is lost (3)."""
    k = settings.kubernetes
    kube = Kube(make_api_client(settings))
    identity = identity or f"{socket.gethostname()}-{os.getpid()}"
    elector = LeaderElector(kube, k.namespace, k.lease_name, identity, duration_s=k.lease_duration_s,
                            renew_s=k.lease_renew_s)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    probes = await _serve_probes(host, port, elector)
    el_task = asyncio.create_task(elector.run())
    log.warning("controller started; waiting for the lease", extra={"identity": identity})
    waits = [asyncio.create_task(elector.became_leader.wait()), asyncio.create_task(stop.wait())]
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    rt = None
    code = 0
    try:
        if stop.is_set():
            return 0
        kcat = KubeCatalog(kube, k.namespace)
        kcat.start()
        await kcat.wait_synced(30)
        backend = KubernetesBackend(settings, kube)  # its Pod watch starts with the pool controller
        rt = await Runtime.build(settings, embedded=False, catalog=kcat.catalog)
        rt.kube_catalog = kcat
        rt.state_manager = StateManager(settings, rt.directory, rt.catalog, rt.activator, rt.store)
        # routers are other processes: their waiting placements and our starting workers meet in Redis
        rt.pools = KubePoolController(settings, rt.directory, kcat, backend, rt.activator, board=rt.activator.board)
        wanted = getattr(rt.activator, "capacity_wanted", None)
        if wanted is not None:  # a spec or Pod change reconciles at once, not on the next timer tick
            for inf in (kcat.pools, kcat.templates, backend.pods):
                inf.add_listener(wanted.set)
        await rt.start()
        log.warning("leading: pool controller and state manager running", extra={"identity": identity})
        lost = asyncio.create_task(elector.lost_leadership.wait())
        stopped = asyncio.create_task(stop.wait())
        await asyncio.wait([lost, stopped], return_when=asyncio.FIRST_COMPLETED)
        code = 3 if elector.lost_leadership.is_set() else 0
    finally:
        el_task.cancel()
        if rt is not None:
            await rt.stop()
        if elector.is_leader and code == 0:
            try:
                await asyncio.to_thread(elector.release)
            except Exception:  # noqa: BLE001 - the lease then expires on its own
                log.warning("lease release failed", exc_info=True)
        await probes.cleanup()
    return code


def main(host: str, port: int) -> int:
    from substrate.logs import configure_logging
    from substrate.settings import get_settings

    settings = get_settings()
    configure_logging(settings.log_level, settings.log_json)
    if why := store_warning(settings):
        log.warning(why)
    # kustomize's `images:` does not rewrite the env value this comes from (fresh-user round 13): said
    log.warning("worker image for pools whose pod template names none: %s (SUBSTRATE_KUBERNETES__WORKER_IMAGE)",
                settings.kubernetes.worker_image)
    return asyncio.run(run(settings, host, port))


def store_warning(settings: Any) -> str | None:
    """The warning the controller logs at start when snapshots would stay on each worker Pod's own disk
    (``snapshot.store`` local: ``deploy/overlays/external-redis`` alone sets no store, fresh-user round 13),
    or None."""
    if settings.snapshot.store != "local":
        return None
    return ("snapshots go to each worker Pod's own disk (SUBSTRATE_SNAPSHOT__STORE=local): another worker cannot "
            "restore them and they are lost with the Pod; set SUBSTRATE_SNAPSHOT__STORE=s3 and its bucket "
            "(deploy/overlays/s3) on a cluster")
