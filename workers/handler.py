"""The interface agents implement, and how a template's handler is found.

Agents run in their session's sandboxed agent host (``workers/agenthost.py``), never in the worker.

An agent is a class constructed with a ``SessionContext``; the worker calls, in order,
``start(state)`` once per activation (``state`` is what ``snapshot()`` returned before the session was
suspended, or ``None`` for a new session), then ``invoke(input)`` or ``stream(input)`` once per turn
(never two turns of one session at once), ``snapshot()`` whenever the runtime takes a snapshot, and
``stop()`` when the activation ends. Files the agent keeps in ``ctx.workspace`` are snapshotted too.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator


@dataclass
class SessionContext:
    """What an agent knows about its activation. ``workspace`` is its own directory (created)."""

    session_id: str
    epoch: int
    template: str
    workspace: Path
    env: dict[str, str] = field(default_factory=dict)
    #: whether the agent runs inside its per-session sandbox (own PID namespace: every other process
    #: it sees is its own), and the template's limits (``turnTimeoutS``, ``memoryBytes``, ``diskBytes``)
    sandboxed: bool = False
    limits: dict[str, Any] = field(default_factory=dict)


class Agent:
    """Base class for Python agents (``spec.entrypoint: module:Class``). Override what you need."""

    def __init__(self, ctx: SessionContext) -> None:
        self.ctx = ctx

    async def start(self, state: dict[str, Any] | None) -> None:
        """Restore from ``state`` (None for a new session)."""

    async def invoke(self, input: Any) -> Any:  # noqa: A002 - the API's word
        """Run one turn and return a JSON-serialisable output."""
        raise NotImplementedError

    async def stream(self, input: Any) -> AsyncIterator[Any]:  # noqa: A002
        """Run one turn, yielding JSON-serialisable chunks. Default: one chunk, ``invoke``'s output."""
        yield await self.invoke(input)

    async def snapshot(self) -> dict[str, Any]:
        """The agent's state as a JSON-serialisable dict (besides the workspace files)."""
        return {}

    async def stop(self) -> None:
        """Release resources; the activation is ending (suspend, delete, or worker shutdown)."""


class AgentError(Exception):
    """Raised by an agent for a failed turn; the API answers 422 ``agent_error`` with the message."""


class StateLoadFailed(Exception):
    """Raised by ``start(state)`` when the restored state itself cannot be loaded (the agent's own data is
    unusable, not a failure of the moment): the wake answers 422 ``state_load_failed`` and the session
    goes to FAILED keeping its snapshot; it does not count against the tenant's circuit breaker.

    ``exception_type``: the name of what the load raised (or how it ended, e.g. ``exit status 3``), shown
    to the user. Raise it only on a positive sign that the state is at fault: an error of the moment
    (a timeout, a kill from outside) must stay an ordinary exception, or a good snapshot is set aside."""

    def __init__(self, message: str, exception_type: str) -> None:
        super().__init__(message)
        self.exception_type = exception_type


class StateTooLarge(Exception):
    """Raised by ``snapshot()`` when the state cannot be written within the session's limits; the
    message names the limit. The suspend (or snapshot) answers 422 ``state_too_large`` and the session
    stays RUNNING with all its state."""


def load_agent_class(entrypoint: str) -> type[Agent]:
    """Import ``package.module:Class``. Raises ``ImportError``/``AttributeError`` with the name."""
    module_name, _, attr = entrypoint.partition(":")
    module = importlib.import_module(module_name)
    cls = getattr(module, attr)
    if not isinstance(cls, type):
        raise TypeError(f"{entrypoint} is not a class")
    return cls
