"""`substrate convert` refuses what is not a Kubernetes-style document with exit 2 and a one-line error
(fresh-user run: /etc/passwd printed nothing with exit 0; deeply nested input printed a traceback), and
writes no fixed ``replicas`` next to ``autoscaling`` (user trial: it added the default, ``replicas: 2``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from substrate.cli import app


@pytest.mark.parametrize("content, message", [
    ("root:x:0:0:root:/root:/bin/bash\n", "no Kubernetes-style documents"),
    ("[" * 5000 + "]" * 5000, "nested too deeply"),
    ("", "no Kubernetes-style documents"),
    # one line, as `up` says it (fresh-user tester 51: PyYAML's six lines with a caret)
    ("apiVersion: v1\nkind: [unclosed\n", "not valid YAML: expected ',' or ']', but got '<stream end>' at line 3, "
                                         "column 1 (while parsing a flow sequence at line 2, column 7)"),
    # counts over the CRDs' int32 (fresh-user tester 51: printed as they were, exit 0)
    ("kind: WorkerPool\nmetadata: {name: p}\nspec: {slots: 4, replicas: 2147483648}\n", "less than or equal to 2147483647"),
    ("kind: WorkerPool\nmetadata: {name: p}\nspec: {autoscaling: {maxReplicas: 1099511627776}}\n",
     "less than or equal to 2147483647"),
    ("kind: WorkerPool\nmetadata: {name: p}\nspec: {warmPool: {readyReplicas: 99999999999999999999999}}\n",
     "less than or equal to 2147483647"),
    # a repeated key: YAML keeps the last, and the first spec's limits went without a word (fresh-user run)
    ("kind: ActorTemplate\nmetadata: {name: x}\nspec: {isolation: {maxMemory: 64Mi}}\nspec: {entrypoint: 'a:B'}\n",
     "key 'spec' at line 4, column 1 appears twice in one mapping (first at line 3, column 1)"),
    # two on one line, in a flow mapping (fresh-user round 8: compared by line, they were one key)
    ("kind: ActorTemplate\nmetadata: {name: x}\nspec: {entrypoint: 'a:B', entrypoint: 'c:D'}\n",
     "key 'entrypoint' at line 3, column 27 appears twice in one mapping (first at line 3, column 8)"),
    # a YAML alias bomb: 1.7 KB that expands to a billion nodes (fresh-user run 36: 10.6 MB out at six levels)
    ('l0: &l0 ["x","x","x","x","x","x","x","x","x","x"]\nl1: &l1 [*l0,*l0,*l0,*l0,*l0,*l0,*l0,*l0,*l0,*l0]\nl2: &l2 [*l1,*l1,*l1,*l1,*l1,*l1,*l1,*l1,*l1,*l1]\nl3: &l3 [*l2,*l2,*l2,*l2,*l2,*l2,*l2,*l2,*l2,*l2]\nl4: &l4 [*l3,*l3,*l3,*l3,*l3,*l3,*l3,*l3,*l3,*l3]\nl5: &l5 [*l4,*l4,*l4,*l4,*l4,*l4,*l4,*l4,*l4,*l4]\nl6: &l6 [*l5,*l5,*l5,*l5,*l5,*l5,*l5,*l5,*l5,*l5]\nl7: &l7 [*l6,*l6,*l6,*l6,*l6,*l6,*l6,*l6,*l6,*l6]\nl8: &l8 [*l7,*l7,*l7,*l7,*l7,*l7,*l7,*l7,*l7,*l7]\n', "expands to more than 1,000,000 nodes through its aliases"),
])
def test_bad_files_exit_2_with_one_line(tmp_path: Path, content: str, message: str) -> None:
    f = tmp_path / "in.yaml"
    f.write_text(content)
    r = CliRunner().invoke(app, ["convert", str(f)])
    assert r.exit_code == 2, r.output
    assert message in r.output and "Traceback" not in r.output
    assert len([x for x in r.output.splitlines() if x.strip()]) == 1, r.output
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



@pytest.mark.parametrize("api, kind, warning", [
    ("v1", "ConfgMap", "v1 has no kind ConfgMap in the Kubernetes API this tool knows (a typo?)"),
    ("apps/v1", "Deploymnet", "apps/v1 has no kind Deploymnet"),
    ("apps/v1beta1", "Deployment", "apps/v1beta1 is not an API version of the Kubernetes API this tool knows"),
])
def test_a_kubernetes_kind_or_version_its_api_lacks_is_passed_through_with_a_warning(
        tmp_path: Path, api: str, kind: str, warning: str) -> None:
    """Fresh-user review: ``apiVersion: v1, kind: Foo`` went through without a word (kubectl refuses it
    only at apply time)."""
    f = tmp_path / "typo.yaml"
    f.write_text(f"apiVersion: {api}\nkind: {kind}\nmetadata: {{name: x}}\n")
    r = CliRunner().invoke(app, ["convert", str(f)])
    assert r.exit_code == 0, r.output
    assert f"kind: {kind}" in r.output and warning in r.output and "passed through unchanged" in r.output


@pytest.mark.parametrize("api, kind", [
    ("v1", "Event"), ("events.k8s.io/v1", "Event"),  # one kind, two groups: the client's core_v1_/events_v1_
    ("autoscaling/v2", "HorizontalPodAutoscaler"), ("storage.k8s.io/v1", "CSIDriver"),
    ("apiregistration.k8s.io/v1", "APIService"), ("resource.k8s.io/v1", "DeviceClass"),
    ("v1", "List"),  # kubectl's own
    ("gateway.networking.k8s.io/v1", "Gateway"),  # a CRD's group the client does not serve: not judged
])
def test_real_kubernetes_kinds_get_no_typo_warning(tmp_path: Path, api: str, kind: str) -> None:
    f = tmp_path / "ok.yaml"
    f.write_text(f"apiVersion: {api}\nkind: {kind}\nmetadata: {{name: x}}\n")
    r = CliRunner().invoke(app, ["convert", str(f)])
    assert r.exit_code == 0 and "Kubernetes API this tool knows" not in r.output, r.output


def test_a_v1alpha2_claim_no_pool_uses_is_dropped_with_a_warning(tmp_path: Path) -> None:
    """Fresh-user run: ``convert`` of the seed's DRA section printed the DeviceClass only; its
    ResourceClaim vanished without a word. A claim a pool of the same file uses is folded into it."""
    claim = ("apiVersion: resource.k8s.io/v1alpha2\nkind: ResourceClaim\nmetadata: {name: gpu-claim}\n"
             "spec: {resourceClassName: nvidia-gpu}\n")
    f = tmp_path / "claim.yaml"
    f.write_text(claim)
    r = CliRunner().invoke(app, ["convert", str(f)])
    assert r.exit_code == 0, r.output
    assert "ResourceClaim gpu-claim:" in r.output and "dropped" in r.output
    used = tmp_path / "used.yaml"
    used.write_text(claim + "---\n" + POOL_DOC + "  slots: 2\n  resourceClaims:\n  - name: g\n"
                    "    source: {resourceClaimName: gpu-claim}\n")
    r = CliRunner().invoke(app, ["convert", str(used)])
    assert r.exit_code == 0, r.output
    assert "gpu-claim: resource.k8s.io/v1alpha2 is served by no" not in r.output

POOL_DOC = "apiVersion: substrate.agent.dev/v1\nkind: WorkerPool\nmetadata: {name: p}\nspec:\n"
AUTOSCALING = "  autoscaling: {minReplicas: 1, maxReplicas: 20, targetUtilization: 70}\n"
HPA = ("  autoscaling:\n    minReplicas: 2\n    maxReplicas: 20\n    metrics:\n    - type: Resource\n"
       "      resource: {name: cpu, target: {type: Utilization, averageUtilization: 60}}\n")


def _convert(tmp_path: Path, text: str) -> tuple[dict, str]:
    f = tmp_path / "pool.yaml"
    f.write_text(text)
    r = CliRunner().invoke(app, ["convert", str(f)])
    assert r.exit_code == 0, r.output
    # the warnings go to stderr, which CliRunner mixes into the output: the document starts at apiVersion
    doc = yaml.safe_load(r.output[r.output.index("apiVersion:"):])
    return doc, r.output


@pytest.mark.parametrize("spec, replicas", [
    (AUTOSCALING, None),                      # user trial: `replicas: 2` (the default) was added
    ("  replicas: 100\n" + AUTOSCALING, None),  # the seed's 4.3 pool: ignored by the autoscaler, so left out
    (HPA, None),                              # the HPA writes it through /scale: no default is added
    ("  replicas: 200\n" + HPA, 200),         # the seed's 5.2 pool: its size until the HPA first scales it
    ("  replicas: 3\n", 3),                   # no autoscaling: the fixed size stays
])
def test_a_pool_with_autoscaling_gets_no_fixed_replicas(tmp_path: Path, spec: str, replicas: int | None) -> None:
    from substrate.pool import desired_replicas
    from substrate.specs import load_documents

    doc, output = _convert(tmp_path, POOL_DOC + spec)
    assert doc["spec"].get("replicas") == replicas, output
    if "autoscaling" in spec:
        assert doc["spec"]["autoscaling"]["maxReplicas"] == 20
    if replicas == 200:
        assert "each apply resets the HPA's choice" in output
    # what the converted document asks for is what the original asked for
    before = load_documents([yaml.safe_load(POOL_DOC + spec)], log_warnings=False).pools["p"].spec
    after = load_documents([doc], log_warnings=False).pools["p"].spec
    for busy in (0, 5, 50, 500):
        assert desired_replicas(after, busy) == desired_replicas(before, busy), busy


def test_a_dash_reads_standard_input() -> None:
    """Fresh-user run: ``substrate convert -`` looked for a file named ``-``."""
    doc = "apiVersion: substrate.agent.dev/v1\nkind: WorkerPool\nmetadata: {name: p}\nspec: {slots: 4}\n"
    r = CliRunner().invoke(app, ["convert", "-"], input=doc)
    assert r.exit_code == 0, r.output
    assert yaml.safe_load(r.stdout)["kind"] == "WorkerPool"


def test_a_container_only_template_is_warned_about(tmp_path: Path) -> None:
    """Fresh-user round 6: the seed's ``claude-code-agent`` (only ``spec.container``) converted without a
    word, and every create of it was then refused (400 ``unsupported_template``)."""
    f = tmp_path / "t.yaml"
    f.write_text("apiVersion: substrate.agent.dev/v1\nkind: ActorTemplate\nmetadata: {name: boxed}\n"
                 "spec: {container: {image: 'example/agent:1'}}\n---\n"
                 "apiVersion: substrate.agent.dev/v1\nkind: ActorTemplate\nmetadata: {name: ok}\n"
                 "spec: {entrypoint: 'workers.agents.counter:Counter'}\n")
    r = CliRunner().invoke(app, ["convert", str(f)])
    assert r.exit_code == 0, r.output
    assert "ActorTemplate boxed: has only spec.container: creates of it will be refused" in r.output
    assert "ActorTemplate ok:" not in r.output


def test_the_help_says_where_the_seed_documents_are() -> None:
    """Fresh-user round 6: the help said "the seed article's documents" without saying what or where."""
    r = CliRunner().invoke(app, ["convert", "--help"], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())
    assert "tests/k8s/seed/" in text and "seed article's" not in text, text


def test_other_yaml_beside_kubernetes_style_documents_is_left_out_with_a_warning(tmp_path: Path) -> None:
    """Fresh-user round 8: a ConfigMap and a plain mapping in one file was "no Kubernetes-style documents",
    exit 2, while `up` skips such a document with a warning. Now the same here, never quoting it."""
    f = tmp_path / "mixed.yaml"
    f.write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n---\nfoo: secret-ish\n---\n- a\n")
    r = CliRunner().invoke(app, ["convert", str(f)])
    assert r.exit_code == 0, r.output
    assert [d["kind"] for d in yaml.safe_load_all(r.stdout)] == ["ConfigMap"]
    assert f"{f} document 2 is a mapping without kind, not a Kubernetes-style document; left out" in r.stderr
    assert f"{f} document 3 is a YAML list, string or number" in r.stderr and "secret-ish" not in r.stderr


def test_a_kind_list_is_converted_item_by_item(tmp_path: Path) -> None:
    """Fresh-user round 13: a ``kind: List`` (what ``kubectl get -o yaml`` prints) went through untouched:
    the seed's apiVersion and ``runtimeClass`` stayed, and an invalid pool inside it passed, exit 0."""
    root = Path(__file__).resolve().parents[2]
    seed = [d for d in yaml.safe_load_all((root / "tests/k8s/seed/section-4-3.yaml").read_text()) if d]
    f = tmp_path / "list.yaml"
    f.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": seed}))
    r = CliRunner().invoke(app, ["convert", str(f)])
    assert r.exit_code == 0, r.output
    out = [d for d in yaml.safe_load_all(r.stdout) if d]
    assert {d["kind"] for d in out} >= {"WorkerPool", "ActorTemplate"} and "List" not in {d["kind"] for d in out}
    assert all(d["apiVersion"] == "substrate.agent.dev/v1" for d in out if d["kind"] in ("WorkerPool", "ActorTemplate"))
    pod = next(d for d in out if d["kind"] == "WorkerPool")["spec"]["template"]["spec"]
    assert pod.get("runtimeClassName") == "gvisor" and "runtimeClass" not in pod, pod
    assert "mapped to substrate.agent.dev/v1" in r.stderr
    f.write_text("apiVersion: v1\nkind: List\nitems:\n- apiVersion: substrate.agent.dev/v1\n  kind: WorkerPool\n"
                 "  metadata: {name: p}\n  spec: {replicas: -1}\n")
    r = CliRunner().invoke(app, ["convert", str(f)])
    assert r.exit_code == 2 and "spec.replicas" in r.output, r.output


def test_a_few_aliases_still_load() -> None:
    """Anchors and aliases as manifests use them (a shared block referred to a few times) still load."""
    from substrate.specs import parse_yaml_documents

    docs = parse_yaml_documents("base: &b {cpu: 1, env: [a, b]}\nx: *b\ny: *b\n")
    assert docs == [{"base": {"cpu": 1, "env": ["a", "b"]}, "x": {"cpu": 1, "env": ["a", "b"]},
                     "y": {"cpu": 1, "env": ["a", "b"]}}]
