"""``substrate router`` (Kubernetes mode) and ``substrate controller`` with no Kubernetes API configured
say so in one line and exit 2 (fresh-user round 13: a 149-line traceback, exit 1, and a JSON-logged one,
exit 3), before anything starts."""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest
from typer.testing import CliRunner

from substrate.cli import app
from substrate.k8s.api import config_problem
from substrate.settings import Settings


@pytest.fixture
def no_cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.kube/config
    for var in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT", "SUBSTRATE_KUBERNETES__API_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SUBSTRATE_REDIS_URL", "redis://127.0.0.1:1/0")
    monkeypatch.setenv("SUBSTRATE_WORKER__INTERNAL_TOKEN", secrets.token_hex(24))


@pytest.mark.parametrize("argv", [["router", "--port", "1"], ["controller", "--port", "1"]])
def test_no_cluster_is_one_line_and_exit_2(no_cluster: None, argv: list[str]) -> None:
    r = CliRunner().invoke(app, argv, env={"COLUMNS": "300"})
    assert r.exit_code == 2, r.output
    assert r.output.startswith("error: no Kubernetes API configured: not in a cluster") and \
        "SUBSTRATE_KUBERNETES__API_URL unset" in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1 and "Traceback" not in r.output


def test_the_router_from_files_needs_no_cluster_and_a_bad_api_url_is_named(no_cluster: None,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    assert config_problem(Settings()) is not None
    monkeypatch.setenv("SUBSTRATE_KUBERNETES__API_URL", "ftp://127.0.0.1:1")
    assert config_problem(Settings()) == "SUBSTRATE_KUBERNETES__API_URL='ftp://127.0.0.1:1' is not an http(s) URL"
    monkeypatch.setenv("SUBSTRATE_KUBERNETES__API_URL", "http://127.0.0.1:1")
    assert config_problem(Settings()) is None, "an API server that is down is waited for, not refused"
    kube = Path(str(Path.home())) / ".kube"
    kube.mkdir()
    (kube / "config").write_text("apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster: {server: "
                                 "'https://127.0.0.1:1'}\ncontexts:\n- name: c\n  context: {cluster: c, user: u}\n"
                                 "current-context: c\nusers:\n- name: u\n  user: {token: t}\n")
    monkeypatch.delenv("SUBSTRATE_KUBERNETES__API_URL")
    assert config_problem(Settings()) is None, "a kubeconfig is enough"


def test_the_controller_warns_when_snapshots_would_stay_on_each_pod(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fresh-user round 13: deploy/overlays/external-redis alone sets no snapshot store, so snapshots went
    to each worker Pod's emptyDir without a word."""
    from api.controller import store_warning

    monkeypatch.delenv("SUBSTRATE_SNAPSHOT__STORE", raising=False)
    assert "lost with the Pod" in (store_warning(Settings()) or "")
    monkeypatch.setenv("SUBSTRATE_SNAPSHOT__STORE", "s3")
    assert store_warning(Settings()) is None
