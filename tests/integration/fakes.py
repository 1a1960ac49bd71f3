"""In-memory fakes shared by the integration tests."""

from __future__ import annotations


class RecordingBackend:
    """A pool controller's backend that only records the workers it was asked to create; ``running``
    reports them, plus ``also_running`` (workers of pool ``default`` started elsewhere), as running."""

    def __init__(self, also_running: tuple[str, ...] = ()) -> None:
        self.created: list[str] = []
        self.also_running = also_running

    async def create(self, pool, worker_id):
        self.created.append(worker_id)

    async def delete(self, worker_id):
        pass

    def running(self):
        return {w: "default" for w in (*self.also_running, *self.created)}

    def reap(self):
        return []

    async def close(self):
        pass
