"""``X-Substrate-Restored`` says an answer comes from older state "until a newer snapshot is committed"
(README): fresh-user run 36 saw it on every answer for the rest of the activation, across three committed
snapshots, so clients and the SDK warned of a loss on each turn long after the state was saved again."""

from __future__ import annotations

import os
import signal


def test_the_loss_marker_ends_with_the_first_snapshot_committed_after_a_told_loss(runtime_factory) -> None:
    rt = runtime_factory(replicas=2, slots=4, snapshot_interval="0.5s")
    c = rt.client
    sid = c.create_session("counter")["id"]
    c.invoke(sid, "increment")
    rt.wait_for(lambda: (c.get_session(sid).get("snapshot") or {}).get("epoch") == 1, what="a periodic snapshot")
    c.invoke(sid, "increment")  # acknowledged, not yet in any snapshot
    wid = c.get_session(sid)["worker"]
    os.kill(int(rt.workers()[wid]["pid"]), signal.SIGKILL)
    first = c.invoke_answer(sid, "increment")  # back from the snapshot of count 1: the loss is told
    assert first.restored is not None and first.restored.startswith("worker_lost"), first
    assert first.output == {"count": 2}
    epoch = c.get_session(sid)["epoch"]
    again = c.invoke_answer(sid, "increment")
    assert again.restored is not None, "every answer of the older state says so until a newer snapshot"
    rt.wait_for(lambda: (c.get_session(sid).get("snapshot") or {}).get("epoch") == epoch, timeout_s=30,
                what="a snapshot of the new activation committed")
    after = c.invoke_answer(sid, "increment")
    assert after.output == {"count": 4} and after.restored is None, after
