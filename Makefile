# Every target installs what it needs first (uv from PyPI if missing, then the locked dependencies).
UV := $(shell command -v uv 2>/dev/null)
ifeq ($(UV),)
UV := python3 -m uv
endif

.PHONY: install demo dev test lint bench replay locust chaos clean

install:
	@./scripts/system-deps.sh
	@command -v uv >/dev/null 2>&1 || python3 -m uv --version >/dev/null 2>&1 || python3 -m pip install -q uv
	@# --inexact: a package the user installed into .venv (their own agent, README "Your own agent class")
	@# stays; an exact sync removed it at the next `make` target
	$(UV) sync --frozen --inexact --all-extras --compile-bytecode
	@# the project's own modules too: `uv run` sets PYTHONDONTWRITEBYTECODE=1, so without these every
	@# process (runtime, worker, each sandboxed agent host) compiled them from source at each start
	$(UV) run --frozen python -m compileall -q substrate api workers snapshot loadtest

demo: install          ## start the embedded default, create + invoke + suspend + wake a session, stop (PORT=18080)
	$(UV) run substrate demo $(if $(PORT),--port $(PORT))

dev: install           ## run the embedded default on 127.0.0.1:8080 (PORT=...) until Ctrl-C
	$(UV) run substrate up $(if $(PORT),--port $(PORT))

lint: install
	$(UV) run lint-imports

#: test workers (pytest-xdist): most tests wait on real processes, so 3 workers fill 2 cores; TEST_WORKERS=0: serially
TEST_WORKERS ?= 3
#: each file whole to one worker (files share module-scoped runtimes), slowest files first (tests/xdist_order.py)
PYTEST_XDIST = $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)

test: install lint     ## the whole suite (unit, integration, e2e) on TEST_WORKERS workers; needs no server installed by hand
	$(UV) run pytest -q $(PYTEST_XDIST) $(PYTEST_ARGS)

chaos: install         ## fault injection + history check, 10 min -> chaos-results/report.md (exit 1 on a violation)
	$(UV) run python -m loadtest.chaos --duration $${CHAOS_DURATION_S:-600} --out chaos-results

bench: install         ## micro-benchmarks + a short trace replay -> bench-results/bench.md
	$(UV) run python -m loadtest.bench

clean:
	rm -rf var bench-results replay-results chaos-results .pytest_cache
