# The two commands the README promises: `make run` and `make test`.
# Both bootstrap .venv from pyproject.toml, pinning torch via constraints.txt.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
PIP_FLAGS ?= -q --disable-pip-version-check

.PHONY: run test test-py313 lint bench bench-quick fuzz soak clean venv dist vllm-check gpu-check gpu-wheels

RUN_STAMP := $(VENV)/.run-stamp

$(STAMP): pyproject.toml setup.py constraints.txt kvsidecar/protocol/_seqlock.c kvsidecar/web/_pollfast.c kvsidecar/daemon/_gatewaystep.c
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install $(PIP_FLAGS) -c constraints.txt -e '.[agent,dev,otlp]'
	touch $(STAMP) $(RUN_STAMP)

# What `make run` needs and no more (no test or benchmark tools), saying what it does: the
# first run downloads torch (CPU) and takes minutes. pyzmq (kvevents): the demo publishes KV
# events. numpy: torch warns at every import
# without it (its CPU wheel does not bring it); the demo itself does not need it.
$(RUN_STAMP): pyproject.toml setup.py constraints.txt kvsidecar/protocol/_seqlock.c kvsidecar/web/_pollfast.c kvsidecar/daemon/_gatewaystep.c
	@test -x $(BIN)/python || { echo "make run: creating $(VENV)"; $(PYTHON) -m venv $(VENV); }
	@echo "make run: installing kvsidecar and torch (CPU) into $(VENV); the first time takes a few minutes"
	$(BIN)/pip install --disable-pip-version-check -c constraints.txt -e '.[agent,kvevents]' numpy
	touch $(RUN_STAMP)

# Just the environment: .venv/bin/kvsidecar and .venv/bin/python, as the docs use them.
venv: $(STAMP)

run: $(RUN_STAMP)
	$(BIN)/kvsidecar demo $(ARGS)

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

bench: $(STAMP)
	$(BIN)/kvsidecar bench all --out bench-results

# The daemon side again on CPython 3.13, the newest that pyproject.toml admits: there a
# reader maps with trackfd=False (1 descriptor per segment, not 2), which the fd budget
# counts on. torch has no 3.13 wheel here, so the two tests that start an engine are left
# out; the rest of protocol/, daemon/, web/ and faults/ runs. PY313=/path/to/python3.13.
PY313 ?= python3.13
VENV313 := .venv-py313
PY313_TESTS := tests/protocol tests/daemon tests/web tests/faults \
	--ignore=tests/protocol/test_contract.py \
	--deselect=tests/faults/test_daemon_faults.py::test_daemon_sigkilled_and_restarted_while_the_engine_runs
test-py313:
	test -x $(VENV313)/bin/python || $(PY313) -m venv $(VENV313)
	$(VENV313)/bin/pip install $(PIP_FLAGS) -c constraints.txt -e '.[otlp]' pytest pytest-timeout hypothesis logfmt
	$(VENV313)/bin/python -c 'import sys; assert sys.version_info[:2] == (3, 13), sys.version'
	$(VENV313)/bin/python -m pytest -p no:cacheprovider $(PY313_TESTS) $(PYTEST_ARGS)

bench-quick: $(STAMP)
	$(BIN)/kvsidecar bench all --quick --out bench-results

# A wheel and an sdist in dist/, to install the daemon elsewhere (docs/operations.md):
# pip install dist/kvsidecar-<version>-*.whl (no compiler needed where it was built for).
# build/ goes first: setuptools copies build/lib into the wheel, so a stale one would bring
# back modules that have left the package (tests/attacks/ once lived in kvsidecar/bench/).
dist: $(STAMP)
	rm -rf build dist
	git rev-parse --short=12 HEAD > kvsidecar/REVISION 2>/dev/null || echo unknown > kvsidecar/REVISION
	TZ=UTC git log -1 --date=format-local:%Y%m%d-%H:%M:%S --format=%cd > kvsidecar/BUILD_DATE 2>/dev/null \
		|| echo unknown > kvsidecar/BUILD_DATE
	$(BIN)/python -m build --no-isolation --sdist --wheel --outdir dist .; rc=$$?; \
		rm -f kvsidecar/REVISION kvsidecar/BUILD_DATE; exit $$rc

clean:
	rm -rf $(VENV) build dist *.egg-info kvsidecar/protocol/*.so kvsidecar/web/*.so bench-results

# The full fuzz run (100,000 inputs each for the segment reader and the payload decoder).
fuzz: $(STAMP)
	KVSIDECAR_FUZZ_CASES=100000 $(BIN)/python -m pytest tests/protocol/test_fuzz.py -q -s

# The 10-minute soak (writer at 1 kHz, scrapes at 20 Hz); not part of `make test`.
soak: $(STAMP)
	$(BIN)/kvsidecar bench soak --seconds 600 --out bench-results

# Check a vLLM release against the plugin (docs/vllm.md, "Checking a new vLLM release"):
# build the env of .ci/locks/$(ENV).txt, then run vLLM's real scheduler under the driver.
ENV ?= vllm033
vllm-check: $(STAMP)
	bash .ci/engine-env $(ENV)
	KVSIDECAR_REQUIRE_ENGINES=1 $(BIN)/python -m pytest -q -s \
	  "tests/engines/test_vllm_scheduler.py::test_scheduler_published_fields_equal_recount_and_sabotage_is_caught[$(ENV)]"

# The CUDA path on a machine with a GPU and torch (not CI): CUDA pool tests, the demo, and
# bench publish/agent/cost on cuda; without CUDA, a dry run (docs/benchmarks.md, "GPU").
gpu-check:
	bash .ci/gpu-check

# For a GPU machine with no network: the cp312 wheels gpu-check installs there, into
# gpu-wheels/ (then, there: WHEELS=gpu-wheels make gpu-check).
gpu-wheels:
	bash .ci/gpu-wheels
