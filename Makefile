# Two entry points, each doing its own set-up on a fresh machine:
#   make repro   run the whole pipeline (dvc repro) on the default scene and print where the report is
#   make test    run the test suite (what CI runs)
VENV  := .venv
BIN   := $(abspath $(VENV))/bin
STAMP := $(VENV)/.installed
export PATH := $(BIN):$(PATH)
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS ?= 90
export PREFECT_SERVER_ANALYTICS_ENABLED ?= false
export DVC_NO_ANALYTICS := 1

.PHONY: repro test setup clean compare

$(STAMP): pyproject.toml scripts/setup.sh
	bash scripts/setup.sh

setup: $(STAMP)

repro: $(STAMP)
	dvc repro
	@echo "Report: $(abspath data/report/report.html)"

test: $(STAMP)
	python -m pytest

# One page comparing the `dvc exp run` experiments of HEAD (or COMPARE_ARGS="--all-commits",
# "--rev <commit>", "--baseline <exp>"); ends with "Comparison: <path>".
compare: $(STAMP)
	python -m stages.compare --out data/compare $(COMPARE_ARGS)

clean:
	rm -rf data .dvc/cache .dvc/tmp
