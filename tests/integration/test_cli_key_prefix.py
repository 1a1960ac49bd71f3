"""Fresh-user run: ``substrate keys create`` without the runtime's ``SUBSTRATE_REDIS__KEY_PREFIX`` made the
key under the default prefix and said so as a success, while the runtime (another prefix) stayed in open
mode. A key command now warns when no runtime runs under its prefix and runtimes run under others."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import redis
import redis.asyncio as aioredis
from typer.testing import CliRunner

from substrate import storeloc
from substrate.cli import app
from substrate.keys import Keys
from substrate.settings import SnapshotSettings


def test_a_key_command_under_a_prefix_no_runtime_uses_says_which_prefixes_run(redis_url: str,
                                                                            tmp_path: Path) -> None:
    running, other = f"run{uuid.uuid4().hex[:8]}", f"oth{uuid.uuid4().hex[:8]}"

    async def hold() -> str | None:
        r = aioredis.from_url(redis_url, decode_responses=True)
        try:
            return await storeloc.hold(r, Keys(running), SnapshotSettings(store="local", local_dir=tmp_path))
        finally:
            await r.aclose()

    sync = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        assert asyncio.run(hold()) is None  # a runtime runs under `running`
        env = {"SUBSTRATE_REDIS_URL": redis_url, "SUBSTRATE_DATA_DIR": str(tmp_path / "data")}
        res = CliRunner().invoke(app, ["keys", "list"], env={**env, "SUBSTRATE_REDIS__KEY_PREFIX": other})
        assert res.exit_code == 0, res.output
        assert f"no runtime runs on this Redis with key prefix '{other}'" in res.output
        assert repr(running) in res.output
        res = CliRunner().invoke(app, ["keys", "list"], env={**env, "SUBSTRATE_REDIS__KEY_PREFIX": running})
        assert res.exit_code == 0 and "no runtime runs" not in res.output, res.output
    finally:
        sync.delete(Keys(running).snapshot_location_holders)
        for key in sync.scan_iter(f"{other}:*"):
            sync.delete(key)
        sync.close()


def test_keys_list_from_redis_as_json(redis_url: str, tmp_path: Path) -> None:
    """``keys list -o json`` (fresh-user tester 52): the keys in Redis as a JSON list, never the keys."""
    import json

    prefix = f"kj{uuid.uuid4().hex[:8]}"
    env = {"SUBSTRATE_REDIS_URL": redis_url, "SUBSTRATE_DATA_DIR": str(tmp_path / "data"),
           "SUBSTRATE_REDIS__KEY_PREFIX": prefix}
    sync = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        made = CliRunner().invoke(app, ["keys", "create", "team-a", "--name", "ci"], env=env)
        assert made.exit_code == 0, made.output
        key = made.stdout.strip().splitlines()[-1]
        res = CliRunner().invoke(app, ["keys", "list", "-o", "json"], env=env)
        assert res.exit_code == 0, res.output
        rows = json.loads(res.stdout.strip().splitlines()[-1])
        assert [(r["tenant"], r["admin"], r["name"]) for r in rows] == [("team-a", False, "ci")]
        assert isinstance(rows[0]["createdAt"], float) and key not in res.stdout
    finally:
        for k in sync.scan_iter(f"{prefix}:*"):
            sync.delete(k)
        sync.close()
