# One image for `substrate router`, `substrate controller` and `substrate worker` (deploy/).
# Multi-stage: dependencies from uv.lock (--frozen: the lock is the truth), installed into /app/.venv in a
# builder; the runtime stage copies the venv only and runs as a non-root user (uid 10001, matching the
# Pod securityContexts), with a read-only root filesystem in mind (state lives under /var/lib/substrate
# and /tmp, both volumes on Kubernetes).
#
#   docker build -t ghcr.io/agent-substrate/substrate:0.1.0 .
#
# Not built in this repository's CI (its machines have no Docker engine); see docs/kubernetes.md.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS builder
COPY --from=ghcr.io/astral-sh/uv:0.5 /uv /usr/local/bin/uv
ENV UV_COMPILE_BYTECODE=1 UV_LINK_MODE=copy UV_PYTHON_DOWNLOADS=never
WORKDIR /app
# dependencies first (cached layer), then the project itself, both from the lock
COPY pyproject.toml uv.lock README.md ./
RUN uv sync --frozen --no-dev --no-install-project --no-editable
COPY substrate ./substrate
COPY api ./api
COPY workers ./workers
COPY snapshot ./snapshot
COPY loadtest ./loadtest
RUN uv sync --frozen --no-dev --no-editable

FROM ${PYTHON_IMAGE} AS runtime
# bubblewrap + libseccomp2: the per-session sandbox (and its seccomp filter) inside worker Pods; tini: PID 1 that forwards SIGTERM
RUN apt-get update \
 && apt-get install -y --no-install-recommends bubblewrap libseccomp2 tini \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --gid 10001 substrate \
 && useradd --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin substrate \
 && mkdir -p /var/lib/substrate && chown 10001:10001 /var/lib/substrate
COPY --from=builder /app/.venv /app/.venv
ENV PATH=/app/.venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    SUBSTRATE_DATA_DIR=/var/lib/substrate
USER 10001:10001
WORKDIR /var/lib/substrate
EXPOSE 8080 8081 8090
ENTRYPOINT ["/usr/bin/tini", "--", "substrate"]
CMD ["--help"]
