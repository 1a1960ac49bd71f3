"""Trace loaders, window selection, session splitting and time compression (pure, no server)."""

from __future__ import annotations

import csv
import json
from datetime import UTC, datetime
from pathlib import Path

import pytest

from loadtest.traces import (
    AzureOptions,
    Session,
    TraceError,
    Turn,
    azure_owner,
    compress,
    describe,
    detect_format,
    format_timestamp,
    load_azure,
    load_gentd26,
    load_openhands,
    load_plain,
    load_trace,
    openhands_turns,
    parse_duration,
    parse_timestamp,
    resolve_start,
    select_window,
    split_sessions,
)

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "loadtest" / "fixtures"
REAL_GENTD26 = REPO.parent / "shared" / "traces" / "gentd26_requests_2024-11-15_to_11-26.csv"

GENTD26_HEADER = (
    "gmt_create,predict_type,predict_status,exec_time_seconds,groupId,prompt_length,"
    "negative_prompt_length,num_images_per_prompt,num_inference_steps,checkpoint_model_version_id,num_lora"
)


def ts(text: str) -> float:
    return datetime.fromisoformat(text).replace(tzinfo=UTC).timestamp()


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


# ------------------------------------------------------------------------------------ parsing


def test_parse_timestamp_naive_is_utc_and_long_fractions_are_cut():
    assert parse_timestamp("2024-11-15 16:57:50") == ts("2024-11-15T16:57:50")
    # Azure writes 7 fraction digits; the 7th is dropped, the first 6 are kept
    assert parse_timestamp("2023-11-16 18:15:46.6805909") == pytest.approx(ts("2023-11-16T18:15:46") + 0.680590, abs=1e-7)
    assert parse_timestamp("2025-01-20T20:29:13.519638Z") == pytest.approx(ts("2025-01-20T20:29:13") + 0.519638, abs=1e-7)
    assert parse_timestamp("2024-01-01T02:00:00+02:00") == ts("2024-01-01T00:00:00")
    with pytest.raises(TraceError):
        parse_timestamp("yesterday")


def test_format_timestamp_round_trips():
    assert format_timestamp(ts("2024-11-20T08:30:00")) == "2024-11-20T08:30:00Z"


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90s", 90), ("30m", 1800), ("2h", 7200), ("1d", 86400), ("1h30m", 5400), ("45", 45), ("250ms", 0.25),
     ("1.5h", 5400), ("1w", 604800), (12, 12.0)],
)
def test_parse_duration(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("bad", ["", "abc", "1x", "m"])
def test_parse_duration_rejects_garbage(bad):
    with pytest.raises(ValueError):
        parse_duration(bad)


# ------------------------------------------------------------------------------------ detection


def test_detect_format_from_header_and_extension(tmp_path):
    assert detect_format(write(tmp_path / "g.csv", GENTD26_HEADER + "\n")) == "gentd26"
    assert detect_format(write(tmp_path / "a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n")) == "azure"
    assert detect_format(write(tmp_path / "p.csv", "session_id,arrival_s,duration_s\n")) == "plain"
    assert detect_format(write(tmp_path / "o.jsonl", "{}\n")) == "openhands"
    assert detect_format(write(tmp_path / "o.json", "[]")) == "openhands"
    with pytest.raises(TraceError, match="--format"):
        detect_format(write(tmp_path / "x.csv", "foo,bar\n"))


def test_load_trace_override_and_errors(tmp_path):
    # a plain-format file under a name that says nothing: auto-detect by header, or forced
    p = write(tmp_path / "t.txt", "session_id,arrival_s,duration_s\ns1,0,1\n")
    assert load_trace(p) == [Turn("s1", 0, 1, True)]
    assert load_trace(p, "plain") == [Turn("s1", 0, 1, True)]
    with pytest.raises(TraceError, match="unknown trace format"):
        load_trace(p, "nope")
    with pytest.raises(TraceError, match="no such"):
        load_trace(tmp_path / "missing.csv")


# ------------------------------------------------------------------------------------ loaders


def test_gentd26_loader(tmp_path):
    p = write(
        tmp_path / "g.csv",
        GENTD26_HEADER
        + "\n2024-01-01 00:00:10,TXT_2_IMG,SUCCEED,20.0,G2,1,,1,30,M1,0"  # out of order on purpose
        + "\n2024-01-01 00:00:00,TXT_2_IMG,SUCCEED,30.0,G1,1,,1,30,M1,0"
        + "\n2024-01-01 00:01:00,TXT_2_IMG,FAILED,3.0,G1,1,,1,30,M1,0"
        + "\n2024-01-01 00:02:00,TXT_2_IMG,PENDING,0.0,G3,1,,1,30,M1,0\n",
    )
    turns = load_gentd26(p)
    t0 = ts("2024-01-01T00:00:00")
    assert turns == [
        Turn("G1", t0, 30.0, True),
        Turn("G2", t0 + 10, 20.0, True),
        Turn("G1", t0 + 60, 3.0, False),
        Turn("G3", t0 + 120, 0.0, False),
    ]
    assert load_trace(p) == turns  # auto-detected


def test_gentd26_fixture_shipped_with_the_project():
    turns = load_trace(FIXTURES / "gentd26_small.csv")
    assert len(turns) == 7
    assert {t.session_owner for t in turns} == {"G0001", "G0002", "G0003"}
    assert sum(not t.ok for t in turns) == 2  # one FAILED, one PENDING


def test_azure_loader_owners_and_durations(tmp_path):
    p = write(
        tmp_path / "az.csv",
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,1000,50\n"
        "2023-11-16 18:15:50.0000000,0,100\n"
        "2023-11-16 18:15:51.5000000,500,0\n",
    )
    opts = AzureOptions(owners=2, scheme="roundrobin", prefill_tokens_per_s=1000, decode_tokens_per_s=50)
    turns = load_azure(p, opts)
    assert [t.session_owner for t in turns] == ["az0000", "az0001", "az0000"]
    assert [t.duration_s for t in turns] == pytest.approx([1.0 + 1.0, 2.0, 0.5])
    assert turns[1].arrival_s - turns[0].arrival_s == pytest.approx(3.31941, abs=1e-6)
    assert all(t.ok for t in turns)
    assert load_trace(p, azure=opts) == turns


def test_azure_hash_owner_scheme_is_stable_bounded_and_seeded():
    opts = AzureOptions(owners=7, scheme="hash", seed=1)
    owners = [azure_owner(i, opts) for i in range(500)]
    assert owners == [azure_owner(i, AzureOptions(owners=7, scheme="hash", seed=1)) for i in range(500)]
    assert set(owners) == {f"az{k:04d}" for k in range(7)}  # all K used, none beyond
    assert owners != [azure_owner(i, AzureOptions(owners=7, scheme="hash", seed=2)) for i in range(500)]
    assert owners != [f"az{i % 7:04d}" for i in range(500)]  # not round robin
    with pytest.raises(TraceError):
        azure_owner(0, AzureOptions(scheme="bogus"))


def _oh_events(t0: str = "2025-01-01T00:00:00") -> list[dict]:
    base = datetime.fromisoformat(t0)

    def at(s: float) -> str:
        return datetime.fromtimestamp(base.replace(tzinfo=UTC).timestamp() + s, tz=UTC).replace(tzinfo=None).isoformat()

    return [
        {"id": 0, "timestamp": at(0), "source": "environment", "observation": "agent_state_changed"},
        {"id": 1, "timestamp": at(0.1), "source": "user", "action": "message"},
        {"id": 2, "timestamp": at(0.2), "source": "user", "observation": "null", "cause": 1},
        {"id": 3, "timestamp": at(3.0), "source": "agent", "action": "run"},
        {"id": 4, "timestamp": at(4.5), "source": "agent", "observation": "run", "cause": 3, "success": False},
        {"id": 5, "timestamp": at(10.0), "source": "agent", "action": "edit"},
        {"id": 6, "timestamp": at(10.25), "source": "agent", "observation": "edit", "cause": 5},
        {"id": 7, "timestamp": at(12.0), "source": "agent", "observation": "error"},  # no cause
        {"id": 8, "timestamp": at(20.0), "source": "agent", "action": "finish"},  # no observation
    ]


def test_openhands_turns_are_tool_calls_with_run_time():
    events = _oh_events()
    t0 = ts("2025-01-01T00:00:00")
    turns = openhands_turns(events, "traj")
    assert turns == [
        Turn("traj", t0 + 3.0, 1.5, True),  # a failing command is still served: ok
        Turn("traj", t0 + 10.0, 0.25, True),
        Turn("traj", t0 + 12.0, 0.0, False),  # error observation without a cause
    ]
    # think time = idle gaps between tool calls
    (session,) = split_sessions(turns, 60)
    assert session.think_s() == pytest.approx([10.0 - 4.5, 12.0 - 10.25])


def test_openhands_jsonl_and_json_shapes(tmp_path):
    jsonl = tmp_path / "out.jsonl"
    jsonl.write_text(
        json.dumps({"instance_id": "repo__x-1", "history": _oh_events("2025-01-01T00:00:00")}) + "\n\n"
        + json.dumps({"history": _oh_events("2025-01-01T01:00:00")}) + "\n",
        encoding="utf-8",
    )
    turns = load_openhands(jsonl)
    assert len(turns) == 6
    assert {t.session_owner for t in turns} == {"repo__x-1", "out:3"}  # instance_id, else stem:line
    assert turns == sorted(turns)
    assert load_trace(jsonl) == turns

    plain_list = write(tmp_path / "traj.json", json.dumps(_oh_events()))
    assert {t.session_owner for t in load_trace(plain_list)} == {"traj"}
    as_dict = write(tmp_path / "one.json", json.dumps({"instance_id": "abc", "history": _oh_events()}))
    assert {t.session_owner for t in load_trace(as_dict)} == {"abc"}
    many = write(tmp_path / "many.json", json.dumps([{"history": _oh_events()}, {"history": _oh_events()}]))
    assert {t.session_owner for t in load_trace(many)} == {"many:0", "many:1"}


def test_plain_loader_ok_column(tmp_path):
    p = write(tmp_path / "p.csv", "session_id,arrival_s,duration_s,ok\nb,5,1,0\na,0,2.5,true\nc,7,0,\n")
    assert load_plain(p) == [Turn("a", 0, 2.5, True), Turn("b", 5, 1, False), Turn("c", 7, 0, True)]
    no_ok = write(tmp_path / "q.csv", "session_id,arrival_s,duration_s\na,1,2\n")
    assert load_plain(no_ok) == [Turn("a", 1, 2, True)]


def test_turn_coerces_and_clamps():
    t = Turn("x", "5", "-1")
    assert (t.arrival_s, t.duration_s, t.ok, t.end_s) == (5.0, 0.0, True, 5.0)
    assert sorted([Turn("b", 2, 0), Turn("a", 2, 0), Turn("z", 1, 0)]) == [Turn("z", 1, 0), Turn("a", 2, 0), Turn("b", 2, 0)]


# ------------------------------------------------------------------------------------ sessions


def test_split_sessions_gap_is_measured_from_the_end_of_work():
    turns = [
        Turn("u", 0, 100),  # busy until 100
        Turn("u", 150, 10),  # gap 50 from the end: same session (150 s from the arrival)
        Turn("u", 260, 5),  # gap exactly 100 from 160: same session (not strictly greater)
        Turn("u", 365.5, 1),  # gap 100.5 > 100: new session
        Turn("v", 10, 1),
    ]
    sessions = split_sessions(turns, 100)
    assert [(s.key, len(s.turns)) for s in sessions] == [("u#0", 3), ("v#0", 1), ("u#1", 1)]
    u0 = sessions[0]
    assert (u0.start_s, u0.last_end_s) == (0, 265)
    assert u0.hold_s(100) == 365


def test_split_sessions_overlapping_turns_extend_the_busy_time():
    # the second turn ends before the first: the idle clock starts at the later end (100)
    turns = [Turn("u", 0, 100), Turn("u", 10, 5), Turn("u", 180, 1)]
    assert len(split_sessions(turns, 90)) == 1  # 180 - 100 = 80 <= 90
    assert len(split_sessions(turns, 70)) == 2


def test_split_sessions_fixture():
    turns = load_trace(FIXTURES / "sessions_small.csv")
    sessions = split_sessions(turns, parse_duration("30m"))
    assert len(turns) == 10
    assert len(sessions) == 7
    by_owner: dict[str, int] = {}
    for s in sessions:
        by_owner[s.owner] = by_owner.get(s.owner, 0) + 1
    assert by_owner == {"alice": 2, "bob": 2, "carol": 2, "dave": 1}
    assert [s.start_s for s in sessions] == sorted(s.start_s for s in sessions)
    # with a 10 h split every owner is one session
    assert len(split_sessions(turns, parse_duration("10h"))) == 4


def test_session_hold_and_think():
    s = Session("a#0", "a", (Turn("a", 10, 5), Turn("a", 20, 2), Turn("a", 21, 4)))
    assert s.hold_s(30) == 25 + 30 - 10
    assert s.think_s() == [5.0, 0.0]


# ------------------------------------------------------------------------------------ window


def test_select_window_is_half_open():
    turns = [Turn("a", t, 1) for t in (0, 10, 20, 30)]
    assert [t.arrival_s for t in select_window(turns, 10, 20)] == [10, 20]
    assert [t.arrival_s for t in select_window(turns, 10)] == [10, 20, 30]
    assert [t.arrival_s for t in select_window(turns, None, None)] == [0, 10, 20, 30]
    assert select_window(turns, 31, 100) == []


def test_resolve_start():
    first = ts("2024-11-15T16:57:50")
    assert resolve_start(None, first, True) == first
    assert resolve_start("2h", first, True) == first + 7200
    assert resolve_start("3600", first, False) == first + 3600
    assert resolve_start("2024-11-20", first, True) == ts("2024-11-20T00:00:00")
    assert resolve_start("2024-11-20T08:00", first, True) == ts("2024-11-20T08:00:00")
    with pytest.raises(TraceError):
        resolve_start("2024-11-20", 0.0, False)


# ------------------------------------------------------------------------------------ compression


def test_compress_divides_arrivals_from_origin_and_durations():
    turns = [Turn("a", 1000, 50), Turn("b", 1200, 100, False)]
    out = compress(turns, 100)
    assert out == [Turn("a", 0, 0.5), Turn("b", 2, 1, False)]
    assert compress(turns, 10, origin_s=0) == [Turn("a", 100, 5), Turn("b", 120, 10, False)]
    assert compress([], 10) == []
    with pytest.raises(ValueError):
        compress(turns, 0)


def test_describe():
    d = describe([Turn("a", 0, 5), Turn("b", 10, 20, False)])
    assert d == {"turns": 2, "owners": 2, "span_s": 30.0, "failed": 1, "busy_s": 25.0}


# ------------------------------------------------------------------------------------ real trace


@pytest.mark.skipif(not REAL_GENTD26.exists(), reason="shared GenTD26 trace not present")
def test_real_gentd26_trace_loads_faithfully():
    with REAL_GENTD26.open(newline="") as f:
        rows = list(csv.DictReader(f))
    turns = load_trace(REAL_GENTD26)
    assert detect_format(REAL_GENTD26) == "gentd26"
    assert len(turns) == len(rows) > 1000
    assert turns == sorted(turns)
    assert sum(not t.ok for t in turns) == sum(r["predict_status"] != "SUCCEED" for r in rows) > 0
    assert {t.session_owner for t in turns} == {r["groupId"] for r in rows}
    assert sum(t.duration_s for t in turns) == pytest.approx(sum(float(r["exec_time_seconds"]) for r in rows))
    assert turns[0].arrival_s == parse_timestamp(min(r["gmt_create"] for r in rows))
    # one day from Nov 20: only rows of that UTC day
    day = select_window(turns, resolve_start("2024-11-20", turns[0].arrival_s, True), parse_duration("1d"))
    assert len(day) == sum(r["gmt_create"].startswith("2024-11-20") for r in rows) > 0
    # many sessions per owner at a 30 min split, as the README describes
    sessions = split_sessions(turns, 1800)
    assert len({t.session_owner for t in turns}) < len(sessions) < len(turns)


@pytest.mark.parametrize("body, says", [
    ("session_id,arrival_s\ns1,0\n", "missing: duration_s"),
    ("session_id,arrival_s,duration_s\ns1,0,1\ns2,abc,1\n", "line 3: arrival_s 'abc' is not a number"),
    ("session_id,arrival_s,duration_s\ns1,0,-2\n", "line 2: duration_s '-2' must be a finite number >= 0"),
    ("session_id,arrival_s,duration_s\ns1,nan,1\n", "line 2: arrival_s 'nan' must be a finite number"),
    ("session_id,arrival_s,duration_s\ns1,inf,1\n", "arrival_s 'inf' must be a finite number"),
    ("session_id,arrival_s,duration_s\ns1,0,1e9\n", "line 2: duration_s 1e+09 is more than a day"),
])
def test_a_plain_trace_row_that_cannot_be_replayed_is_refused_naming_its_line(tmp_path, body, says):
    """Fresh-user round 10: a bad number said only "could not convert string to float"; a missing
    duration column, negative durations and NaN/inf arrivals were taken or dropped silently."""
    p = write(tmp_path / "t.csv", body)
    with pytest.raises(TraceError) as e:
        load_plain(p)
    assert says in str(e.value) and str(p) in str(e.value), str(e.value)
