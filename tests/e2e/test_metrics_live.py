"""Every metric a shipped alert rule or dashboard panel uses is emitted by the code path it describes.

A real runtime (``substrate up``: router, state manager, pool controller, worker processes) takes real
traffic (create, invoke, suspend, wake, errors, a worker crash); then ``/metrics`` is read from the
router and from every worker and each series the rules and the dashboard query must have moved. This
test process never touches a metric itself: a series can only move if the runtime emitted it.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[2]


def _used_metric_names() -> set[str]:
    """Base metric names (``agent_substrate_*`` without _bucket/_count/_sum/_total) the rules and the
    dashboard query."""
    text = (ROOT / "deploy/monitoring/prometheusrule.yaml").read_text()
    exprs = [r["expr"] for d in yaml.safe_load_all(text) if d
             for g in d["spec"]["groups"] for r in g["rules"]]
    dash = json.loads((ROOT / "deploy/monitoring/grafana-dashboard.json").read_text())
    exprs += [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    names = set()
    for e in exprs:
        for n in re.findall(r"agent_substrate_[a-z_]+", e):
            names.add(re.sub(r"_(bucket|count|sum)$", "", n))
    return names


TYPES: dict[str, str] = {}


def _scrape(url: str) -> dict[str, dict[str, float]]:
    """family name -> {sample name + labels: value} (family types go to ``TYPES``)."""
    out: dict[str, dict[str, float]] = {}
    for fam in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        TYPES[fam.name] = fam.type
        for s in fam.samples:
            key = s.name + json.dumps(s.labels, sort_keys=True)
            out.setdefault(fam.name, {})[key] = s.value
    return out


def _activity(scrapes: list[dict[str, dict[str, float]]], family: str) -> tuple[float, bool]:
    """(sum of _count / _total samples, exported at all) of one family across processes."""
    total, seen = 0.0, False
    for sc in scrapes:
        fam = sc.get(family) or sc.get(family.removesuffix("_total"))
        if fam is None:
            continue
        seen = True
        for k, v in fam.items():
            name = k.split("{", 1)[0]
            if name.endswith(("_count", "_total")):
                total += v
    return total, seen


def test_every_series_the_alerts_and_dashboard_use_moves_under_real_traffic(runtime_factory):
    rt = runtime_factory(replicas=2, slots=4)
    c = rt.client
    used = _used_metric_names()
    assert len(used) >= 15, used

    def scrape_all() -> list[dict[str, dict[str, float]]]:
        return [_scrape(rt.url)] + [_scrape(w["address"]) for w in rt.workers().values()]

    before = scrape_all()
    # traffic: creates, warm turns, an explicit suspend and a wake on request, errors on several paths
    s1, s2 = c.create_session("counter"), c.create_session("counter")
    for _ in range(3):
        assert c.http.post(f"/v1/sessions/{s1['id']}/invoke", json={"input": "increment"}).status_code == 200
    c.suspend(s1["id"])
    r = c.http.post(f"/v1/sessions/{s1['id']}/invoke", json={"input": "increment"})
    assert r.status_code == 200 and r.headers["x-substrate-woke"] == "1"
    assert c.http.post("/v1/sessions/nope/invoke", json={"input": "get"}).status_code == 404
    assert c.http.post("/v1/sessions", json={"actorTemplate": "no-such"}).status_code == 422
    # an agent's own error, passed on from the worker, plain and streamed (fresh-user round 13: not counted)
    assert c.http.post(f"/v1/sessions/{s1['id']}/invoke", json={"input": "bogus"}).status_code == 422
    assert c.http.post(f"/v1/sessions/{s1['id']}/invoke?stream=1", json={"input": "bogus"}).status_code == 422
    # the state manager exports the session gauge on its next scan
    # and the pool controller the capacity gauges on its next round
    rt.wait_for(lambda: 'state="RUNNING"} 2.0' in httpx.get(f"{rt.url}/metrics").text, what="sessions gauge")
    rt.wait_for(lambda: 'state="READY"} 2.0' in httpx.get(f"{rt.url}/metrics").text, what="workers gauge")
    # and the event-loop lag histogram at its next once-a-second probe (the traffic above can take less
    # than a second: a fresh-clone run found no probe of any process between the two scrapes)
    lag = "agent_substrate_event_loop_lag_seconds"
    rt.wait_for(lambda: _activity([_scrape(rt.url)], lag)[0] > _activity(before[:1], lag)[0],
                what="an event-loop lag probe of the router")
    after = scrape_all()

    # a crash: the worker holding s2 dies; the next request recovers s2 from its snapshot (worker_lost)
    rt.kill_worker(s2["worker"])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        r = c.http.post(f"/v1/sessions/{s2['id']}/invoke", json={"input": "get"})
        if r.status_code == 200:
            break
        time.sleep(0.2)
    assert r.status_code == 200
    router_after_crash = _scrape(rt.url)

    moved, missing = {}, []
    for name in sorted(used):
        b, _ = _activity(before, name)
        a, seen = _activity(after + [router_after_crash] if name.endswith("recoveries_total") else after, name)
        if not seen:
            missing.append(name)
        moved[name] = a - b
    assert not missing, f"series used by alerts/dashboards that no process exports: {missing}"
    counted = {n for n in used if TYPES.get(n.removesuffix("_total")) in ("counter", "histogram")}
    assert len(counted) >= 10, counted
    still = sorted(n for n in counted if moved[n] <= 0)
    assert not still, f"series used by alerts/dashboards that did not move under real traffic: {still}"

    router = after[0]
    assert router["agent_substrate_requests"][
        'agent_substrate_requests_total{"code": "404", "route": "/v1/sessions/{sid}/invoke"}'] >= 1
    errors = router["agent_substrate_errors"]
    assert any('"session_not_found"' in k and v >= 1 for k, v in errors.items())
    assert any('"agent_error"' in k and v >= 2 for k, v in errors.items()), errors
    assert any(f'"state": "RUNNING"' in k and v == 2 for k, v in router["agent_substrate_sessions"].items())
    assert any('"state": "READY"' in k and v >= 1 for k, v in router["agent_substrate_workers"].items())
