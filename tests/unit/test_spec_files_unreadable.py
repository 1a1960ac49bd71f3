"""Config files that cannot be read, or hold a field of the wrong shape, are one error line naming the
file (and the field), never a traceback (fresh-user round 11: ``spec:`` written as a list, a file that
is not UTF-8 and a symlink loop each ended ``substrate up`` with a 40-50 line traceback and exit 1)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from substrate.cli import app
from substrate.specs import SpecError, load_catalog
from tests.cli_up import up_on_a_taken_port

POOL = "apiVersion: substrate.agent.dev/v1\nkind: WorkerPool\nmetadata: {name: default}\nspec: {replicas: 1, slots: 2}\n"
HEAD = "apiVersion: substrate.agent.dev/v1\nkind: ActorTemplate\n"
OK = HEAD + "metadata: {name: ok}\nspec: {entrypoint: 'workers.agents.counter:Counter'}\n"


def _with_pool(spec: str) -> str:
    """The good template plus a second WorkerPool ``p2`` of ``spec`` (a YAML flow mapping)."""
    return OK + f"---\napiVersion: substrate.agent.dev/v1\nkind: WorkerPool\nmetadata: {{name: p2}}\nspec: {spec}\n"


def _write(cfg: Path, case: str) -> Path:
    bad = cfg / "t.yaml"
    if case == "spec as a list":
        bad.write_text(HEAD + "metadata: {name: c}\nspec:\n  - entrypoint: workers.agents.counter:Counter\n")
    elif case == "isolation as a string":
        bad.write_text(HEAD + "metadata: {name: c}\nspec: {entrypoint: 'workers.agents.counter:Counter', "
                       "isolation: strict}\n")
    elif case == "pool template as a list":
        bad.write_text(_with_pool("{template: [1, 2]}"))
    elif case == "containers as a string":
        bad.write_text(_with_pool("{template: {spec: {containers: notalist}}}"))
    elif case == "a container as a string":
        bad.write_text(_with_pool("{template: {spec: {containers: [{name: w, image: i}], initContainers: [x]}}}"))
    elif case == "limits as a list":
        bad.write_text(_with_pool("{template: {spec: {containers: [{name: w, resources: {limits: [1]}}]}}}"))
    elif case == "empty metadata":
        bad.write_text(HEAD + "metadata:\nspec: {entrypoint: 'workers.agents.counter:Counter'}\n")
    elif case == "not UTF-8":
        bad.write_bytes(b"\xff\xfeapiVersion: x\n")
    elif case == "symlink loop":
        bad.symlink_to(bad.name)
    return bad


CASES = {
    "spec as a list": "document 1 (ActorTemplate): spec: must be a mapping (field: value), not a list",
    "isolation as a string": "document 1 (ActorTemplate): spec.isolation: must be a mapping (field: value), not a string",
    "pool template as a list": "document 2 (WorkerPool): spec.template: ",
    # the pod template is untyped in the model: these were "a field has the wrong type ('str' object has no
    # attribute 'get')", naming no field (fresh-user review)
    "containers as a string": "document 2 (WorkerPool): spec.template.spec.containers: must be a list (got a string)",
    "a container as a string": "document 2 (WorkerPool): spec.template.spec.initContainers[0]: must be a mapping "
                               "(got a string)",
    "limits as a list": "document 2 (WorkerPool): spec.template.spec.containers[0].resources.limits: must be a "
                        "mapping (got a list)",
    "empty metadata": "document 1 (ActorTemplate): metadata.name: Field required",
    "not UTF-8": ": not UTF-8 text (byte 0xff at offset 0)",
    "symlink loop": ": cannot be read: Too many levels of symbolic links",
}


def _config(tmp_path: Path, case: str) -> tuple[Path, Path]:
    cfg = tmp_path / "config"
    cfg.mkdir()
    (cfg / "pool.yaml").write_text(POOL)
    (cfg / "a-ok.yaml").write_text(OK)
    return cfg, _write(cfg, case)


@pytest.mark.parametrize("case", list(CASES))
def test_each_is_one_spec_error_naming_the_file(tmp_path: Path, case: str) -> None:
    cfg, bad = _config(tmp_path, case)
    with pytest.raises(SpecError) as e:
        load_catalog(cfg)
    assert e.value.message.startswith(f"{bad}"), e.value.message
    assert CASES[case] in e.value.message, e.value.message


@pytest.mark.parametrize("case", ["spec as a list", "not UTF-8", "symlink loop"])
def test_up_says_it_in_one_line_and_exits_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    monkeypatch.setenv("SUBSTRATE_DATA_DIR", str(tmp_path / "var"))
    monkeypatch.delenv("SUBSTRATE_API__AUTH_TOKEN", raising=False)
    cfg, bad = _config(tmp_path, case)
    r = up_on_a_taken_port(cfg)  # were the check missing, `up` would stop at the port check
    assert r.exit_code == 2, r.output
    line = " ".join(r.output.split())
    assert line.startswith(f"error: {bad}") and CASES[case] in line, r.output
    assert "Traceback" not in r.output and not (tmp_path / "var").exists()


def test_up_takes_sigint_from_its_first_moment_even_if_started_ignoring_it(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Fresh-user round 11: `setsid substrate up &` in a script starts it with SIGINT ignored (what a shell
    does to a background job); a `kill -INT` in its first half second was lost and it went on to serve.
    `up` now puts Python's own SIGINT handling back first thing (a Ctrl-C before serving: exit 130)."""
    import signal

    monkeypatch.setenv("SUBSTRATE_DATA_DIR", str(tmp_path / "var"))
    cfg, _ = _config(tmp_path, "not UTF-8")  # `up` stops at the config, after its first statement
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        r = CliRunner().invoke(app, ["up", "--port", "1", "--config", str(cfg)])
        assert r.exit_code == 2, r.output
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, before)


def test_a_folder_with_templates_and_no_pool_names_the_folder(tmp_path: Path) -> None:
    """Fresh-user round 24: it named one template's file (``t.yaml: no WorkerPool is defined``)."""
    (tmp_path / "t.yaml").write_text(OK)
    with pytest.raises(SpecError) as info:
        load_catalog(tmp_path)
    assert str(info.value).startswith(f"no WorkerPool is defined in {tmp_path}: add one"), str(info.value)


@pytest.mark.parametrize("how", ["--config", "SUBSTRATE_CONFIG_DIR"])
def test_a_missing_config_folder_names_the_setting_that_gave_it(tmp_path: Path, how: str) -> None:
    """Fresh-user round 25: "spec path '/x' does not exist (use --config DIR)" named neither where the path
    came from nor, for SUBSTRATE_CONFIG_DIR, the variable."""
    missing = str(tmp_path / "nowhere")
    args, env = (["--config", missing], {}) if how == "--config" else ([], {"SUBSTRATE_CONFIG_DIR": missing})
    r = CliRunner().invoke(app, ["up", "--port", "1", *args], env=env)
    assert r.exit_code == 2 and f"does not exist (the folder of {how})" in r.output, r.output
