#!/usr/bin/env bash
# Install the Debian packages the test suite needs when they are missing (CI runs as root).
#   bwrap    (bubblewrap)        agent sandboxes
#   redis-server (redis-server)  embedded directory and Redis Cluster tests
#   kubectl  (kubernetes-client) `kubectl kustomize` renders deploy/
#   promtool (prometheus)        checks the shipped alert rules
#   libseccomp.so.2 (libseccomp2) the agent sandboxes' seccomp filter (workers/syscalls.py)
#   wrk      (wrk)               the benchmarks' load generator (loadtest/wrk.py; its test skips without it)
# Without root (or apt) it prints what is missing and goes on: tests that need a tool skip with a reason,
# except the sandbox (bwrap, libseccomp2), which the runtime refuses to start without (see README "Security model").
set -u
declare -A pkg=([bwrap]=bubblewrap [redis-server]=redis-server [kubectl]=kubernetes-client [promtool]=prometheus [wrk]=wrk)
missing=()
for cmd in "${!pkg[@]}"; do
  command -v "$cmd" >/dev/null 2>&1 || missing+=("${pkg[$cmd]}")
done
# a library, not a command: workers refuse to start sandboxes without it (like without bwrap)
if ! { ldconfig -p 2>/dev/null | grep -q 'libseccomp\.so\.2'; } && ! ls /usr/lib/*/libseccomp.so.2 >/dev/null 2>&1; then
  missing+=(libseccomp2)
fi
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "system-deps: installing ${missing[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y --no-install-recommends "${missing[@]}" >/dev/null 2>&1 \
    || { apt-get update >/dev/null 2>&1 && apt-get install -y --no-install-recommends "${missing[@]}" >/dev/null 2>&1; } \
    || echo "system-deps: could not install ${missing[*]}" >&2
else
  echo "system-deps: missing Debian packages: ${missing[*]} (apt-get install ${missing[*]})" >&2
fi
exit 0
