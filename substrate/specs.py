"""Load ActorTemplate and WorkerPool specs from YAML files (the local mode's stand-in for the CRDs).

A folder holds any number of ``*.yaml``/``*.yml`` files, each with one or more documents of kind
``ActorTemplate`` or ``WorkerPool``; documents of other API groups are ignored (so one file can also hold
Kubernetes objects), and one that is not a mapping or has neither ``apiVersion`` nor ``kind`` (another
tool's YAML) is skipped with a warning, while another kind of our group (a typo such as ``ActorTemplat``)
is an error. Errors name the file, document index and field.

**Entrypoint modules.** ``load_catalog(..., check_modules=True)`` also checks that the module of every
template's ``spec.entrypoint`` (``module:Class``) can be found by this Python (``module_findable``: the
import system's finders, without importing the module or any package above it, so no agent code runs in
the control plane), and refuses the folder with ``SpecError`` code ``agent_module_not_found`` naming the
file, the template and the module. A user trial's ``entrypoint: nosuch.module:Agent`` loaded fine and only
failed at the first create, with 500 ``agent_start_failed``. The class is looked for in the module's
source too (``module_names``: read with ``ast``, not run; code ``agent_class_not_found``, naming the closest
name the module binds). Only the embedded default asks for the
check (``substrate up``, and ``api.runtime`` when it builds an embedded runtime from files): there the
workers are forked from the same interpreter and site-packages, so a module this process cannot find is
one no agent host can import. For a sandboxed template (the default) the module is looked up only where
its sandbox looks: the installed packages and our ``workers`` package (``sandbox_import_path``), not the
current folder or a project folder an editable install puts on this process's path (a user trial's
``myagent.py`` beside the checkout passed a check on the whole path and failed every create). It is not made where the workers may run another image:
templates read from the Kubernetes API (``substrate.k8s.controller.KubeCatalog``, which uses
``load_documents``), ``substrate router --files`` and ``substrate convert`` (whose output is for
``kubectl apply``): a WorkerPool's pod template may name an image built FROM ours that adds the agent's
package (docs/kubernetes.md), which the router's and controller's image does not hold. There a missing
module is still found at the first create (500 ``agent_start_failed``, the message naming the module).
``spec.command`` and ``spec.container`` templates are not checked (a command is resolved by the worker's
``PATH``, an image by the kubelet).
"""

from __future__ import annotations

import copy
import functools
import importlib.machinery
import importlib.util
import logging
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from substrate.errors import InvalidInput, clip
from substrate.models import API_GROUP, API_VERSION, ActorTemplate, WorkerPool

log = logging.getLogger(__name__)

#: the API group the seed article (002) uses; documents in it load with a warning per translated field
SEED_GROUPS = {"substrate.agent.google.com"}


class SpecError(InvalidInput):
    code = "invalid_spec"


@dataclass
class Catalog:
    """The templates and pools the control plane knows, by name."""

    templates: dict[str, ActorTemplate] = field(default_factory=dict)
    pools: dict[str, WorkerPool] = field(default_factory=dict)
    #: what loading translated or ignored, one sentence each (also logged)
    warnings: list[str] = field(default_factory=list)

    def template(self, name: str) -> ActorTemplate:
        """The template called ``name``; ``InvalidInput(code="unknown_template")`` if none."""
        try:
            return self.templates[name]
        except KeyError:
            known = ", ".join(sorted(self.templates)) or "none"
            raise InvalidInput(f"unknown actorTemplate {clip(name)} (known: {clip(known, 300, quote=False)})",
                               code="unknown_template") from None

    def pool_for(self, template: ActorTemplate) -> WorkerPool:
        """The pool that hosts ``template``: ``spec.workerPool`` or, if unset, the first pool."""
        if template.spec.workerPool:
            pool = self.pools.get(template.spec.workerPool)
            if pool is None:
                raise InvalidInput(f"template {template.name!r} names unknown workerPool "
                                   f"{template.spec.workerPool!r}", code="unknown_pool")
            return pool
        if not self.pools:
            raise InvalidInput("no WorkerPool is defined", code="unknown_pool")
        return next(iter(self.pools.values()))

    def validate(self) -> None:
        """Check cross-references (every template's pool exists)."""
        for t in self.templates.values():
            self.pool_for(t)


def _quantity(where: str, value: Any) -> None:
    from kubernetes.utils.quantity import parse_quantity  # lazy: importing kubernetes costs ~1 s

    try:
        parse_quantity(value)
    except (ValueError, TypeError):
        raise ValueError(f"{where}: {value!r} is not a Kubernetes quantity (e.g. 500m, 2, 4Gi)") from None


def _check_pod_spec(spec: dict[str, Any], seed: bool, warn: list[str]) -> None:
    """Typos that Kubernetes would reject, and quantities, in a pool's ``spec.template.spec``."""
    if "runtimeClass" in spec:
        if not seed:
            raise ValueError("spec.template.spec.runtimeClass is not a Pod field: did you mean runtimeClassName?")
        spec["runtimeClassName"] = spec.pop("runtimeClass")
        warn.append("spec.template.spec.runtimeClass is not a Pod field: did you mean runtimeClassName? "
                    f"(used as runtimeClassName: {spec['runtimeClassName']!r})")
    # the pod template is passed through untyped (``dict[str, Any]``): a wrong shape met here is said with
    # its field path, not as the AttributeError it raises (fresh-user review: `containers: "notalist"`)
    for key in ("containers", "initContainers"):
        where = f"spec.template.spec.{key}"
        items = spec.get(key)
        if items is None:
            continue
        if not isinstance(items, list):
            raise ValueError(f"{where}: must be a list (got a {_yaml_type(items)})")
        for i, c in enumerate(items):
            if not isinstance(c, dict):
                raise ValueError(f"{where}[{i}]: must be a mapping (got a {_yaml_type(c)})")
            res_node = c.get("resources")
            if res_node is None:
                continue
            if not isinstance(res_node, dict):
                raise ValueError(f"{where}[{i}].resources: must be a mapping (got a {_yaml_type(res_node)})")
            for kind in ("limits", "requests"):
                node = res_node.get(kind)
                if node is None:
                    continue
                if not isinstance(node, dict):
                    raise ValueError(f"{where}[{i}].resources.{kind}: must be a mapping (got a {_yaml_type(node)})")
                for res, q in node.items():
                    _quantity(f"container {c.get('name')!r} resources.{kind}.{res}", q)


def normalize(doc: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Map a WorkerPool/ActorTemplate document onto our schema: (document, warnings).

    * ``apiVersion`` ``substrate.agent.dev/v1`` is ours; the seed's ``substrate.agent.google.com/v1`` maps to
      it with a warning, and so do the seed's spellings below; anything else is refused.
    * WorkerPool: ``template.spec.runtimeClass`` -> refused in our group ("did you mean runtimeClassName"),
      translated with a warning in the seed's; ``resourceClaims[].source`` (v1alpha2 shape) is flattened;
      ``autoscaling.metrics`` is handed to a HorizontalPodAutoscaler the controller creates (the built-in
      autoscaler then steps aside); ``spec.replicas`` next to ``spec.autoscaling`` (without metrics) is
      ignored with a warning; quantities are parsed.
    * ActorTemplate: ``isolation.maxCpu``/``maxMemory`` are parsed as quantities; a
      ``stateManagement.snapshotStorage`` is recorded with a warning (sessions are stored where their pool's
      workers store them).
    Raises ``ValueError`` naming the field.
    """
    doc = copy.deepcopy(doc)
    warn: list[str] = []
    kind = doc.get("kind")
    api_version = str(doc.get("apiVersion") or API_VERSION)
    group, _, version = api_version.rpartition("/")
    seed = group in SEED_GROUPS
    if seed:
        warn.append(f"apiVersion {api_version} mapped to {API_GROUP}/{version}")
        doc["apiVersion"] = f"{API_GROUP}/{version}"
    elif group != API_GROUP:
        raise ValueError(f"apiVersion {api_version!r}: use {API_VERSION}")
    if version != "v1":
        raise ValueError(f"apiVersion {api_version!r}: only version v1 exists")
    spec = doc.get("spec") or {}
    if kind == "WorkerPool":
        tpl_spec = (spec.get("template") or {}).get("spec")
        if isinstance(tpl_spec, dict):
            _check_pod_spec(tpl_spec, seed, warn)
        pod_claims = (tpl_spec or {}).get("resourceClaims") if isinstance(tpl_spec, dict) else None
        for where, claims in (("spec.resourceClaims", spec.get("resourceClaims")),
                              ("spec.template.spec.resourceClaims", pod_claims)):
            for c in claims or []:
                src = c.pop("source", None) if isinstance(c, dict) else None
                if src:
                    c.update(src)
                    warn.append(f"{where}[{c.get('name')}].source is the removed v1alpha2 shape: "
                                f"flattened to {', '.join(sorted(src))}")
        auto = spec.get("autoscaling")
        if isinstance(auto, dict):
            if auto.get("metrics"):
                warn.append("autoscaling.metrics: the pool is scaled by a HorizontalPodAutoscaler the controller "
                            "creates with these metrics (through /scale); the built-in slot autoscaler steps aside")
            elif "replicas" in spec:
                warn.append(f"spec.replicas ({spec['replicas']}) is ignored while spec.autoscaling is set: the "
                            "autoscaler keeps the pool between minReplicas and maxReplicas")
    elif kind == "ActorTemplate":
        iso = spec.get("isolation") or {}
        for f in ("maxCpu", "maxMemory"):
            if iso.get(f) is not None:
                _quantity(f"spec.isolation.{f}", iso[f])
        # accepted for the seed's YAML, but nothing applies them per template: say so, or a template with
        # runtimeClass: gvisor reads as if its agents ran under gVisor (fresh-user tester 51)
        if isinstance(iso, dict) and iso.get("runtimeClass"):
            warn.append(f"isolation.runtimeClass ({iso['runtimeClass']}) is not applied per template: each session "
                        "runs in its worker's bubblewrap sandbox; to run the workers under a RuntimeClass, set "
                        "runtimeClassName in the WorkerPool's Pod template (deploy/components/gvisor)")
        if isinstance(iso, dict) and iso.get("networkPolicy"):
            warn.append(f"isolation.networkPolicy ({iso['networkPolicy']}) is not applied per template: a session's "
                        "network is isolation.network (none, loopback or egress); NetworkPolicies select worker "
                        "Pods (deploy/base/networkpolicy.yaml)")
        sm = spec.get("stateManagement") or {}
        if sm.get("snapshotStorage"):
            from substrate.k8s.snapshot_uri import parse_storage_uri

            parse_storage_uri(sm["snapshotStorage"])
            warn.append("stateManagement.snapshotStorage is not applied per template: sessions are stored in their "
                        "WorkerPool's snapshotStorage on Kubernetes, and in the runtime's store (SUBSTRATE_SNAPSHOT__*) "
                        "under substrate up")
    return doc, warn


def _v1alpha2_claims(docs: list[Any], source: str) -> dict[str, tuple[dict[str, Any], list[str]]]:
    """Seed ``resource.k8s.io/v1alpha2`` ResourceClaims among ``docs``: name -> (accelerators, notes)."""
    from substrate.k8s.dra import translate_v1alpha2_claim

    out = {}
    for i, d in enumerate(docs, 1):  # numbered from 1, as an editor counts them
        if isinstance(d, dict) and d.get("apiVersion") == "resource.k8s.io/v1alpha2" and d.get("kind") == "ResourceClaim":
            try:
                out[(d.get("metadata") or {}).get("name")] = translate_v1alpha2_claim(d)
            except ValueError as e:
                raise SpecError(f"{source} document {i} (ResourceClaim v1alpha2): {e}") from e
    return out


def _use_v1alpha2_claims(doc: dict[str, Any], claims: dict[str, tuple[dict[str, Any], list[str]]]) -> list[str]:
    """A pool referencing a translated v1alpha2 claim gets ``spec.accelerators`` from it (each worker its own
    claim from the compiled ResourceClaimTemplate, count kept) instead of the removed object."""
    warn: list[str] = []
    spec = doc.get("spec") or {}
    tpl_spec = (spec.get("template") or {}).get("spec") or {}
    for holder in (spec, tpl_spec):
        kept = []
        for c in holder.get("resourceClaims") or []:
            name = c.get("resourceClaimName")
            if name in claims:
                acc, notes = claims[name]
                spec["accelerators"] = dict(acc)
                warn += notes
                warn.append(f"resourceClaims[{c.get('name')}] -> spec.accelerators {acc} (one claim per worker Pod)")
                for ctr in tpl_spec.get("containers") or []:
                    rc = (ctr.get("resources") or {}).get("claims")
                    if rc:
                        ctr["resources"]["claims"] = [x for x in rc if x.get("name") != c.get("name")]
            else:
                kept.append(c)
        if "resourceClaims" in holder:
            holder["resourceClaims"] = kept
    return warn


#: the kinds of our API group (and of the seed's, which maps to it)
KINDS = ("ActorTemplate", "WorkerPool")


def _is_ours(doc: dict[str, Any]) -> bool:
    """Whether ``doc`` is of our API group or the seed's; one without ``apiVersion`` is ours too, as
    ``normalize`` reads it."""
    if not doc.get("apiVersion"):
        return True
    group = str(doc["apiVersion"]).rpartition("/")[0]
    return group == API_GROUP or group in SEED_GROUPS


def _unknown_kind(kind: Any, api_version: Any) -> str:
    """The one line for a document of our group whose ``kind`` is none of ours: the kinds we know and
    the closest, if one is close (``ActorTemplat``, ``actortemplate``)."""
    from substrate.settings import closest

    known = ", ".join(KINDS)
    if kind is None:
        return f"no kind (the kinds of {api_version or API_VERSION}: {known})"
    close = closest(str(kind).lower(), [k.lower() for k in KINDS], cutoff=0.6)
    hint = f": did you mean {next(k for k in KINDS if k.lower() == close)}?" if close else ""
    api = api_version or f"{API_VERSION} (read so: no apiVersion)"
    return f"kind {clip(kind, 60)} is not a kind of {api} (its kinds: {known}){hint}"


def _yaml_type(value: Any) -> str:
    """``'text'`` -> ``string``, ``[1]`` -> ``list``: what a YAML reader calls a document's type."""
    return {str: "string", list: "list", bool: "boolean", int: "number", float: "number"}.get(type(value),
                                                                                          type(value).__name__)


def load_documents(docs: list[Any], source: str = "<memory>", *, log_warnings: bool = True) -> Catalog:
    """Build a catalog from already-parsed YAML documents (mappings; ``None``, an empty document, is
    skipped). Documents of other API groups are skipped (Kubernetes objects beside ours); one that is not a
    mapping (a string, a list) or has neither ``apiVersion`` nor ``kind`` is skipped with a warning.
    Raises ``SpecError``: also for a kind of our group (or the seed's) that is not ``ActorTemplate`` or
    ``WorkerPool`` (the message names the kinds and the closest one), as a wrong version is. Translations and ignored fields are in ``Catalog.warnings`` (see
    ``normalize``), also logged unless ``log_warnings`` is false."""
    cat = Catalog()
    docs = expand_lists(docs)
    v1alpha2 = _v1alpha2_claims(docs, source)
    for i, doc in enumerate(docs, 1):  # numbered from 1, as an editor counts them
        if doc is None:  # an empty document (a trailing ``---``, a file of comments)
            continue
        if not isinstance(doc, dict) or not (doc.get("apiVersion") or doc.get("kind")):
            # a string, a list or a mapping with neither apiVersion nor kind was skipped without a word
            # (fresh-user round 6). Said, not refused: a config folder may hold another tool's YAML (a
            # list of API keys for SUBSTRATE_AUTH__API_KEYS_FILE, say)
            # its type only, never its content: such a file may hold secrets (an API keys list did, and
            # the warning logged most of a key: fresh-user round 8)
            what = f"a YAML {_yaml_type(doc)}" if not isinstance(doc, dict) else \
                "a mapping with neither apiVersion nor kind"
            msg = (f"{source} document {i} is {what}, not an object of ours ({', '.join(KINDS)}, with "
                   f"apiVersion {API_VERSION}); ignored")
            cat.warnings.append(msg)
            if log_warnings:
                log.warning(msg)
            continue
        kind = doc.get("kind")
        if kind not in KINDS:
            if _is_ours(doc):
                raise SpecError(f"{source} document {i}: {_unknown_kind(kind, doc.get('apiVersion'))}")
            continue  # another group's (Kubernetes objects beside ours): not ours to judge here
        try:
            if "metadata" in doc and doc["metadata"] is None:
                doc = {**doc, "metadata": {}}  # ``metadata:`` left empty: said as its missing name
            try:
                doc, warns = normalize(doc)
            except (AttributeError, TypeError) as e:
                # a field of the wrong shape (a list where a mapping belongs) met by the translation before
                # the schema check: the schema names the field (a fresh-user run: `spec:` as a list was an
                # AttributeError traceback)
                (ActorTemplate if kind == "ActorTemplate" else WorkerPool).model_validate(doc)
                raise ValueError(f"a field has the wrong type ({e})") from None
            if kind == "WorkerPool" and v1alpha2:
                warns += _use_v1alpha2_claims(doc, v1alpha2)
            if kind == "ActorTemplate":
                t = ActorTemplate.model_validate(doc)
                if t.name in cat.templates:
                    raise SpecError(f"{source} document {i}: ActorTemplate {t.name!r} is defined twice")
                cat.templates[t.name] = t
                warns += _unknown_field_warnings(t.spec)
                zero = [k for k in ("maxRunning", "maxTotal", "maxCreatesPerMinute")
                        if t.spec.quota is not None and getattr(t.spec.quota, k) == 0]
                if zero:
                    # it loads (a template closed on purpose), but said once here, as a pool that starts no
                    # worker is: every create of it is refused (fresh-user round 10)
                    warns.append(f"has spec.quota.{zero[0]} 0: every tenant's creates of it are refused (429 "
                                 "quota_*) until it is raised")
                if not t.spec.isolation.sandbox:
                    # it loads (the opt-out is documented), but said at start: such an agent sees the machine
                    # (fresh-user round 14: one ran as root and read the runtime's Redis password)
                    warns.append("has isolation.sandbox false: its agents run without namespaces or the "
                                 "seccomp filter and see this machine's files, processes and network, as "
                                 "their slot's unprivileged uid (as the runtime's user if that uid cannot run "
                                 "this Python: the worker's log says so)")
                if not (t.spec.entrypoint or t.spec.command):
                    # it loads (the seed's template is one), but every create of it is refused by the API:
                    # said once here, at start, not first at a create (fresh-user run with the seed)
                    warns.append("has only spec.container: creates of it will be refused (400 "
                                 "unsupported_template): workers here run an agent's spec.entrypoint "
                                 "(module:Class) or spec.command; add one")
            else:
                p = WorkerPool.model_validate(doc)
                if p.name in cat.pools:
                    raise SpecError(f"{source} document {i}: WorkerPool {p.name!r} is defined twice")
                cat.pools[p.name] = p
                warns += _unknown_field_warnings(p.spec)
                if p.spec.replicas == 0 and p.spec.autoscaling is None:
                    # it loads (a pool paused on purpose), but said once here: its creates are refused
                    warns.append("has spec.replicas 0 and no spec.autoscaling: it starts no worker, and creates "
                                 "of its templates are refused (503 no_capacity) until one is set")
        except ValidationError as e:
            model = ActorTemplate if kind == "ActorTemplate" else WorkerPool
            errs = "; ".join(_validation_error(er, model) for er in e.errors())
            raise SpecError(f"{source} document {i} ({kind}): {errs}") from e
        except ValueError as e:
            raise SpecError(f"{source} document {i} ({kind}): {e}") from e
        name = (doc.get("metadata") or {}).get("name")
        for w in warns:
            msg = f"{source} {kind} {name}: {w}"
            cat.warnings.append(msg)
            if log_warnings:
                log.warning(msg)
    return cat


#: how alike (``difflib`` ratio) an unknown field and a known one of the same object must be for the
#: unknown one to be a typo of it, refused: ``stateManagment``/``stateManagement`` 0.97, ``netwrk``/``network``
#: 0.92, ``gpu``/``gpus`` 0.86; below this, down to difflib's 0.6, the warning only asks
TYPO_RATIO = 0.8


def _unknown_field_warnings(spec: Any) -> list[str]:
    """The warnings for the unknown fields of ``spec`` (``_unknown_fields``), each naming the closest known
    field of its object when one is somewhat alike (``maxIdle``: did you mean ``maxIdleTime``?). Raises
    ``ValueError`` for an unknown field this close (``TYPO_RATIO``) to a known one: a typo such as
    ``stateManagment`` left that part's defaults in use with only a warning, while ``quota.maxTotl`` was
    refused (fresh-user round 6). The seed's documents have no such field."""
    from substrate.settings import closest

    warns = []
    for where, known in _unknown_fields(spec, "spec"):
        name = where.rpartition(".")[2]
        if close := closest(name, known, cutoff=TYPO_RATIO):
            raise ValueError(f"{where} is not a field here: did you mean {close!r}? (as written it would be "
                             "ignored and the defaults used)")
        close = closest(name, known, cutoff=0.6)
        warns.append(f"unknown field {where} is not used by this runtime (a typo?"
                     + (f" did you mean {close!r}?)" if close else ")"))
    return warns


def _validation_error(er: Any, model: Any) -> str:
    """One pydantic error of a spec document as ``loc: message``; a field that a part refusing unknown
    fields (``spec.quota``) does not have also gets the closest field it has, or the list of them:
    ``spec.quota.maxTotl`` was "Extra inputs are not permitted" and nothing more (fresh-user round 8)."""
    from substrate.settings import closest, fields_at

    where = ".".join(map(str, er["loc"]))
    if er.get("type") in ("model_type", "dict_type"):
        # pydantic says "a valid dictionary or instance of ActorTemplateSpec": our class names mean nothing
        # to the YAML's author
        got = "empty" if er.get("input") is None else f"a {_yaml_type(er.get('input'))}"
        return f"{where}: must be a mapping (field: value), not {got}"
    if er.get("type") != "extra_forbidden":
        return f"{where}: {er['msg']}"
    known = fields_at(er["loc"], root=model)
    close = closest(str(er["loc"][-1]), known, cutoff=0.6)
    hint = f"did you mean {close!r}?" if close else f"the fields here are {', '.join(known)}"
    return f"{where}: not a field here ({hint})"


def _unknown_fields(model: Any, path: str) -> list[tuple[str, list[str]]]:
    """The fields in ``model`` (and the models inside it) that no schema field names, as (dotted path, the
    field names that object has): the spec models keep unknown fields (seed documents carry fields of
    their own), so a typo such as ``stateManagment`` was ignored without a word (fresh-user run 2).
    Free-form parts (a Pod template, HPA metrics) are plain dicts and are not walked."""
    from pydantic import BaseModel

    known = [f.alias or n for n, f in type(model).model_fields.items()]
    out = [(f"{path}.{k}", known) for k in sorted(getattr(model, "model_extra", None) or {})]
    for name in type(model).model_fields:
        v = getattr(model, name, None)
        for j, item in enumerate(v if isinstance(v, list) else [v]):
            if isinstance(item, BaseModel):
                out += _unknown_fields(item, f"{path}.{name}" + (f"[{j}]" if isinstance(v, list) else ""))
    return out


def _clean(doc: dict[str, Any]) -> dict[str, Any]:
    """Drop what the API server fills in (generation) and empty collections from a dumped document."""
    doc["metadata"].pop("generation", None)

    def strip(x: Any) -> Any:
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if v not in ({}, [], None)}
        if isinstance(x, list):
            return [strip(v) for v in x]
        return x

    return strip(doc)


def expand_lists(docs: list[Any]) -> list[Any]:
    """``docs`` with each ``apiVersion: v1, kind: List`` document (what ``kubectl get -o yaml`` prints)
    replaced by its ``items``, nested lists too; every other document as it is. A List went through
    ``substrate convert`` untranslated and unchecked (fresh-user round 13)."""
    out: list[Any] = []
    for d in docs:
        if isinstance(d, dict) and d.get("kind") == "List" and d.get("apiVersion") == "v1" \
                and isinstance(d.get("items"), list):
            out.extend(expand_lists(d["items"]))
        else:
            out.append(d)
    return out


def convert_documents(docs: list[Any], source: str = "<memory>") -> tuple[list[dict[str, Any]], list[str]]:
    """Documents as our API server takes them (``substrate convert``): WorkerPools/ActorTemplates
    normalised (seed spellings translated), v1alpha2 ResourceClasses -> v1 DeviceClasses, v1alpha2
    ResourceClaims folded into the pools that use them (``spec.accelerators``), other kinds unchanged.
    A WorkerPool with ``spec.autoscaling`` gets no ``spec.replicas`` it did not have (the model's default,
    2, was written next to ``autoscaling``: a user-trial finding), and loses the one it had when the
    built-in autoscaler sizes it (the value is ignored then, ``normalize`` warns); with HPA ``metrics`` a
    written ``replicas`` is kept (the pool's size until the HPA first writes ``/scale``) with a warning
    that re-applying it resets the HPA's choice. Returns (documents, warnings). Raises ``SpecError``."""
    from substrate.k8s.dra import translate_v1alpha2_class

    docs = expand_lists(docs)
    cat = load_documents(docs, source)
    out: list[dict[str, Any]] = []
    warnings = list(cat.warnings)
    referenced = _claims_referenced(docs)
    for d in docs:
        if not isinstance(d, dict):
            continue
        kind, api = d.get("kind"), d.get("apiVersion")
        name = (d.get("metadata") or {}).get("name")
        if kind in ("WorkerPool", "ActorTemplate"):
            obj = (cat.pools if kind == "WorkerPool" else cat.templates)[name]
            dumped = _clean(obj.model_dump(mode="json", exclude={"status"}, exclude_none=True))
            if isinstance(obj, WorkerPool) and obj.spec.autoscaling is not None:
                written = (d.get("spec") or {}).get("replicas")
                if obj.spec.autoscaling.metrics and written is not None:
                    warnings.append(f"{source} WorkerPool {name}: spec.replicas ({written}) is kept as the pool's "
                                    "size until the HorizontalPodAutoscaler first scales it; leave it out of what "
                                    "you apply again, or each apply resets the HPA's choice")
                else:
                    dumped["spec"].pop("replicas", None)
            out.append(dumped)
        elif api == "resource.k8s.io/v1alpha2" and kind == "ResourceClass":
            try:
                out.append(translate_v1alpha2_class(d))
            except ValueError as e:
                raise SpecError(f"{source} ResourceClass {name}: {e}") from e
            warnings.append(f"{source} ResourceClass {name}: v1alpha2 -> resource.k8s.io/v1 DeviceClass "
                            f"(parameters {sorted((d.get('parameters') or {}))} have no v1 meaning and are dropped)")
        elif api == "resource.k8s.io/v1alpha2" and kind == "ResourceClaim":
            # folded into the pools that reference it (see _use_v1alpha2_claims); no cluster of today
            # serves v1alpha2, so one no pool uses is dropped too, but not without a word (fresh-user run)
            if name not in referenced:
                warnings.append(f"{source} ResourceClaim {name}: resource.k8s.io/v1alpha2 is served by no current "
                                "Kubernetes and no WorkerPool in this file uses this claim: dropped (a pool "
                                "that names it in resourceClaims gets its devices as spec.accelerators)")
            continue
        else:
            out.append(d)
            # passed through as it is; a kind of no Kubernetes API group (``v1``, ``apps/v1``,
            # ``*.k8s.io``) is one nothing here acts on (e.g. agent-sandbox's ``agents.x-k8s.io``
            # ``Sandbox``): say so rather than pass it on without a word
            group = str(api).partition("/")[0] if "/" in str(api) else ""
            if not (group == "" or "." not in group or group.endswith(".k8s.io")):
                warnings.append(f"{source} {kind} {name}: {api} {kind} is not a kind of this runtime; passed "
                                "through unchanged (kubectl applies it to whatever serves it)")
            elif (why := unknown_kubernetes_kind(str(api), str(kind))) is not None:
                # a Kubernetes group, but a kind (or version) its API does not have: most often a typo
                # (``Deploymnet``) that kubectl would refuse only at apply time (fresh-user review)
                warnings.append(f"{source} {kind} {name}: {why}; passed through unchanged")
    return out, warnings


def _claims_referenced(docs: list[Any]) -> set[str]:
    """The ``resourceClaimName`` s the WorkerPools among ``docs`` name (in ``spec.resourceClaims`` or
    their Pod template's, directly or in v1alpha2's ``source``)."""
    out: set[str] = set()
    for d in docs:
        if isinstance(d, dict) and d.get("kind") == "WorkerPool":
            spec = d.get("spec") or {}
            for holder in (spec, ((spec.get("template") or {}).get("spec") or {})):
                for c in holder.get("resourceClaims") or []:
                    if isinstance(c, dict):  # the v1alpha2 spelling nests it in ``source``
                        n = c.get("resourceClaimName") or (c.get("source") or {}).get("resourceClaimName")
                        if n:
                            out.add(str(n))
    return out


def _snake(kind: str) -> str:
    """``HorizontalPodAutoscaler`` -> ``horizontal_pod_autoscaler``, ``CSIDriver`` -> ``csi_driver``: the
    file names of the Kubernetes Python client's generated models."""
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", kind).lower()


@functools.lru_cache(maxsize=1)
def _kubernetes_client_modules() -> tuple[frozenset[str], frozenset[str]]:
    """(API modules, model modules) of the installed Kubernetes Python client, by file name without
    ``.py`` (``apps_v1_api``...; ``v1_pod``, ``core_v1_event``, ``v2_horizontal_pod_autoscaler``...),
    read from its folders without importing it (its models package imports ~850 modules); both empty
    when the client is not installed or not readable."""
    spec = importlib.util.find_spec("kubernetes")
    if spec is None or not spec.submodule_search_locations:
        return frozenset(), frozenset()
    client = Path(next(iter(spec.submodule_search_locations))) / "client"
    try:
        return tuple(frozenset(f[:-3] for f in os.listdir(client / sub) if f.endswith(".py"))  # type: ignore[return-value]
                     for sub in ("api", "models"))
    except OSError:
        return frozenset(), frozenset()


def unknown_kubernetes_kind(api_version: str, kind: str) -> str | None:
    """What is wrong with ``kind`` at ``api_version`` (``v1``, ``apps/v1``, ``autoscaling/v2``), judged
    against the installed Kubernetes Python client (its API and model modules, ``_kubernetes_client_modules``),
    or None: a version of a group the client serves that it does not have (``apps/v1beta1``), or a kind
    that version has no model for (``Deploymnet``). A group the client does not serve (a CRD's, e.g.
    ``gateway.networking.k8s.io``; ``kustomize.config.k8s.io``) is never judged, nor is ``List``
    (kubectl's own). A kind two groups share (``Event``) counts for either."""
    apis, models = _kubernetes_client_modules()
    group, _, version = api_version.rpartition("/")
    g = "core" if not group else group.removesuffix(".k8s.io").replace(".", "_").replace("-", "_")
    if not apis or kind == "List" or f"{g}_api" not in apis:
        return None
    if f"{g}_{version}_api" not in apis:
        return f"{api_version} is not an API version of the Kubernetes API this tool knows"
    name = f"{version}_{_snake(kind)}"
    if name in models or any(m.endswith("_" + name) for m in models):
        return None
    return f"{api_version} has no kind {kind} in the Kubernetes API this tool knows (a typo?)"


#: the package of ours an agent host sees inside its sandbox (``workers.sandbox``: bound at ``CODE_PATH``)
_SANDBOX_PACKAGE = "workers"


def sandbox_import_path() -> list[str]:
    """The entries of this interpreter's ``sys.path`` that a sandboxed agent host also has: those inside
    the interpreter's installation (``sys.prefix``, ``sys.base_prefix``: the stdlib and site-packages,
    which ``workers.sandbox`` binds read-only). Not the current folder, nor a project folder that an
    editable install's ``.pth`` adds (a user trial: ``entrypoint: myagent:MyAgent`` beside the checkout
    passed the check and failed every create with ``ModuleNotFoundError`` in the sandbox)."""
    roots = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix)}
    out = []
    for p in sys.path:
        real = os.path.realpath(p or ".")
        if any(real == r or real.startswith(r + os.sep) for r in roots):
            out.append(p)
    return out


def module_findable(name: str, *, sandboxed: bool = False) -> bool:
    """Whether the module ``name`` (dotted, as in an entrypoint) can be found on this interpreter's import
    path (``sandboxed``: only on the part a sandboxed agent host has, :func:`sandbox_import_path`, plus
    our ``workers`` package), without importing it or any package above it: ``importlib.util.find_spec("a.b")``
    imports ``a`` (running its ``__init__``), so each level below the top one is looked up with
    ``PathFinder`` in the search locations of the level above. Modules already imported count as found
    (unsandboxed only). Never raises."""
    return _module_spec(name, sandboxed=sandboxed) is not None


def _module_spec(name: str, *, sandboxed: bool = False) -> Any:
    """:func:`module_findable`'s lookup: the module's ``ModuleSpec``, the module itself when it is already
    imported (unsandboxed only), or None when it cannot be found."""
    parts = name.split(".")
    if not all(parts):
        return None
    try:
        if sandboxed and parts[0] != _SANDBOX_PACKAGE:
            if parts[0] in sys.builtin_module_names:
                spec = importlib.util.find_spec(parts[0])
            else:
                spec = importlib.machinery.PathFinder.find_spec(parts[0], sandbox_import_path())
        elif name in sys.modules:
            return sys.modules[name]
        else:
            spec = importlib.util.find_spec(parts[0])  # the top level: no parent to import
        for i in range(1, len(parts)):
            if spec is None or spec.submodule_search_locations is None:  # missing, or a module, not a package
                return None
            full = ".".join(parts[: i + 1])
            found = importlib.machinery.PathFinder.find_spec(full, list(spec.submodule_search_locations))
            if found is None and not sandboxed and ".".join(parts[:i]) in sys.modules:
                found = importlib.util.find_spec(full)  # the parent is imported already: its own finders may know
            spec = found
    except (ImportError, ValueError, AttributeError, OSError):
        return None
    return spec


def module_names(origin: str | None) -> set[str] | None:
    """The names a Python source file binds at its top level (classes, functions, assignments, imports,
    also inside top-level ``if``/``try``/``with``/``for`` blocks), read with ``ast``, without running it;
    None when they cannot be told that way: no ``.py`` source, unreadable or unparsable, a ``from x import
    *``, or a module ``__getattr__``."""
    import ast

    if not origin or not origin.endswith(".py"):
        return None
    try:
        tree = ast.parse(Path(origin).read_bytes(), origin)
    except (OSError, SyntaxError, ValueError):
        return None
    names: set[str] = set()
    todo: list[ast.stmt] = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for a in node.names:
                if a.name == "*":
                    return None
                names.add(a.asname or a.name.split(".")[0])
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.For, ast.AsyncFor, ast.With,
                               ast.AsyncWith)):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if not isinstance(node, (ast.With, ast.AsyncWith)) else \
                [i.optional_vars for i in node.items if i.optional_vars is not None]
            for t in targets:
                names.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
        if isinstance(node, (ast.If, ast.Try, ast.For, ast.AsyncFor, ast.While, ast.With, ast.AsyncWith)) or \
                type(node).__name__ == "TryStar":
            for part in ("body", "orelse", "finalbody"):
                todo.extend(getattr(node, part, []) or [])
            for h in getattr(node, "handlers", []) or []:
                todo.extend(h.body)
    return None if "__getattr__" in names else names


def check_entrypoint_modules(templates: dict[str, ActorTemplate], where: dict[str, Path | str]) -> None:
    """Raise ``SpecError`` (code ``agent_module_not_found``) if the module of a template's
    ``spec.entrypoint`` cannot be found by this Python (``module_findable``); the message names each such
    template, its file (``where``, by template name) and the module. See the module docstring for where
    this check is made and why not on Kubernetes. Then, code ``agent_class_not_found``, if the module's
    source (read with ``ast``, never run: :func:`module_names`) binds no such name at its top level, with
    the closest name it does bind; a module whose names cannot be told that way (a ``*`` import, a module
    ``__getattr__``, no ``.py`` source) passes."""
    import difflib

    missing, no_class = [], []
    for name, t in templates.items():
        entry = t.spec.entrypoint
        sandboxed = t.spec.isolation.sandbox
        if not entry:
            continue
        module, _, cls = entry.partition(":")
        found = _module_spec(module, sandboxed=sandboxed)
        if found is None:
            missing.append(f"{where.get(name, '<memory>')}: ActorTemplate {name!r}: spec.entrypoint {entry!r}: "
                           f"module {module!r} cannot be found by this Python ({sys.executable})"
                           + (" in what its sandbox sees (the installed packages and `workers`; not the "
                              "current folder or a project folder)" if sandboxed else ""))
            continue
        # the class too, read from the module's source (never run here): a typo in it passed, and every
        # create failed 500 agent_start_failed (fresh-user round 11)
        origin = getattr(found, "origin", None) or getattr(found, "__file__", None)
        names = module_names(origin)
        if names is not None and cls.split(".")[0] not in names:
            close = difflib.get_close_matches(cls.split(".")[0], sorted(names), n=1)
            no_class.append(f"{where.get(name, '<memory>')}: ActorTemplate {name!r}: spec.entrypoint {entry!r}: "
                            f"module {module!r} ({origin}) defines no {cls.split('.')[0]!r}"
                            + (f" (did you mean {close[0]!r}?)" if close else ""))
    if missing:
        raise SpecError("; ".join(missing) + ": install the package that holds it into this environment (the "
                        "workers run the same interpreter) or fix the name", code="agent_module_not_found")
    if no_class:
        raise SpecError("; ".join(no_class), code="agent_class_not_found")


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key repeated in one mapping (``_no_repeated_keys``)."""


def _no_repeated_keys(loader: yaml.SafeLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    """A mapping, refusing a key it holds twice: YAML readers keep the last silently, so a second
    ``spec:`` dropped the first one's limits without a word (a fresh-user run: ``maxMemory: 64Mi`` gone,
    the default 1Gi in force). Raises ``yaml.constructor.ConstructorError`` naming the key and both lines."""
    seen: dict[Any, yaml.Mark] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":  # ``<<``: its keys may be overridden, by design
            continue
        key = loader.construct_object(key_node, deep=True)
        try:
            first = seen.setdefault(key, key_node.start_mark)
        except TypeError:  # an unhashable key: the constructor below says what is wrong with it
            continue
        if first is not key_node.start_mark:  # by place, not line: a flow mapping holds both on one line
            raise yaml.constructor.ConstructorError(  # no mark: one line, the places said in it
                None, None, f"key {key!r} at line {key_node.start_mark.line + 1}, column "
                f"{key_node.start_mark.column + 1} appears twice in one mapping (first at line {first.line + 1}, "
                f"column {first.column + 1}); YAML would keep only the last")
    return loader.construct_mapping(node, deep=True)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _no_repeated_keys)


#: the most nodes a document may hold once its aliases are expanded (a YAML "billion laughs": a 1.7 KB file
#: of six levels of aliases is 10.6 MB written out, nine levels did not finish: fresh-user run 36; go-yaml,
#: behind kubectl, refuses such "excessive aliasing" too). Large real manifests hold a few ten thousand
MAX_EXPANDED_NODES = 1_000_000


def _expanded_nodes(doc: Any) -> int:
    """How many nodes ``doc`` holds with every alias written out (a shared object counted once per
    reference), computed once per distinct object: linear in the document as parsed, not as expanded."""
    memo: dict[int, int] = {}

    def size(o: Any) -> int:
        if not isinstance(o, (dict, list)):
            return 1
        got = memo.get(id(o))
        if got is None:
            items = [x for kv in o.items() for x in kv] if isinstance(o, dict) else o
            got = memo[id(o)] = 1 + sum(size(x) for x in items)
        return got

    return size(doc)


def parse_yaml_documents(text: str) -> list[Any]:
    """Every document of the YAML ``text`` (``None`` for an empty one), as ``yaml.safe_load_all`` reads
    them but refusing a key repeated in one mapping and a document that its aliases expand past
    ``MAX_EXPANDED_NODES``. Raises ``yaml.YAMLError``."""
    docs = list(yaml.load_all(text, Loader=_UniqueKeyLoader))
    for i, doc in enumerate(docs, 1):
        try:
            n = _expanded_nodes(doc)
        except RecursionError:
            n = MAX_EXPANDED_NODES + 1
        if n > MAX_EXPANDED_NODES:
            raise yaml.YAMLError(f"document {i} expands to more than {MAX_EXPANDED_NODES:,} nodes through its "
                                 "aliases (*name): refused, as a YAML alias bomb would be; write it out or "
                                 "use fewer aliases")
    return docs


def yaml_problem(e: yaml.YAMLError) -> str:
    """One line for a YAML parser's error: the problem, where (1-based line and column) and in what it
    was found (PyYAML's own text spans several lines with excerpts of the file; the start-up error is
    one line)."""
    problem, mark = getattr(e, "problem", None), getattr(e, "problem_mark", None)
    if not problem:
        return " ".join(str(e).split())
    out = problem + (f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "")
    context, cmark = getattr(e, "context", None), getattr(e, "context_mark", None)
    if context:
        out += f" ({context}" + (f" at line {cmark.line + 1}, column {cmark.column + 1}" if cmark else "") + ")"
    return out


def load_catalog(path: Path | str, *, check_modules: bool = False, log_warnings: bool = True) -> Catalog:
    """Read every YAML file in folder ``path`` (or the single file ``path``). With ``check_modules``, also
    check that every ``spec.entrypoint``'s module can be found (``check_entrypoint_modules``; only where
    the workers share this interpreter: see the module docstring). ``log_warnings`` false: the warnings
    are in ``Catalog.warnings`` only (a reader other than the control plane's own load, which logs them
    once). Raises ``SpecError`` (code ``invalid_spec``, ``unknown_pool``, ``agent_module_not_found`` or
    ``agent_class_not_found``)."""
    path = Path(path)
    if not path.exists():
        raise SpecError(f"spec path {str(path)!r} does not exist")
    files = [path] if path.is_file() else sorted([*path.glob("*.yaml"), *path.glob("*.yml")])
    cat = Catalog()
    where: dict[tuple[str, str], Path] = {}
    for f in files:
        try:
            docs = parse_yaml_documents(f.read_text())
        except yaml.YAMLError as e:
            raise SpecError(f"{f}: not valid YAML: {yaml_problem(e)}") from e
        except UnicodeDecodeError as e:
            raise SpecError(f"{f}: not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start})") from None
        except OSError as e:  # a symlink loop, a folder named *.yaml, no permission
            raise SpecError(f"{f}: cannot be read: {e.strerror or e}") from None
        part = load_documents(docs, str(f), log_warnings=log_warnings)
        # one name, one definition: the last file used to win without a word (fresh-user run)
        for what, mine, theirs in (("ActorTemplate", part.templates, cat.templates), ("WorkerPool", part.pools, cat.pools)):
            for name in mine.keys() & theirs.keys():
                raise SpecError(f"{what} {name!r} is defined in {where[(what, name)]} and again in {f}")
            where.update({(what, name): f for name in mine})
        cat.templates.update(part.templates)
        cat.pools.update(part.pools)
        cat.warnings += part.warnings
    if not cat.templates:
        # what loading ignored may be why (a document without apiVersion/kind): said here, as the warnings
        # of a load that fails are not printed (fresh-user round 16)
        why = "; ".join(cat.warnings[:3]) + (f"; and {len(cat.warnings) - 3} more" if len(cat.warnings) > 3 else "")
        raise SpecError(f"no ActorTemplate found in {path}" + (f" ({why})" if why else ""))
    if not cat.pools:  # the folder's fault, not one template's file (it named a file: fresh-user round 24)
        raise SpecError(f"no WorkerPool is defined in {path}: add one (kind: WorkerPool) beside the "
                        "ActorTemplates", code="unknown_pool")
    for name, t in cat.templates.items():
        try:
            cat.pool_for(t)
        except SpecError:
            raise
        except InvalidInput as e:  # an unknown workerPool: one line at start-up naming the template's file
            raise SpecError(f"{where.get(('ActorTemplate', name), path)}: {e.message}", code=e.code) from None
    if check_modules:
        check_entrypoint_modules(cat.templates, {n: f for (what, n), f in where.items() if what == "ActorTemplate"})
        for msg in local_gpu_warnings(cat.templates):
            cat.warnings.append(msg)
            if log_warnings:
                log.warning(msg)
    return cat


def local_gpu_warnings(templates: dict[str, ActorTemplate]) -> list[str]:
    """For the local runtime (workers on this machine): a warning per template that asks for GPUs
    (``spec.resources.gpus``) when this machine shows none (no ``nvidia-smi``): such sessions run, without a
    GPU (a fresh-user run: a template with ``gpus: 1`` was created RUNNING with no word). GPUs are allocated
    only on Kubernetes (ResourceClaims); locally ``gpus`` counts toward ``maxGpus`` quotas and nothing
    else."""
    import shutil

    asking = sorted(n for n, t in templates.items() if t.spec.resources.gpus)
    if not asking or shutil.which("nvidia-smi") is not None:
        return []
    return [f"ActorTemplate {n!r} asks for {templates[n].spec.resources.gpus} GPU(s) (spec.resources.gpus), but this "
            "machine shows none (no nvidia-smi): the local runtime runs its sessions without a GPU (GPUs are "
            "allocated on Kubernetes only; here `gpus` counts toward maxGpus quotas)" for n in asking]
