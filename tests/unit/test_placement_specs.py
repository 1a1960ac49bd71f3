"""Placement and spec loading (pure)."""

from __future__ import annotations

import random

import pytest

from substrate.errors import InvalidInput
from substrate.models import SESSION_ID_RE, WorkerRecord, WorkerState, parse_duration_s
from substrate.placement import candidates, lru_victims
from substrate.specs import SpecError, load_catalog, load_documents


def w(wid, free, pool="p", state=WorkerState.READY, lease=1e12):
    return WorkerRecord(id=wid, pool=pool, address="x", slots=8, state=state, leaseExpiresAt=lease,
                        startedAt=0, freeSlots=free)


def test_candidates_prefer_most_free_and_skip_unusable():
    ws = [w("a", 1), w("b", 5), w("c", 0), w("d", 9, pool="q"), w("e", 9, state=WorkerState.DRAINING),
          w("f", 9, lease=0), w("g", 3)]
    assert [x.id for x in candidates(ws, "p", now=1, rng=random.Random(0))] == ["b", "g", "a"]
    assert [x.id for x in candidates(ws, "p", now=1, exclude=["b"])] == ["g", "a"]


def test_pack_prefers_the_fullest_worker_with_a_free_slot_and_still_a_warm_one_first():
    ws = [w("a", 1), w("b", 5), w("c", 0), w("d", 9, pool="q"), w("e", 9, state=WorkerState.DRAINING),
          w("g", 3)]
    assert [x.id for x in candidates(ws, "p", now=1, pack=True)] == ["a", "g", "b"]
    cold, warm = w("cold", 1), w("warm", 6)
    cold.warmSlots, warm.warmSlots = 0, 2
    assert [x.id for x in candidates([cold, warm], "p", now=1, pack=True)] == ["warm", "cold"]


def test_lru_victims_only_idle_running_oldest_first():
    now = 100.0
    got = lru_victims([("new", 99.5, True), ("old", 10, True), ("mid", 50, True), ("off", 1, False)],
                      min_idle_s=1, now=now)
    assert got == ["old", "mid"]


@pytest.mark.parametrize("sid,ok", [("a", True), ("a-b_c.d", True), ("0" * 128, True), ("0" * 129, False),
                                    ("A", False), ("-a", False), ("", False), ("a/b", False), ("é", False),
                                    ("a\n", False), ("abc\n", False)])
def test_session_id_rule(sid, ok):
    assert bool(SESSION_ID_RE.match(sid)) is ok


@pytest.mark.parametrize("v,s", [("60s", 60), ("5m", 300), ("1h", 3600), ("250ms", 0.25), (3, 3), ("0", 0)])
def test_durations(v, s):
    assert parse_duration_s(v) == s


@pytest.mark.parametrize("v", ["five", "-1s", "1d", "", float("nan"), float("inf"), -float("inf")])
def test_bad_durations(v):
    with pytest.raises(ValueError):
        parse_duration_s(v)


@pytest.mark.parametrize("field", ["maxIdleTime", "snapshotInterval"])
@pytest.mark.parametrize("value", [".nan", ".inf"])
def test_a_template_duration_of_nan_or_inf_is_refused_at_load(field, value):
    """Fresh-user round 18: ``maxIdleTime: .nan`` loaded, read back as null (never) and suspended the
    session after every turn; ``snapshotInterval: .nan`` snapshotted at every tick."""
    from substrate.specs import parse_yaml_documents

    text = ("apiVersion: substrate.agent.dev/v1\nkind: ActorTemplate\nmetadata: {name: x}\n"
            f"spec:\n  entrypoint: a:B\n  stateManagement: {{{field}: {value}}}\n")
    with pytest.raises(SpecError) as e:
        load_documents(parse_yaml_documents(text), "t.yaml")
    assert "finite number of seconds" in e.value.message and field in e.value.message, e.value.message


def test_an_infinite_cpu_limit_is_refused_at_load():
    """``isolation.maxCpu: .inf`` loaded and would overflow the CPU quota at the agent's spawn."""
    from substrate.specs import parse_yaml_documents

    text = ("apiVersion: substrate.agent.dev/v1\nkind: ActorTemplate\nmetadata: {name: x}\n"
            "spec:\n  entrypoint: a:B\n  isolation: {maxCpu: .inf}\n")
    with pytest.raises(SpecError) as e:
        load_documents(parse_yaml_documents(text), "t.yaml")
    assert "maxCpu must be a finite quantity" in e.value.message, e.value.message


def test_examples_load_and_templates_find_their_pool():
    from substrate.settings import EXAMPLES_DIR

    cat = load_catalog(EXAMPLES_DIR)
    assert {"counter", "notebook", "shell", "echo-command"} <= set(cat.templates)
    assert cat.pool_for(cat.template("counter")).name == "default"
    with pytest.raises(InvalidInput) as e:
        cat.template("nope")
    assert e.value.code == "unknown_template"


@pytest.mark.parametrize("docs,needle", [
    ([{"kind": "ActorTemplate", "metadata": {"name": "x"}, "spec": {}}], "entrypoint"),
    ([{"kind": "ActorTemplate", "metadata": {"name": "Bad Name"}, "spec": {"entrypoint": "a:B"}}], "name"),
    ([{"kind": "ActorTemplate", "metadata": {"name": "x"}, "spec": {"entrypoint": "nocolon"}}], "entrypoint"),
    ([{"kind": "WorkerPool", "metadata": {"name": "p"}, "spec": {"slots": 0}}], "slots"),
    ([{"kind": "ActorTemplate", "metadata": {"name": "x"},
       "spec": {"entrypoint": "a:B", "stateManagement": {"maxIdleTime": "soon"}}}], "maxIdleTime"),
])
def test_bad_specs_are_refused_with_the_field(docs, needle):
    with pytest.raises(SpecError) as e:
        load_documents(docs, "f.yaml")
    assert needle in e.value.message and "f.yaml" in e.value.message


def test_template_naming_an_unknown_pool(tmp_path):
    (tmp_path / "t.yaml").write_text("kind: ActorTemplate\nmetadata: {name: x}\n"
                                     "spec: {entrypoint: 'a:B', workerPool: ghost}\n"
                                     "---\nkind: WorkerPool\nmetadata: {name: p}\n")
    (tmp_path / "u.yaml").write_text("kind: WorkerPool\nmetadata: {name: q}\n")
    with pytest.raises(InvalidInput) as e:
        load_catalog(tmp_path)
    assert e.value.code == "unknown_pool"
    # the template's own file, not the folder (fresh-user round 11)
    assert e.value.message.startswith(f"{tmp_path / 't.yaml'}: template 'x' names unknown workerPool 'ghost'"), \
        e.value.message


def test_an_unknown_pool_is_one_line_at_start_up(tmp_path, monkeypatch):
    """It was a traceback and exit 1 (fresh-user run); every other spec error is one line and exit 2."""
    from typer.testing import CliRunner

    from substrate.cli import app

    (tmp_path / "t.yaml").write_text("kind: ActorTemplate\nmetadata: {name: t}\n"
                                     "spec: {entrypoint: 'a:B', workerPool: nopool}\n"
                                     "---\nkind: WorkerPool\nmetadata: {name: p}\n")
    monkeypatch.setenv("SUBSTRATE_DATA_DIR", str(tmp_path / "data"))
    r = CliRunner().invoke(app, ["up", "--config", str(tmp_path)])
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output and "names unknown workerPool 'nopool'" in r.output
    assert not (tmp_path / "data").exists()


@pytest.mark.parametrize("layout", ["two files", "one file"])
def test_a_name_defined_twice_is_refused_with_both_places(tmp_path, layout):
    """Two ActorTemplates named ``dup`` loaded silently and the last one won (fresh-user run)."""
    one = "kind: ActorTemplate\nmetadata: {name: dup}\nspec: {entrypoint: 'a:B'}\n"
    two = "kind: ActorTemplate\nmetadata: {name: dup}\nspec: {entrypoint: 'c:D'}\n"
    pool = "kind: WorkerPool\nmetadata: {name: p}\n"
    if layout == "two files":
        (tmp_path / "a.yaml").write_text(one + "---\n" + pool)
        (tmp_path / "b.yaml").write_text(two)
    else:
        (tmp_path / "a.yaml").write_text(one + "---\n" + two + "---\n" + pool)
    with pytest.raises(SpecError) as e:
        load_catalog(tmp_path)
    assert "'dup'" in e.value.message and ("twice" in e.value.message or "again in" in e.value.message)
    if layout == "two files":
        assert "a.yaml" in e.value.message and "b.yaml" in e.value.message


def test_min_replicas_above_max_is_refused(tmp_path):
    """``minReplicas: 5, maxReplicas: 1`` was accepted and started 5 workers (fresh-user run 2)."""
    (tmp_path / "p.yaml").write_text("kind: WorkerPool\nmetadata: {name: p}\n"
                                     "spec: {autoscaling: {minReplicas: 5, maxReplicas: 1}}\n---\n"
                                     "kind: ActorTemplate\nmetadata: {name: t}\nspec: {entrypoint: 'a:B'}\n")
    with pytest.raises(SpecError) as e:
        load_catalog(tmp_path)
    assert "minReplicas (5) is above maxReplicas (1)" in e.value.message


def test_unknown_fields_are_named_in_warnings():
    """Unknown fields were ignored without a word (fresh-user run 2): the spec models keep them, for the
    seed documents' sake, so they are warned about, with the closest known field when one is alike."""
    cat = load_documents([
        {"apiVersion": "substrate.agent.dev/v1", "kind": "ActorTemplate", "metadata": {"name": "t"},
         "spec": {"entrypoint": "a:B", "stateManagement": {"maxIdle": "5s"}, "isolation": {"seccomp": "x"}}},
        {"apiVersion": "substrate.agent.dev/v1", "kind": "WorkerPool", "metadata": {"name": "p"},
         "spec": {"nodeSelector": {"gpu": "yes"}}},
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "other"}}], log_warnings=False)
    text = "\n".join(cat.warnings)
    for field in ("spec.stateManagement.maxIdle", "spec.isolation.seccomp", "spec.nodeSelector"):
        assert f"unknown field {field} is not used by this runtime" in text, text
    assert "spec.stateManagement.maxIdle is not used by this runtime (a typo? did you mean 'maxIdleTime'?)" in text
    assert "spec.nodeSelector is not used by this runtime (a typo?)" in text  # nothing alike: no guess
    assert "ConfigMap" not in text


@pytest.mark.parametrize("kind, spec, message", [
    ("ActorTemplate", {"stateManagment": {"snapshotInterval": "5s"}},
     "spec.stateManagment is not a field here: did you mean 'stateManagement'?"),
    ("ActorTemplate", {"isolation": {"netwrk": "none"}}, "spec.isolation.netwrk is not a field here: did you mean 'network'?"),
    ("ActorTemplate", {"stateManagement": {"snapshotIntervall": "5s"}}, "did you mean 'snapshotInterval'?"),
    ("WorkerPool", {"autoscalling": {"maxReplicas": 1}}, "spec.autoscalling is not a field here: did you mean 'autoscaling'?"),
])
def test_a_typo_of_a_known_field_is_refused(kind, spec, message):
    """Fresh-user round 6: ``spec.stateManagment`` was a warning and its defaults were used, while
    ``spec.quota.maxTotl`` was refused. A field this close to a known one of its object is a typo: refused,
    naming it (the seed's documents have none)."""
    if kind == "ActorTemplate":
        spec = {"entrypoint": "a:B", **spec}
    doc = {"apiVersion": "substrate.agent.dev/v1", "kind": kind, "metadata": {"name": "x"}, "spec": spec}
    with pytest.raises(SpecError) as e:
        load_documents([doc], "t.yaml")
    assert e.value.message.startswith(f"t.yaml document 1 ({kind}): ") and message in e.value.message, e.value.message
    from pathlib import Path

    examples = Path(__file__).resolve().parents[2] / "substrate" / "examples"
    assert not [w for w in load_catalog(examples).warnings if "unknown field" in w]


def test_a_worker_with_a_warm_slot_comes_before_an_emptier_one_whose_hosts_still_boot():
    """A wake on a new worker waited for an agent host to boot (GenTD26 11-26 at 200x: median activation
    233 ms on workers up under 3 s, 34 ms on the others), because placement took the most free slots
    first. ``warmSlots`` (free slots with a booted host) now comes first; not reported (None) counts as
    warm; when no worker has one, the most free slots still win."""
    def w(wid: str, free: int, warm: int | None) -> WorkerRecord:
        return WorkerRecord(id=wid, pool="p", address="x", slots=8, leaseExpiresAt=10, startedAt=0,
                            freeSlots=free, warmSlots=warm)

    new, busy, old = w("new", 6, 0), w("busy", 2, 1), w("old", 3, None)
    assert [x.id for x in candidates([new, busy, old], "p", now=1)] == ["old", "busy", "new"]
    cold = [w("a", 2, 0), w("b", 5, 0)]
    assert [x.id for x in candidates(cold, "p", now=1)] == ["b", "a"]


def test_a_template_with_both_an_entrypoint_and_a_command_is_refused_at_load():
    """Which one runs would be a guess (the command ran, silently: fresh-user run)."""
    with pytest.raises(SpecError) as e:
        load_documents([{"kind": "ActorTemplate", "metadata": {"name": "both"},
                         "spec": {"entrypoint": "workers.agents.counter:Counter", "command": ["python3", "-u", "a.py"]}}])
    assert "not both" in str(e.value)


def test_a_container_only_template_loads_with_one_logged_warning(tmp_path, caplog):
    """Fresh-user round 6: ``substrate up`` with the seed's converted template started without a word and
    refused every create (400 ``unsupported_template``). It still loads (the seed's YAML must), and the
    control plane's own load (``log_warnings``, the default) logs why, naming the template."""
    import logging

    (tmp_path / "t.yaml").write_text(
        "kind: WorkerPool\nmetadata: {name: p}\n---\n"
        "kind: ActorTemplate\nmetadata: {name: boxed}\nspec: {container: {image: 'example/agent:1'}}\n")
    with caplog.at_level(logging.WARNING, logger="substrate.specs"):
        cat = load_catalog(tmp_path)
    assert "boxed" in cat.templates
    logged = [r.getMessage() for r in caplog.records if "has only spec.container" in r.getMessage()]
    assert len(logged) == 1 and "ActorTemplate boxed" in logged[0] and "unsupported_template" in logged[0]
    caplog.clear()
    load_catalog(tmp_path, log_warnings=False)  # the pre-start check and the workers' loads: silent
    assert not caplog.records


@pytest.mark.parametrize("api, kind, message", [
    ("substrate.agent.dev/v1", "ActorTemplat", "kind 'ActorTemplat' is not a kind of substrate.agent.dev/v1 "
                                               "(its kinds: ActorTemplate, WorkerPool): did you mean ActorTemplate?"),
    ("substrate.agent.google.com/v1", "workerpool", "did you mean WorkerPool?"),  # the seed's group: likewise
    ("substrate.agent.dev/v1", "Session", "kind 'Session' is not a kind of substrate.agent.dev/v1 (its kinds: "
                                          "ActorTemplate, WorkerPool)"),
    (None, "ActorTemplat", "did you mean ActorTemplate?"),  # no apiVersion: read as ours (normalize does)
])
def test_an_unknown_kind_of_our_group_is_refused_like_a_wrong_version(tmp_path, api, kind, message):
    """Fresh-user round 6: ``kind: ActorTemplat`` of our group was skipped with a log line (alone in the
    folder: just ``no ActorTemplate found``), while ``substrate.agent.dev/v2`` was refused."""
    doc = (f"apiVersion: {api}\n" if api else "") + f"kind: {kind}\nmetadata: {{name: x}}\nspec: {{}}\n"
    (tmp_path / "t.yaml").write_text("kind: ActorTemplate\nmetadata: {name: ok}\nspec: {entrypoint: 'a:B'}\n"
                                     "---\n" + doc)
    with pytest.raises(SpecError) as e:
        load_catalog(tmp_path)
    assert str(tmp_path / "t.yaml") + " document 2: " in e.value.message and message in e.value.message
    assert "'Session'" not in message or "did you mean" not in e.value.message


def test_other_groups_kinds_are_still_skipped_silently():
    cat = load_documents([{"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}},
                          {"apiVersion": "agents.x-k8s.io/v1alpha1", "kind": "Sandbox", "metadata": {"name": "s"}},
                          None,  # an empty document (a trailing ---)
                          {"kind": "WorkerPool", "metadata": {"name": "p"}}], log_warnings=False)
    assert set(cat.pools) == {"p"} and not cat.warnings


@pytest.mark.parametrize("text, what", [("just a line of text\n", "a YAML string,"),
                                        ("- a\n- b\n", "a YAML list,"),
                                        ("kind: WorkerPool\nmetadata: {name: q}\n---\n42\n", "a YAML number,"),
                                        ("- {tenant: a, sha256: x}\n", "a YAML list"),  # an API keys file
                                        ("name: notes\n", "a mapping with neither apiVersion nor kind")])
def test_a_document_that_is_not_ours_is_said_naming_the_file_and_skipped(tmp_path, text, what):
    """Fresh-user round 6: a file whose document is a string or a list was ignored without a word. It is
    said now, and still skipped: a config folder may hold another tool's YAML (an API keys list)."""
    (tmp_path / "ok.yaml").write_text("kind: WorkerPool\nmetadata: {name: p}\n---\n"
                                      "kind: ActorTemplate\nmetadata: {name: t}\nspec: {entrypoint: 'a:B'}\n")
    (tmp_path / "x.yaml").write_text(text)
    cat = load_catalog(tmp_path, log_warnings=False)
    assert set(cat.templates) == {"t"}
    said = [w for w in cat.warnings if w.startswith(str(tmp_path / "x.yaml") + " document ")]
    assert len(said) == 1 and f"is {what}" in said[0] and said[0].endswith("; ignored"), cat.warnings
    assert "sha256" not in said[0] and "notes" not in said[0] and "text" not in said[0]  # never its content


def test_a_key_repeated_in_one_mapping_is_refused_naming_its_lines(tmp_path):
    """A fresh-user run: a second ``spec:`` (or ``isolation`` key) silently replaced the first, dropping
    ``maxMemory: 64Mi`` for the default 1Gi. Refused now, naming the key and both lines; the same key in
    different mappings, and YAML merge keys, still load."""
    (tmp_path / "pool.yaml").write_text("kind: WorkerPool\nmetadata: {name: p}\nspec: {slots: 2}\n")
    t = tmp_path / "t.yaml"
    t.write_text("kind: ActorTemplate\nmetadata: {name: t}\nspec:\n  entrypoint: 'a:B'\n"
                 "  isolation:\n    maxMemory: 64Mi\n    maxMemory: 2Gi\n")
    with pytest.raises(SpecError) as e:
        load_catalog(t.parent)
    assert e.value.message == (f"{t}: not valid YAML: key 'maxMemory' at line 7, column 5 appears twice in one "
                               "mapping (first at line 6, column 5); YAML would keep only the last")
    t.write_text("kind: ActorTemplate\nmetadata: {name: t}\n"
                 "spec:\n  <<: {entrypoint: 'x:Y', isolation: {maxMemory: 1Gi}}\n  entrypoint: 'a:B'\n  isolation: {maxMemory: 64Mi}\n")
    cat = load_catalog(t.parent, log_warnings=False)
    assert cat.templates["t"].spec.entrypoint == "a:B" and cat.templates["t"].spec.isolation.maxMemory == "64Mi"


@pytest.mark.parametrize("kind, spec, message", [
    ("ActorTemplate", {"quota": {"maxTotl": 3}}, "spec.quota.maxTotl: not a field here (did you mean 'maxTotal'?)"),
    ("ActorTemplate", {"quota": {"limit": 3}},
     "spec.quota.limit: not a field here (the fields here are maxRunning, maxTotal, maxGpus, maxCreatesPerMinute)"),
])
def test_a_field_a_strict_part_does_not_have_gets_the_closest_one(kind, spec, message):
    """Fresh-user round 8: ``spec.quota`` refuses unknown fields itself, and said only "Extra inputs are
    not permitted", with no hint of the field meant."""
    doc = {"apiVersion": "substrate.agent.dev/v1", "kind": kind, "metadata": {"name": "x"},
           "spec": {"entrypoint": "a:B", **spec}}
    with pytest.raises(SpecError) as e:
        load_documents([doc], "t.yaml")
    assert message in e.value.message, e.value.message


@pytest.mark.parametrize("kind, spec, field", [
    ("ActorTemplate", {"entrypoint": "a:B", "quota": {"maxRunning": True}}, "spec.quota.maxRunning"),
    ("ActorTemplate", {"entrypoint": "a:B", "isolation": {"maxProcesses": False}}, "spec.isolation.maxProcesses"),
    ("ActorTemplate", {"entrypoint": "a:B", "resources": {"gpus": True}}, "spec.resources.gpus"),
    ("WorkerPool", {"replicas": True}, "spec.replicas"),
    ("WorkerPool", {"slots": True}, "spec.slots"),
    ("WorkerPool", {"autoscaling": {"maxReplicas": True}}, "spec.autoscaling.maxReplicas"),
])
def test_a_bool_where_a_count_belongs_is_refused(kind, spec, field):
    """Fresh-user round 8: ``maxRunning: true`` loaded as a limit of one (pydantic reads true as 1)."""
    doc = {"apiVersion": "substrate.agent.dev/v1", "kind": kind, "metadata": {"name": "x"}, "spec": spec}
    with pytest.raises(SpecError) as e:
        load_documents([doc], "t.yaml")
    assert f"{field}: Value error, a whole number is required here, not " in e.value.message, e.value.message

    def one_for_bool(x):
        return {k: one_for_bool(v) for k, v in x.items()} if isinstance(x, dict) else 1 if isinstance(x, bool) else x

    load_documents([{**doc, "spec": one_for_bool(spec)}], "t.yaml")  # the same with 1 loads


@pytest.mark.parametrize("env, says", [
    ([{"name": "X=Y", "value": "z"}], "env[0].name 'X=Y' is not an environment variable name"),
    ([{"name": "", "value": "e"}], "env[0].name '' is not an environment variable name"),
    ([{"name": "bad-name", "value": "e"}], "env[0].name 'bad-name' is not an environment variable name"),
    ([{"name": "9LIVES", "value": "e"}], "is not an environment variable name"),
    ([{"name": "A", "value": "x\x00y"}], "env[0] (A): the value holds a NUL character"),
    ([{"name": "A", "value": "1"}, {"name": "B"}, {"name": "A", "value": "2"}],
     "env[2].name 'A' is given twice (also env[0])"),
])
def test_a_template_env_no_agent_can_be_given_is_refused_at_load(env, says):
    """Fresh-user round 9: these loaded, then every create failed 500 ``agent_start_failed`` naming
    neither the template nor the variable (or the variable silently went missing, or the last of two
    values won)."""
    doc = {"apiVersion": "substrate.agent.dev/v1", "kind": "ActorTemplate", "metadata": {"name": "x"},
           "spec": {"command": ["/bin/cat"], "env": env}}
    with pytest.raises(SpecError) as e:
        load_documents([doc], "t.yaml")
    assert e.value.message.startswith("t.yaml document 1 (ActorTemplate): spec.env: ") and says in e.value.message, \
        e.value.message
    ok = [{"name": "ANTHROPIC_API_KEY", "value": "x"}, {"name": "_private2"}, {"name": "SHELL_TIMEOUT_S", "value": "5"}]
    load_documents([{**doc, "spec": {"command": ["/bin/cat"], "env": ok}}], "t.yaml")


@pytest.mark.parametrize("quota, warned", [({"maxRunning": 0}, "spec.quota.maxRunning 0"),
                                           ({"maxTotal": 0, "maxRunning": 3}, "spec.quota.maxTotal 0"),
                                           ({"maxRunning": 1}, None)])
def test_a_template_closed_by_a_quota_of_zero_is_warned_of_at_load(quota, warned):
    """Fresh-user round 10: it loaded without a word (a pool with replicas 0 is warned of), then every
    create was 429 at once."""
    doc = {"apiVersion": "substrate.agent.dev/v1", "kind": "ActorTemplate", "metadata": {"name": "x"},
           "spec": {"entrypoint": "a:B", "quota": quota}}
    cat = load_documents([doc], "t.yaml")
    said = [w for w in cat.warnings if "spec.quota." in w]
    if warned is None:
        assert said == []
    else:
        assert len(said) == 1 and warned in said[0] and "every tenant's creates of it are refused" in said[0]


def test_a_folder_with_no_template_says_what_it_ignored(tmp_path):
    """Fresh-user round 16: a folder whose only document lacked apiVersion and kind failed with just
    ``no ActorTemplate found``: the warning that said why is not printed when the load fails."""
    (tmp_path / "t.yaml").write_text("metadata: {name: x}\nspec: {entrypoint: 'a:B'}\n")
    with pytest.raises(SpecError) as e:
        load_catalog(tmp_path)
    assert e.value.message.startswith(f"no ActorTemplate found in {tmp_path} (")
    assert "document 1 is a mapping with neither apiVersion nor kind" in e.value.message


@pytest.mark.parametrize("spec, message", [
    ({"isolation": {"maxCpu": "1e309"}}, "isolation.maxCpu must be a finite quantity, got '1e309'"),
    ({"isolation": {"maxCpu": "1e18"}}, "isolation.maxCpu must be at most 4096 cores, got '1e18'"),
    ({"stateManagement": {"maxIdleTime": "9" * 400 + "s"}}, "duration must be at most 31536000 s (a year)"),
    ({"isolation": {"turnTimeout": 10 ** 12}}, "duration must be at most 31536000 s (a year)"),
])
def test_limits_and_durations_beyond_what_the_kernel_or_a_clock_holds_are_refused_at_load(spec, message):
    """Fresh-user round 19: ``maxCpu: "1e18"`` loaded and every create failed "Numerical result out of
    range", ``"1e309"`` overflowed to infinity; a 400-digit duration became infinite and was printed back."""
    doc = {"apiVersion": "substrate.agent.dev/v1", "kind": "ActorTemplate", "metadata": {"name": "x"},
           "spec": {"entrypoint": "a:B", **spec}}
    with pytest.raises(SpecError) as e:
        load_documents([doc], "t.yaml")
    assert message in e.value.message and len(e.value.message) < 400, e.value.message


def test_a_yaml_syntax_error_is_one_line_naming_where(tmp_path):
    """Fresh-user run: a template with a broken flow mapping gave PyYAML's own text at start-up, seven
    lines with excerpts of the file, where every other start-up error is one line."""
    (tmp_path / "p.yaml").write_text("kind: WorkerPool\nmetadata: {name: default\nspec:\n  replicas: 1\n")
    with pytest.raises(SpecError) as e:
        load_catalog(tmp_path)
    assert "\n" not in e.value.message
    assert e.value.message == (f"{tmp_path / 'p.yaml'}: not valid YAML: expected ',' or '}}', but got ':' at line 3, "
                               "column 5 (while parsing a flow mapping at line 2, column 11)")
