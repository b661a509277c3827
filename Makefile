# ccsq: two commands matter. `make demo` runs the main job; `make test` runs the suite.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
PYTEST_ARGS ?=

.PHONY: demo test chaos sim bench soak install-systemd clean dist

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel

$(VENV)/.installed-cpu: $(VENV)/bin/python setup.cfg pyproject.toml
	$(PIP) install -q -e '.[cpu,console]'
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed-cpu
	$(PIP) install -q -e '.[cpu,console,test]'
	touch $@

## make demo: OCR every bundled page through broker + 2 workers + completion service (SQLite)
demo: $(VENV)/.installed-cpu
	$(PY) examples/demo.py

## make test: the whole suite (what CI runs); three pytest workers on 2 cores (most tests wait on
## real processes: with two workers the suite kept the cores ~52 % busy, 818 s of CPU in 781 s);
## idle workers steal queued tests (worksteal); PYTEST_WORKERS=0 runs it in one process
PYTEST_WORKERS ?= 3
test: $(VENV)/.installed-test
	$(VENV)/bin/pytest -q -m "not soak" $(if $(filter-out 0,$(PYTEST_WORKERS)),-n $(PYTEST_WORKERS) --dist worksteal) $(PYTEST_ARGS)

## make chaos: the long fault-injection run (tests/chaos); replay or resize with CHAOS_ARGS="--seed N --duration-s S"
CHAOS_ARGS ?= --duration-s 1800
chaos: $(VENV)/.installed-test
	$(PY) -m tests.chaos $(CHAOS_ARGS)

## make sim: the deterministic simulation, long (docs/simulation.md); SIM_ARGS="--seed N --items M" or "--plant NAME"
SIM_ARGS ?= --seed 1 --items 1000000
sim: $(VENV)/.installed-test
	$(PY) -m tests.sim $(SIM_ARGS)

## make bench: ccsq vs Redis vs RabbitMQ side by side, and one broker vs a sync pair (installs the peers and etcd as root); BENCH_ARGS="--n 100000 --only pipeline"
BENCH_ARGS ?=
bench: $(VENV)/.installed-test
	$(PIP) install -q -e '.[cpu,test,bench]'
	$(PY) -m bench.run $(BENCH_ARGS)

## make soak: long runs excluded from CI
soak: $(VENV)/.installed-test
	$(VENV)/bin/pytest -q -m soak $(PYTEST_ARGS)

clean:
	rm -rf .demo build dist *.egg-info

## make install-systemd: install the systemd units (root; DRY_RUN=1 prints the steps; CCSQ_VENV=/opt/ccsq/venv links the binaries)
install-systemd:
	sh systemd/install.sh $(if $(DRY_RUN),--dry-run) $(if $(CCSQ_VENV),--venv $(CCSQ_VENV))

## make dist: sdist and wheel in dist/ (the wheel is built from the sdist; it carries the units: VENV/share/ccsq/systemd);
## needs only `build` in the venv, not the package or the test stack
$(VENV)/.installed-build: $(VENV)/bin/python
	$(PIP) install -q 'build>=1.0'
	touch $@

dist: $(VENV)/.installed-build
	rm -rf dist
	$(PY) -m build --outdir dist .
