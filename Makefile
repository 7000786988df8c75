# Set-up is part of every target: a fresh clone needs only python3 (3.11+) and make.
VENV  ?= .venv
BIN   := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: serve test check

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

# The main job on a built-in default: an OpenAI-compatible server on a built-in demo checkpoint.
serve: $(STAMP)
	$(BIN)/mlxc serve

test: $(STAMP)
	$(BIN)/pytest -q

# What CI runs after the tests: the code lint-clean and formatted (the pinned ruff), specs lint
# clean, generated/ in sync, the bounded-cache schedule.
check: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mlxc lint specs/
	$(BIN)/mlxc build specs/ --check
	$(BIN)/mlxc verify specs/
