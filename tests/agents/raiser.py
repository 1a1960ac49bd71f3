"""A test agent (entrypoint) whose code raises: a turn of ``"boom"``, and its snapshot once armed with
``"arm"`` (or returns a list, once armed with ``"list"``). Every other turn counts up, so a test sees whether its state survived the exception."""

from __future__ import annotations

from typing import Any


class Raiser:
    def __init__(self, ctx: Any) -> None:
        self.count = 0
        self.armed = False

    async def start(self, state: dict[str, Any] | None) -> None:
        self.count = int((state or {}).get("count", 0))

    async def invoke(self, input: Any) -> Any:  # noqa: A002
        if input == "boom":
            raise RuntimeError("boom")
        if input in ("arm", "list"):
            self.armed = input
        self.count += 1
        return {"count": self.count}

    async def snapshot(self) -> dict[str, Any]:
        if self.armed == "list":
            return [1, 2]  # type: ignore[return-value]  # JSON, but not an object
        if self.armed:
            raise RuntimeError("snap fail")
        return {"count": self.count}

    async def stop(self) -> None:
        return None
