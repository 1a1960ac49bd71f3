"""Fixtures shared by the integration tests."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest

from substrate.directory import Directory


@pytest.fixture
async def directory(redis_url: str) -> AsyncIterator[Directory]:
    """A ``Directory`` on the test Redis under a fresh key prefix; its keys are removed afterwards."""
    d = Directory(redis_url, f"it{uuid.uuid4().hex[:8]}")
    yield d
    async for key in d.redis.scan_iter(f"{d.keys.prefix}:*"):
        await d.redis.delete(key)
    await d.close()
