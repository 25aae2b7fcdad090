# The two commands of the quick start: `make demo` and `make test`.
# Each does its own setup: a virtualenv in .venv, the CPU build of torch, the package.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test test-chaos lint bench-engine clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch first and pinned: an unpinned torch requirement pulls a multi-GB CUDA build.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e ".[predictor,test]"
	# Compile the dispatcher's simulation kernel once (about 13 s); processes load it from disk.
	$(BIN)/python -c "from blockq.engine_model.packed import warm_up; warm_up()"
	touch $(STAMP)

demo: setup
	$(BIN)/blockq demo

# pytest exits 5 when it collected no tests: that is a failure, not a pass.
test: setup
	@$(BIN)/python -m pytest -q; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "no tests were collected" >&2; exit 1; fi; exit $$rc

# The chaos suite: each fault on a real local cluster (about a minute per scenario).
test-chaos: setup
	$(BIN)/python -m pytest -q -m chaos -s tests/test_chaos.py

lint: setup
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) .blockq out
