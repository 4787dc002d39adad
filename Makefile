# DeepInfer developer entry points. Extra arguments: make demo ARGS="--help"
VENV_DIR ?= $(CURDIR)/.venv
ARGS ?=
export VENV_DIR

.PHONY: help bootstrap demo test lab

help:
	@echo "make bootstrap  create/refresh the venv ($(VENV_DIR))"
	@echo "make test       run the test suite        (ARGS=... passed to pytest)"
	@echo "make demo       run examples/offline_inference.py (ARGS=... passed on)"
	@echo "make lab        open JupyterLab on notebooks/"

bootstrap:
	bash scripts/bootstrap.sh

test:
	bash scripts/test.sh $(ARGS)

demo:
	bash scripts/demo.sh $(ARGS)

lab: bootstrap
	"$(VENV_DIR)/bin/jupyter" lab notebooks/ $(ARGS)
