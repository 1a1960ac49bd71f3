"""S3 fixtures: a real moto S3 server on 127.0.0.1 (HTTP over loopback), shared by the whole session.

A plain fixture module: register it from the root conftest (``pytest_plugins = ["tests.integration.conftest_s3"]``
or ``from tests.integration.conftest_s3 import moto_server, s3_store``).

* ``moto_server`` (session scope) -> the endpoint URL, e.g. ``http://127.0.0.1:41234``.
* ``s3_store`` -> a fresh ``S3Store`` on a fresh, already created bucket (closed after the test).
* ``s3_store_factory`` -> ``make(**S3Store_kwargs)`` for stores with other settings on fresh buckets.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable, Iterator

import logging

import pytest

from snapshot.store import S3Store

S3_TEST_CREDENTIALS = {"access_key_id": "testing", "secret_access_key": "testing", "region": "us-east-1"}


@pytest.fixture(scope="session")
def moto_server() -> Iterator[str]:
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one access-log line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


@pytest.fixture
async def s3_store_factory(moto_server: str) -> AsyncIterator[Callable[..., S3Store]]:
    made: list[S3Store] = []

    def make(**kwargs: object) -> S3Store:
        params: dict = {"endpoint_url": moto_server, **S3_TEST_CREDENTIALS, **kwargs}
        store = S3Store(f"test-{uuid.uuid4().hex[:12]}", **params)
        made.append(store)
        return store

    yield make
    for store in made:
        store.close()


@pytest.fixture
async def s3_store(s3_store_factory: Callable[..., S3Store]) -> S3Store:
    store = s3_store_factory()
    await store.ensure_bucket()
    return store
