"""An ActorTemplate whose ``spec.entrypoint`` names a module that cannot be imported is refused when the
embedded default loads its config (user trial: ``entrypoint: nosuch.module:Agent`` loaded, and only the
first create failed, 500 ``agent_start_failed``). The check finds the module without importing it (no agent
code runs in the control plane), and is not made for catalogs whose workers may run another image
(Kubernetes, ``substrate router --files``): ``substrate.specs``' docstring says why."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from substrate.settings import EXAMPLES_DIR
from substrate.specs import SpecError, load_catalog, load_documents, module_findable
from tests.cli_up import up_on_a_taken_port

POOL = "apiVersion: substrate.agent.dev/v1\nkind: WorkerPool\nmetadata: {name: default}\nspec: {replicas: 1, slots: 2}\n"
TEMPLATE = "---\napiVersion: substrate.agent.dev/v1\nkind: ActorTemplate\nmetadata: {name: %s}\nspec: {entrypoint: '%s'}\n"


def _config(tmp_path: Path, *templates: tuple[str, str]) -> Path:
    cfg = tmp_path / "config"
    cfg.mkdir()
    (cfg / "pool.yaml").write_text(POOL)
    (cfg / "templates.yaml").write_text("".join(TEMPLATE % t for t in templates))
    return cfg


def test_a_missing_entrypoint_module_is_refused_naming_the_file_template_and_module(tmp_path: Path) -> None:
    cfg = _config(tmp_path, ("counter", "workers.agents.counter:Counter"), ("broken", "nosuch.module:Agent"))
    with pytest.raises(SpecError) as e:
        load_catalog(cfg, check_modules=True)
    assert e.value.code == "agent_module_not_found"
    msg = e.value.message
    assert str(cfg / "templates.yaml") in msg and "ActorTemplate 'broken'" in msg
    assert "module 'nosuch.module' cannot be found" in msg and "counter" not in msg


def test_without_the_check_the_catalog_loads_as_before(tmp_path: Path) -> None:
    """Templates read from the Kubernetes API (``load_documents``) and a router's files are not checked:
    the module may be in the workers' image only."""
    cfg = _config(tmp_path, ("broken", "nosuch.module:Agent"))
    assert "broken" in load_catalog(cfg).templates
    doc = {"apiVersion": "substrate.agent.dev/v1", "kind": "ActorTemplate", "metadata": {"name": "broken"},
           "spec": {"entrypoint": "nosuch.module:Agent"}}
    assert "broken" in load_documents([doc]).templates


def test_the_shipped_examples_pass_the_check() -> None:
    assert "counter" in load_catalog(EXAMPLES_DIR, check_modules=True).templates


def test_module_findable_imports_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = tmp_path / "agentpkg_probe"
    (pkg / "sub").mkdir(parents=True)
    marker = tmp_path / "imported"
    (pkg / "__init__.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    (pkg / "sub" / "__init__.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    (pkg / "sub" / "agent.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert module_findable("agentpkg_probe.sub.agent")
    assert module_findable("agentpkg_probe.sub")
    assert not module_findable("agentpkg_probe.sub.nosuch")
    assert not module_findable("agentpkg_probe.sub.agent.deeper")  # a module is no package
    assert not marker.exists() and not any(m.startswith("agentpkg_probe") for m in sys.modules)
    assert module_findable("workers.agents.counter") and module_findable("json.decoder")
    for name in ("nosuch", "nosuch.module", "workers.nosuch", "", "a..b"):
        assert not module_findable(name), name


def test_up_with_such_a_config_is_one_error_line_and_exit_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SUBSTRATE_DATA_DIR", str(tmp_path / "var"))
    monkeypatch.delenv("SUBSTRATE_API__AUTH_TOKEN", raising=False)
    cfg = _config(tmp_path, ("broken", "nosuch.module:Agent"))
    r = up_on_a_taken_port(cfg)  # were the check missing, `up` would stop at the port check
    assert r.exit_code == 2, r.output
    lines = r.output.strip().splitlines()
    assert lines[0].startswith("error: ") and "'broken'" in r.output and "'nosuch.module'" in r.output, r.output
    assert "Traceback" not in r.output
    assert not (tmp_path / "var").exists()  # nothing was started


def test_a_module_only_the_runtime_can_import_is_refused_for_a_sandboxed_template(tmp_path: Path, monkeypatch) -> None:
    """User trial: ``myagent.py`` in the checkout (on the runtime's path through the editable install)
    passed the check, and every create failed with ModuleNotFoundError inside the sandbox, which sees
    only the installed packages and ``workers``. A template that opts out of the sandbox runs its host
    with the runtime's path, so the module is found for it."""
    (tmp_path / "mod").mkdir()
    (tmp_path / "mod" / "myagent_fu.py").write_text("class MyAgent: pass\n")
    monkeypatch.syspath_prepend(str(tmp_path / "mod"))
    assert module_findable("myagent_fu") and not module_findable("myagent_fu", sandboxed=True)
    assert module_findable("workers.agents.counter", sandboxed=True)
    assert module_findable("json", sandboxed=True) and module_findable("sys", sandboxed=True)
    cfg = _config(tmp_path, ("mine", "myagent_fu:MyAgent"))
    with pytest.raises(SpecError) as e:
        load_catalog(cfg, check_modules=True)
    assert e.value.code == "agent_module_not_found" and "sandbox" in e.value.message
    (cfg / "templates.yaml").write_text("---\napiVersion: substrate.agent.dev/v1\nkind: ActorTemplate\n"
                                        "metadata: {name: mine}\nspec: {entrypoint: 'myagent_fu:MyAgent', "
                                        "isolation: {sandbox: false}}\n")
    assert "mine" in load_catalog(cfg, check_modules=True).templates


def test_up_with_a_misspelt_kind_is_one_error_line_and_exit_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fresh-user round 6: ``kind: ActorTemplat`` was skipped (a log line), so ``up`` said only ``no
    ActorTemplate found``; now the line names the file, the kind and the kinds there are."""
    monkeypatch.setenv("SUBSTRATE_DATA_DIR", str(tmp_path / "var"))
    monkeypatch.delenv("SUBSTRATE_API__AUTH_TOKEN", raising=False)
    cfg = _config(tmp_path, ("counter", "workers.agents.counter:Counter"))
    (cfg / "typo.yaml").write_text("apiVersion: substrate.agent.dev/v1\nkind: ActorTemplat\nmetadata: {name: t}\n")
    r = up_on_a_taken_port(cfg)  # were the check missing, `up` would stop at the port check
    assert r.exit_code == 2, r.output
    line = " ".join(r.output.split())  # the console may wrap the one line
    assert line.startswith(f"error: {cfg / 'typo.yaml'} document 1: kind 'ActorTemplat' is not a kind of "
                           "substrate.agent.dev/v1 (its kinds: ActorTemplate, WorkerPool): did you mean "
                           "ActorTemplate?"), r.output
    assert "Traceback" not in r.output and not (tmp_path / "var").exists()


def test_a_class_the_module_does_not_define_is_refused_with_the_closest_name(tmp_path: Path) -> None:
    """Fresh-user round 11: ``entrypoint: workers.agents.counter:NoSuchClass`` started, and the first create
    failed 500 ``agent_start_failed``. The module's source is read (never run) for the name."""
    cfg = _config(tmp_path, ("typo", "workers.agents.counter:Countr"))
    with pytest.raises(SpecError) as e:
        load_catalog(cfg, check_modules=True)
    assert e.value.code == "agent_class_not_found"
    assert "ActorTemplate 'typo'" in e.value.message and "defines no 'Countr' (did you mean 'Counter'?)" in e.value.message


def test_module_names_reads_top_level_bindings_without_running_the_module(tmp_path: Path) -> None:
    from substrate.specs import module_names

    src = tmp_path / "m.py"
    src.write_text("import os.path\nfrom json import loads as L\nraise SystemExit('never run')\n"
                   "class A: pass\nasync def f(): pass\nB = C = 1\nD: int = 2\n"
                   "try:\n    from fast import E\nexcept ImportError:\n    class E: pass\n"
                   "if True:\n    G = 3\nwith open('x') as H: pass\nfor I in (): pass\n"
                   "def g():\n    INNER = 1\nclass K:\n    NESTED = 1\n")
    assert module_names(str(src)) == {"os", "L", "A", "f", "B", "C", "D", "E", "G", "H", "I", "g", "K"}
    src.write_text("from x import *\nclass A: pass\n")
    assert module_names(str(src)) is None, "a * import: the names cannot be told"
    src.write_text("def __getattr__(name): ...\n")
    assert module_names(str(src)) is None, "a module __getattr__ can give any name"
    src.write_text("def broken(:\n")
    assert module_names(str(src)) is None
    assert module_names(None) is None and module_names(str(tmp_path / "ext.so")) is None
    # every shipped agent's class is found
    cfg = _config(tmp_path, ("c", "workers.agents.counter:Counter"), ("s", "workers.agents.shell:Shell"),
                  ("n", "workers.agents.notebook:Notebook"))
    assert set(load_catalog(cfg, check_modules=True).templates) == {"c", "s", "n"}


def test_a_template_asking_for_gpus_on_a_machine_without_any_is_warned_about_locally(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fresh-user run: ``resources: {gpus: 1}`` ran on the local pool with no GPU and no word. The local
    load (``check_modules``) warns per such template when no ``nvidia-smi`` is on the PATH; a machine that
    has one, and the Kubernetes load (GPUs come from ResourceClaims there), say nothing."""
    cfg = _config(tmp_path, ("counter", "workers.agents.counter:Counter"))
    (cfg / "gpu.yaml").write_text(TEMPLATE.replace("spec: {", "spec: {resources: {gpus: 2}, ")
                                  % ("trainer", "workers.agents.counter:Counter"))
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    got = [w for w in load_catalog(cfg, check_modules=True).warnings if "GPU" in w]
    assert got == ["ActorTemplate 'trainer' asks for 2 GPU(s) (spec.resources.gpus), but this machine shows none "
                   "(no nvidia-smi): the local runtime runs its sessions without a GPU (GPUs are allocated on "
                   "Kubernetes only; here `gpus` counts toward maxGpus quotas)"]
    assert not [w for w in load_catalog(cfg).warnings if "GPU" in w], "not checked where workers run elsewhere"
    smi = empty / "nvidia-smi"
    smi.write_text("#!/bin/sh\n")
    smi.chmod(0o755)
    assert not [w for w in load_catalog(cfg, check_modules=True).warnings if "GPU" in w]
