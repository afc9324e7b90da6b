# The two commands of the README, each doing its own set-up on a fresh machine:
#   make train   # train configs/tiny.yaml in 2 processes, plan chosen by the planner (torchrun, CPU or GPU)
#   make test    # the test suite (about 2-3 minutes on 2 CPU cores)
PYTHON ?= python3
NPROC ?= 2
CONFIG ?= configs/tiny.yaml
ARGS ?=

.PHONY: setup train test test-only bench

setup:
	@bash .ci/setup

train: setup
	OMP_NUM_THREADS=1 $(PYTHON) -m torch.distributed.run --standalone --nproc-per-node=$(NPROC) \
		-m planaria.train $(CONFIG) $(ARGS)

test: setup test-only

test-only:
	$(PYTHON) -m pytest -q

bench: setup
	$(PYTHON) benchmarks/step_time.py
