"""``snapshot.bench.bench_resume``: the stores it compares are measured in alternation (measured one
after the other, the second one paid for the machine state the first left: docs/bench/2026-12-03-local-vs-s3.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from snapshot.bench import bench_resume
from snapshot.store import LocalDirStore


class Recording(LocalDirStore):
    """A local store that logs its puts and reads into a shared list, as ``(op, name)``."""

    def __init__(self, root: Path, name: str, log: list[tuple[str, str]]) -> None:
        super().__init__(root, fsync=False)
        self.name, self.log = name, log

    async def put_file(self, key: str, path: Path) -> None:
        self.log.append(("put", self.name))
        await super().put_file(key, path)

    async def read(self, key: str, consume: Any) -> Any:
        self.log.append(("read", self.name))
        return await super().read(key, consume)


async def test_stores_are_measured_in_alternation_and_each_gets_its_rows(tmp_path: Path) -> None:
    log: list[tuple[str, str]] = []
    stores = {"a": Recording(tmp_path / "a", "a", log), "b": Recording(tmp_path / "b", "b", log)}
    rows = await bench_resume(stores, sizes_bytes=(64 << 10, 128 << 10), repeats=3, work_dir=tmp_path)
    assert [(r["store"], r["sizeBytes"]) for r in rows] == [("a", 64 << 10), ("b", 64 << 10),
                                                            ("a", 128 << 10), ("b", 128 << 10)]
    assert all(r["repeats"] == 3 and r["resumeP50Ms"] > 0 and r["suspendP50Ms"] > 0 for r in rows)
    one_size = [name for op, name in log[:12]]
    assert one_size == ["a", "b", "b", "a", "a", "b"] * 2, "puts then reads, each repeat in the other order"
    assert [op for op, _ in log[:12]] == ["put"] * 6 + ["read"] * 6
    # every object was deleted again
    assert not [p for p in (tmp_path / "a").rglob("*") if p.is_file()]
