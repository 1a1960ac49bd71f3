"""``make bench``'s repair rows (loadtest/bench_repair.py) measure a real pass over the records they made,
and leave nothing behind in Redis."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis

from loadtest import bench_repair


async def test_the_repair_rows_measure_a_pass_over_the_sessions_made_and_clean_up(redis_url, monkeypatch):
    read: list[int] = []  # sessions each page of each pass read
    real = bench_repair.Directory.session_summaries

    async def counting(self, **kw):
        page, nxt = await real(self, **kw)
        read.append(len(page))
        return page, nxt

    monkeypatch.setattr(bench_repair.Directory, "session_summaries", counting)
    rows = await bench_repair.bench_repair(redis_url, sessions=300, passes=2)
    assert sum(read) == 2 * 300, "each of the 2 passes read every record made"
    by = {r["case"].rsplit(": ", 1)[1]: r for r in rows}
    assert by["wall ms"]["value"] > 0 and by["CPU ms of the state manager's process"]["value"] > 0
    assert all("300 sessions" in r["case"] for r in rows)
    r = aioredis.from_url(redis_url)
    try:
        assert [k async for k in r.scan_iter("bench-repair-*")] == [], "its records are deleted"
    finally:
        await r.aclose()


async def test_nonsense_sizes_are_refused(redis_url):
    with pytest.raises(ValueError):
        await bench_repair.bench_repair(redis_url, sessions=0)


def test_the_command_refuses_nonsense_sizes_before_starting_anything(capsys):
    with pytest.raises(SystemExit) as e:
        bench_repair.main(["--sessions", "0"])
    assert e.value.code == 2 and "--sessions and --passes must be at least 1" in capsys.readouterr().err
