"""`substrate convert` refuses what is not a Kubernetes-style document with exit 2 and a one-line error
(fresh-user run: /etc/passwd printed nothing with exit 0; deeply nested input printed a traceback)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from substrate.cli import app


@pytest.mark.parametrize("content, message", [
    ("root:x:0:0:root:/root:/bin/bash\n", "no Kubernetes-style documents"),
    ("[" * 5000 + "]" * 5000, "nested too deeply"),
    ("", "no Kubernetes-style documents"),
    ("a: [1\n", "error"),
])
def test_bad_files_exit_2_with_one_line(tmp_path: Path, content: str, message: str) -> None:
    f = tmp_path / "in.yaml"
    f.write_text(content)
    r = CliRunner().invoke(app, ["convert", str(f)])
    assert r.exit_code == 2, r.output
    assert message in r.output and "Traceback" not in r.output
    assert r.exception is None or isinstance(r.exception, SystemExit)


def test_a_seed_style_document_converts(tmp_path: Path) -> None:
    f = tmp_path / "pool.yaml"
    f.write_text("apiVersion: substrate.agent.dev/v1\nkind: WorkerPool\nmetadata: {name: p}\nspec: {slots: 4}\n")
    r = CliRunner().invoke(app, ["convert", str(f)])
    assert r.exit_code == 0 and "kind: WorkerPool" in r.output


def test_a_kind_nothing_here_acts_on_is_passed_through_with_a_warning(tmp_path: Path) -> None:
    """Fresh-user review: an agent-sandbox ``Sandbox`` went through without a word."""
    f = tmp_path / "mixed.yaml"
    f.write_text("apiVersion: agents.x-k8s.io/v1alpha1\nkind: Sandbox\nmetadata: {name: sb}\nspec: {}\n---\n"
                 "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: cm}\n---\n"
                 "apiVersion: substrate.agent.dev/v1\nkind: ActorTemplate\nmetadata: {name: t}\n"
                 "spec: {entrypoint: 'workers.agents.counter:Counter'}\n")
    r = CliRunner().invoke(app, ["convert", str(f)])
    assert r.exit_code == 0, r.output
    assert "kind: Sandbox" in r.output and "kind: ConfigMap" in r.output  # both still passed through
    assert "Sandbox sb: agents.x-k8s.io/v1alpha1 Sandbox is not a kind of this runtime" in r.output
    assert "ConfigMap cm:" not in r.output, "no warning for a Kubernetes kind"
