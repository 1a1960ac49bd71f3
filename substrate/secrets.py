"""Credentials an ActorTemplate asks for, resolved per activation and handed to the agent's environment.

A template names them the Kubernetes way::

    env:
      - name: OPENAI_API_KEY
        valueFrom: {secretKeyRef: {name: model-keys, key: openai}}

The worker resolves each reference when it activates a session, from files under ``auth.secrets_dir``
(the layout of a mounted Kubernetes Secret): ``<dir>/<tenant>/<name>/<key>`` first (a tenant's own
credentials), then ``<dir>/<name>/<key>`` (shared by every tenant). The values go into the agent's
environment only: never into the session record, the API's answers, a log line or a snapshot (the
snapshot holds the workspace and the agent's own state), and they are read afresh on every activation,
so a rotated Secret takes effect at the next wake. A reference that cannot be resolved fails the
activation (``SecretUnavailable``, 422 ``secret_unavailable``) unless ``secretKeyRef.optional`` is true.
"""

from __future__ import annotations

import re
from pathlib import Path

from substrate.errors import SubstrateError
from substrate.models import EnvVar

_SAFE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9\-_.]{0,252})$")


class SecretUnavailable(SubstrateError):
    status, code = 422, "secret_unavailable"


def resolve_env(env: list[EnvVar], *, tenant: str, secrets_dir: Path | None) -> dict[str, str]:
    """Values of the ``valueFrom.secretKeyRef`` entries of ``env`` for ``tenant`` (name -> value).

    Raises ``SecretUnavailable`` for a missing, unreadable or malformed reference that is not optional."""
    out: dict[str, str] = {}
    for e in env:
        ref = (e.valueFrom or {}).get("secretKeyRef")
        if not isinstance(ref, dict):
            continue
        name, key, optional = str(ref.get("name", "")), str(ref.get("key", "")), bool(ref.get("optional"))
        if not (_SAFE.match(name) and _SAFE.match(key)) or ".." in name or ".." in key:
            raise SecretUnavailable(f"env {e.name}: bad secretKeyRef {name!r}/{key!r}")
        value = None
        if secrets_dir is not None:
            for path in (Path(secrets_dir) / tenant / name / key, Path(secrets_dir) / name / key):
                try:
                    value = path.read_text().rstrip("\n")
                    break
                except (FileNotFoundError, NotADirectoryError):
                    continue
                except OSError as err:
                    raise SecretUnavailable(f"env {e.name}: cannot read secret {name}/{key}: {err}") from err
        if value is None:
            if optional:
                continue
            raise SecretUnavailable(f"env {e.name}: secret {name}/{key} not found for tenant {tenant!r}")
        out[e.name] = value
    return out
