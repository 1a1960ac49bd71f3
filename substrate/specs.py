"""Load ActorTemplate and WorkerPool specs from YAML files (the local mode's stand-in for the CRDs).

A folder holds any number of ``*.yaml``/``*.yml`` files, each with one or more documents of kind
``ActorTemplate`` or ``WorkerPool``; other kinds are ignored (so one file can also hold Kubernetes
objects). Errors name the file, document index and field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import yaml
from pydantic import ValidationError

from substrate.errors import InvalidInput
from substrate.models import ActorTemplate, WorkerPool


class SpecError(InvalidInput):
    code = "invalid_spec"


@dataclass
class Catalog:
    """The templates and pools the control plane knows, by name."""

    templates: dict[str, ActorTemplate] = field(default_factory=dict)
    pools: dict[str, WorkerPool] = field(default_factory=dict)

    def template(self, name: str) -> ActorTemplate:
        """The template called ``name``; ``InvalidInput(code="unknown_template")`` if none."""
        try:
            return self.templates[name]
        except KeyError:
            known = ", ".join(sorted(self.templates)) or "none"
            raise InvalidInput(f"unknown actorTemplate {name!r} (known: {known})",
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


def load_documents(docs: list[dict], source: str = "<memory>") -> Catalog:
    """Build a catalog from already-parsed YAML documents. Raises ``SpecError``."""
    cat = Catalog()
    for i, doc in enumerate(docs):
        if not isinstance(doc, dict):
            continue
        kind = doc.get("kind")
        try:
            if kind == "ActorTemplate":
                t = ActorTemplate.model_validate(doc)
                cat.templates[t.name] = t
            elif kind == "WorkerPool":
                p = WorkerPool.model_validate(doc)
                cat.pools[p.name] = p
        except ValidationError as e:
            errs = "; ".join(f"{'.'.join(map(str, er['loc']))}: {er['msg']}" for er in e.errors())
            raise SpecError(f"{source} document {i} ({kind}): {errs}") from e
    return cat


def load_catalog(path: Path | str) -> Catalog:
    """Read every YAML file in folder ``path`` (or the single file ``path``). Raises ``SpecError``."""
    path = Path(path)
    if not path.exists():
        raise SpecError(f"spec path {str(path)!r} does not exist")
    files = [path] if path.is_file() else sorted([*path.glob("*.yaml"), *path.glob("*.yml")])
    cat = Catalog()
    for f in files:
        try:
            docs = list(yaml.safe_load_all(f.read_text()))
        except yaml.YAMLError as e:
            raise SpecError(f"{f}: not valid YAML: {e}") from e
        part = load_documents(docs, str(f))
        cat.templates.update(part.templates)
        cat.pools.update(part.pools)
    if not cat.templates:
        raise SpecError(f"no ActorTemplate found in {path}")
    cat.validate()
    return cat
