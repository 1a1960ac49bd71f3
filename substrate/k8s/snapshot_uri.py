"""``snapshotStorage`` URIs -> the snapshot store settings a worker gets as environment variables.

``s3://bucket/prefix`` selects the S3 store (endpoint, region and credentials from the controller's
settings: AWS S3, MinIO, Ceph, R2); ``gs://bucket/prefix`` selects Google Cloud Storage through its
S3-compatible XML API (``https://storage.googleapis.com``; HMAC keys as the access key pair). Anything
else is refused with ``ValueError`` naming the scheme; an unset value keeps the controller's store.
"""

from __future__ import annotations

from urllib.parse import urlparse

from substrate.settings import SnapshotSettings, bucket_name_problem

GCS_ENDPOINT = "https://storage.googleapis.com"


def parse_storage_uri(uri: str) -> tuple[str, str, str | None]:
    """``uri`` -> (scheme, bucket, prefix or None). Raises ``ValueError``."""
    u = urlparse(uri)
    if u.scheme not in ("s3", "gs"):
        raise ValueError(f"snapshotStorage {uri!r}: use s3://bucket/prefix or gs://bucket/prefix")
    if not u.netloc:
        raise ValueError(f"snapshotStorage {uri!r} names no bucket")
    if why := bucket_name_problem(u.netloc):  # else every worker of the pool would refuse to start
        raise ValueError(f"snapshotStorage {uri!r}: {why}")
    prefix = u.path.strip("/") or None
    return u.scheme, u.netloc, prefix


def store_env(uri: str | None, base: SnapshotSettings) -> dict[str, str]:
    """Environment (``SUBSTRATE_SNAPSHOT__*``) for a worker whose pool says ``uri``. Secrets (keys) are
    not included: they come from the ``substrate-s3`` Secret the pod template mounts as env."""
    env: dict[str, str] = {}
    if uri:
        scheme, bucket, prefix = parse_storage_uri(uri)
        env["SUBSTRATE_SNAPSHOT__STORE"] = "s3"
        env["SUBSTRATE_SNAPSHOT__BUCKET"] = bucket
        if prefix:
            env["SUBSTRATE_SNAPSHOT__PREFIX"] = prefix
        endpoint = GCS_ENDPOINT if scheme == "gs" else base.endpoint_url
        if endpoint:
            env["SUBSTRATE_SNAPSHOT__ENDPOINT_URL"] = endpoint
        if base.region:
            env["SUBSTRATE_SNAPSHOT__REGION"] = base.region
        return env
    env["SUBSTRATE_SNAPSHOT__STORE"] = base.store
    if base.store == "local":
        env["SUBSTRATE_SNAPSHOT__LOCAL_DIR"] = str(base.local_dir)
    else:
        env["SUBSTRATE_SNAPSHOT__BUCKET"] = base.bucket
        env["SUBSTRATE_SNAPSHOT__PREFIX"] = base.prefix
        if base.endpoint_url:
            env["SUBSTRATE_SNAPSHOT__ENDPOINT_URL"] = base.endpoint_url
        if base.region:
            env["SUBSTRATE_SNAPSHOT__REGION"] = base.region
    return env
