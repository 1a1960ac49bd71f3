"""Talking to the API server: client construction, a list+watch cache (informer), thin verbs.

We use the official synchronous ``kubernetes`` client in threads rather than ``kubernetes_asyncio``:
it is the dependency the project already locks, its models and ``watch`` helper are the reference
implementation, and the controller makes few calls (per worker, never per session: DESIGN invariant 4),
so a thread per watch and ``asyncio.to_thread`` per call cost nothing that matters. Watches run in daemon
threads that keep a dict cache per resource and wake the asyncio side with ``call_soon_threadsafe``.

API errors are translated: ``KubeError(status, reason, message)`` from ``ApiException``.

An API server that cannot be reached is said in one warning line without a traceback (``unreachable`` /
``ApiReachability``): the first time, then at most once a minute while it lasts, and once when it answers
again. The client makes no retries of its own (urllib3's three retries each logged a "Retrying" warning
per call): every caller is a loop that tries again anyway. A watch that ends the normal way (its timeout,
the server closing the stream) is logged at debug; a traceback is kept for unexpected errors only.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from substrate.settings import Settings

log = logging.getLogger(__name__)

GROUP = "substrate.agent.dev"
VERSION = "v1"


class KubeError(Exception):
    """An API call failed: ``status`` (HTTP), ``reason``, ``message``."""

    def __init__(self, status: int, reason: str, message: str = "") -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message


def _translate(e: Exception) -> Exception:
    from kubernetes.client.exceptions import ApiException

    if isinstance(e, ApiException):
        return KubeError(int(e.status or 0), str(e.reason or ""), str(e.body or "")[:500])
    return e


def make_api_client(settings: Settings) -> Any:
    """An ``ApiClient``: ``kubernetes.api_url`` if set (tests, ``kubectl proxy``), else in-cluster
    service-account config, else ``~/.kube/config``."""
    from kubernetes import client, config

    url = settings.kubernetes.api_url
    if url:
        cfg = client.Configuration()
        cfg.host = url.rstrip("/")
    else:
        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        cfg = client.Configuration.get_default_copy()
    # no urllib3 retries: each one logged a "Retrying" warning, and every caller retries in its own loop
    cfg.retries = 0
    return client.ApiClient(cfg)


#: how often (seconds) an API server that stays unreachable is said again
UNREACHABLE_REPEAT_S = 60.0


def unreachable(e: BaseException) -> str | None:
    """The reason, if ``e`` means the API server could not be reached (refused, DNS, connect timeout, no
    route), as one short phrase (``Connection refused``); None for any other error."""
    import urllib3.exceptions as u3

    cause: BaseException | None = e.reason if isinstance(e, u3.MaxRetryError) and e.reason is not None else e
    if isinstance(cause, u3.NewConnectionError):
        text = str(cause.args[-1]) if cause.args else str(cause)
        # "<HTTPConnection object at 0x..>: Failed to establish a new connection: [Errno 111] Connection refused"
        return text.rpartition("] ")[2] or text
    if isinstance(cause, (u3.ConnectTimeoutError, u3.NameResolutionError)):
        return str(cause.args[-1] if cause.args else cause).rpartition(": ")[2] or type(cause).__name__
    if isinstance(cause, (ConnectionRefusedError, ConnectionResetError)) or (
            isinstance(cause, u3.ProtocolError) and isinstance(cause.args[-1] if cause.args else None,
                                                               ConnectionRefusedError)):
        return "Connection refused"
    return None


class ApiReachability:
    """Says that the API server at ``url`` cannot be reached in one warning line (no traceback): the first
    time, then at most every ``repeat_s`` while it lasts; and once when it answers again. Shared by the
    lease and every watch of a process (``REACHABILITY``), so they do not each say it."""

    def __init__(self, repeat_s: float = UNREACHABLE_REPEAT_S) -> None:
        self.repeat_s = repeat_s
        self._lock = threading.Lock()
        self._since: float | None = None
        self._said = 0.0

    def failed(self, url: str, reason: str, retry_s: float) -> None:
        """Record one failed attempt; logs when it is the first or ``repeat_s`` passed since the last line."""
        now = time.monotonic()
        with self._lock:
            first = self._since is None
            if first:
                self._since = now
            elif now - self._said < self.repeat_s:
                return
            self._said = now
            since = now - (self._since or now)
        more = "" if first else f" (for {since:.0f} s)"
        log.warning(f"cannot reach the Kubernetes API at {url}: {reason}; retrying every {retry_s:g} s{more}")

    def ok(self, url: str) -> None:
        """Record a successful call; says so once if the server was unreachable."""
        with self._lock:
            was = self._since
            self._since = None
        if was is not None:
            log.warning(f"the Kubernetes API at {url} answers again")


REACHABILITY = ApiReachability()


def config_problem(settings: Settings) -> str | None:
    """Why :func:`make_api_client` cannot reach any Kubernetes API configuration, or None: not in a
    cluster (no service account), no kubeconfig, and ``kubernetes.api_url`` unset; or an ``api_url`` that
    is not an http(s) URL. Reads files only, never calls the API (an API server that is down is waited
    for, as in a rollout). ``substrate router`` and ``substrate controller`` say it in one line and
    exit 2 (they printed a 149-line traceback: fresh-user round 13)."""
    url = settings.kubernetes.api_url
    if url:
        return None if url.startswith(("http://", "https://")) else \
            f"SUBSTRATE_KUBERNETES__API_URL={url!r} is not an http(s) URL"
    from kubernetes import config

    try:
        make_api_client(settings)
    except (config.ConfigException, OSError, ValueError) as e:
        return ("no Kubernetes API configured: not in a cluster (no service account), no usable kubeconfig "
                f"(KUBECONFIG or ~/.kube/config: {str(e).strip()[:200]}), and SUBSTRATE_KUBERNETES__API_URL unset")
    return None


class Kube:
    """The verbs the runtime uses, each one call (blocking; wrap in ``asyncio.to_thread``)."""

    def __init__(self, api_client: Any) -> None:
        from kubernetes import client

        self.api_client = api_client
        self.core = client.CoreV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)
        self.coordination = client.CoordinationV1Api(api_client)
        self.resource = client.ResourceV1Api(api_client)

    @property
    def url(self) -> str:
        """The API server's URL (for log lines)."""
        return str(getattr(self.api_client.configuration, "host", "") or "")

    def raw(self, obj: Any) -> dict[str, Any]:
        """A client model as the API's JSON dict (camelCase)."""
        return obj if isinstance(obj, dict) else self.api_client.sanitize_for_serialization(obj)

    def call(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        try:
            return fn(*args, **kw)
        except Exception as e:  # noqa: BLE001 - translated, re-raised
            raise _translate(e) from e

    # pods
    def create_pod(self, ns: str, body: dict[str, Any]) -> dict[str, Any]:
        return self.raw(self.call(self.core.create_namespaced_pod, ns, body))

    def delete_pod(self, ns: str, name: str, grace_s: int | None = None) -> None:
        try:
            self.call(self.core.delete_namespaced_pod, name, ns, grace_period_seconds=grace_s)
        except KubeError as e:
            if e.status != 404:
                raise

    # custom resources
    def patch_pool(self, ns: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
        return self.call(self.custom.patch_namespaced_custom_object, GROUP, VERSION, ns, "workerpools", name, body)

    def patch_pool_status(self, ns: str, name: str, status: dict[str, Any]) -> dict[str, Any]:
        return self.call(self.custom.patch_namespaced_custom_object_status, GROUP, VERSION, ns, "workerpools",
                         name, {"status": status})

    def patch_template_status(self, ns: str, name: str, status: dict[str, Any]) -> dict[str, Any]:
        """Merge-patch an ActorTemplate's status subresource (its ``Valid`` condition)."""
        return self.call(self.custom.patch_namespaced_custom_object_status, GROUP, VERSION, ns, "actortemplates",
                         name, {"status": status})

    def create_object(self, body: dict[str, Any], plural: str) -> dict[str, Any]:
        """Create a namespaced object of a named API group (ResourceClaimTemplate, PodGroup, HPA) through
        the generic path ``/apis/{group}/{version}/namespaces/{ns}/{plural}``; an existing one is kept."""
        group, _, version = body["apiVersion"].rpartition("/")
        try:
            return self.call(self.custom.create_namespaced_custom_object, group, version,
                             body["metadata"]["namespace"], plural, body)
        except KubeError as e:
            if e.status == 409:
                return body
            raise

    def patch_object(self, api_version: str, plural: str, ns: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
        """Merge-patch a namespaced object of a named API group (e.g. a PodGroup's ``minCount``).
        Raises ``KubeError`` (404 when it does not exist)."""
        group, _, version = api_version.rpartition("/")
        return self.call(self.custom.patch_namespaced_custom_object, group, version, ns, plural, name, body)

    # leases
    def get_lease(self, ns: str, name: str) -> dict[str, Any] | None:
        try:
            return self.raw(self.call(self.coordination.read_namespaced_lease, name, ns))
        except KubeError as e:
            if e.status == 404:
                return None
            raise

    def create_lease(self, ns: str, body: dict[str, Any]) -> dict[str, Any]:
        return self.raw(self.call(self.coordination.create_namespaced_lease, ns, body))

    def patch_lease(self, ns: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
        return self.raw(self.call(self.coordination.patch_namespaced_lease, name, ns, body))


class Informer:
    """A list+watch cache of one resource in one namespace, in a daemon thread.

    ``items`` maps name -> the object's JSON dict. ``on_change`` is called (from the thread, through
    ``loop.call_soon_threadsafe``) after every change. Survives any error: relists after a back-off, and
    after ``410 Gone`` at once.
    """

    def __init__(self, kube: Kube, list_fn: Callable[..., Any], namespace: str, *, label_selector: str | None = None,
                 name: str = "", watch_timeout_s: int = 30) -> None:
        self.kube = kube
        self.list_fn = list_fn
        self.namespace = namespace
        self.label_selector = label_selector
        self.name = name or getattr(list_fn, "__name__", "informer")
        self.watch_timeout_s = watch_timeout_s
        self.items: dict[str, dict[str, Any]] = {}
        self.synced = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._listeners: list[Callable[[], None]] = []
        self._watch: Any = None

    def add_listener(self, fn: Callable[[], None]) -> None:
        self._listeners.append(fn)

    def start(self) -> None:
        try:
            self._loop = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None
        self._thread = threading.Thread(target=self._run, name=f"informer-{self.name}", daemon=True)
        self._thread.start()

    async def wait_synced(self, timeout_s: float) -> bool:
        return await asyncio.to_thread(self.synced.wait, timeout_s)

    def stop(self) -> None:
        self._stop.set()
        if self._watch is not None:
            self._watch.stop()

    def _notify(self) -> None:
        for fn in self._listeners:
            if self._loop is not None and not self._loop.is_closed():
                try:
                    self._loop.call_soon_threadsafe(fn)
                except RuntimeError:
                    pass
            else:
                fn()

    def _kw(self) -> dict[str, Any]:
        return {"label_selector": self.label_selector} if self.label_selector else {}

    def _run(self) -> None:
        from kubernetes import watch

        backoff = 0.2
        while not self._stop.is_set():
            try:
                listing = self.kube.raw(self.list_fn(self.namespace, **self._kw()))
                self.items = {o["metadata"]["name"]: o for o in listing.get("items") or []}
                rv = (listing.get("metadata") or {}).get("resourceVersion")
                REACHABILITY.ok(self.kube.url)
                self.synced.set()
                self._notify()
                w = watch.Watch()
                self._watch = w
                kw = self._kw()
                if rv:
                    kw["resource_version"] = rv
                for ev in w.stream(self.list_fn, self.namespace, timeout_seconds=self.watch_timeout_s,
                                   _request_timeout=(5, self.watch_timeout_s + 5), **kw):
                    if self._stop.is_set():
                        break
                    obj = self.kube.raw(ev["object"])
                    if ev["type"] == "ERROR":
                        if (obj or {}).get("code") == 410:
                            break  # Gone: relist
                        continue
                    name = obj["metadata"]["name"]
                    if ev["type"] == "DELETED":
                        self.items.pop(name, None)
                    else:
                        self.items[name] = obj
                    self._notify()
                backoff = 0.2
            except Exception as e:  # noqa: BLE001 - a watch never dies: relist after a back-off
                if self._stop.is_set():
                    return
                why = unreachable(e)
                if why is not None:
                    REACHABILITY.failed(self.kube.url, why, 5.0)
                elif _normal_watch_end(e):
                    log.debug("watch restarted", extra={"informer": self.name, "error": str(e)[:200]})
                else:
                    log.info("watch restarted", extra={"informer": self.name}, exc_info=True)
                time.sleep(backoff)
                backoff = min(backoff * 2, 5.0)


def _normal_watch_end(e: BaseException) -> bool:
    """A watch that ended the way watches end: the read timed out, the server closed the stream (an
    apiserver ends each watch after its timeout), or ``410 Gone`` (the resourceVersion expired)."""
    import urllib3.exceptions as u3

    if isinstance(e, (u3.ReadTimeoutError, u3.ProtocolError, u3.IncompleteRead, TimeoutError)):
        return True
    status = getattr(e, "status", None)
    return status == 410
