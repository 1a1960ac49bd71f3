"""The invoke hot path's entry: ``POST /v1/sessions/{sid}/invoke`` dispatched ahead of FastAPI's own stack.

A profile of a saturated router (``docs/bench/router-profile-2026-12-01.md``, and again on 2026-12-04)
put about a seventh of its CPU in layers a turn does not need: FastAPI's body-limit and telemetry
wrappers, Starlette's ``ExceptionMiddleware`` (wrapping ``send``),
FastAPI's ``AsyncExitStackMiddleware``, the router's route matching and ``request_response``'s
exception wrapper (one more ``send`` wrapper). :class:`SubstrateAPI` takes a turn before all of them
and runs it through exactly what it needs:

* the same front door as every ``/v1`` call (:class:`api.guard.Guard`: origin and host checks, bearer
  or API-key authentication, query names, encoded slashes, the body limit and read deadline, the
  graceful stop's 503) and the same :class:`api.app.RequestCounter` (the requests metric with the
  route's template as label, ``X-Request-ID`` on every answer): the same classes with the same
  settings, in the same order;
* :func:`api.proxy.invoke`, unchanged, which answers every ``SubstrateError`` itself;
* the app's own answer to an unexpected error (500 ``internal``, JSON, counted; the error is then
  raised again so the server logs its traceback), as on every other route: there Starlette's
  ``ServerErrorMiddleware`` gives it, here the request counter itself (``RequestCounter(on_error=...)``,
  one middleware and one ``send`` wrapper fewer per turn).

Anything else (another method, another path, a ``root_path`` mount, lifespan) goes to FastAPI as
before, and the route stays registered there, so the OpenAPI document and a 405's ``Allow`` header are
unchanged. DESIGN.md asks for exactly this split ("Serve the invoke/proxy path with a thin Starlette/ASGI
route; FastAPI for the rest of the API"); before, the thin route still sat behind FastAPI's whole stack.
"""

from __future__ import annotations

import re
from typing import Any, Awaitable, Callable

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

#: the invoke route's template, as registered with FastAPI and used as the metric's ``route`` label
INVOKE_PATH = "/v1/sessions/{sid}/invoke"
#: the same template as Starlette matches it: a path parameter is one segment, ``[^/]+``
_INVOKE_RE = re.compile(r"/v1/sessions/([^/]+)/invoke")


def endpoint(handler: Callable[[Request], Awaitable[Response]]) -> ASGIApp:
    """An ASGI app running ``handler``, a Starlette endpoint (request -> response), without Starlette's
    router and its exception wrappers: what ``handler`` raises goes up to the caller (the hot path's
    request counter answers it, see the module docstring)."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        response = await handler(Request(scope, receive, send))
        await response(scope, receive, send)

    return app


def runtime_of(app: Any) -> Any:
    """The app's runtime (``api.runtime.Runtime``): its ``runtime`` attribute, which the lifespan sets and
    the hot path reads on every call (``app.state.runtime`` goes through Starlette's ``State.__getattr__``),
    else ``app.state.runtime`` (what a test sets), else None."""
    rt = getattr(app, "runtime", None)
    return rt if rt is not None else getattr(getattr(app, "state", None), "runtime", None)


class SubstrateAPI(FastAPI):
    """FastAPI whose invoke route is dispatched ahead of its middleware stack (module docstring).

    ``hot_path`` is the ASGI app that serves ``POST /v1/sessions/{sid}/invoke`` (set by
    ``api.app.create_app``: ``RequestCounter(Guard(endpoint(proxy.invoke)), on_error=...)``);
    while it is None,
    every request takes FastAPI's way. ``invoke_route`` is the registered route, put in the scope as
    Starlette's router would, so the request counter labels the call with its template."""

    hot_path: ASGIApp | None = None
    invoke_route: Route | None = None
    #: the runtime, set by the lifespan next to ``state.runtime`` (``runtime_of``)
    runtime: Any = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        hot = self.hot_path
        if (hot is not None and scope["type"] == "http" and scope["method"] == "POST" and not self.root_path
                and not scope.get("root_path")):
            m = _INVOKE_RE.fullmatch(scope["path"])
            if m is not None:
                scope["app"] = self
                scope["path_params"] = {"sid": m.group(1)}
                scope["route"] = self.invoke_route
                await hot(scope, receive, send)
                return
        await super().__call__(scope, receive, send)
