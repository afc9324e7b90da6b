# The commands of the README, each doing its own set-up on a fresh machine:
#   make demo    # 4 local nodes train; two are killed, one comes back; nothing is lost (a few minutes)
#   make train   # train configs/tiny.yaml in 2 processes, plan chosen by the planner (torchrun, CPU or GPU)
#   make test    # the test suite (about 15 minutes on 2 CPU cores)
#   make test-slow  # the longer runs kept out of it (a few minutes)
PYTHON ?= python3
NPROC ?= 2
CONFIG ?= configs/tiny.yaml
ARGS ?=

.PHONY: setup demo train test test-only test-slow bench

setup:
	@bash .ci/setup

demo: setup
	$(PYTHON) -m planaria.chaos.cli demo $(ARGS)

train: setup
	OMP_NUM_THREADS=1 $(PYTHON) -m torch.distributed.run --standalone --nproc-per-node=$(NPROC) \
		-m planaria.train $(CONFIG) $(ARGS)

test: setup test-only

test-only:
	$(PYTHON) -m pytest -q

test-slow: setup
	$(PYTHON) -m pytest -q -m slow

bench: setup
	$(PYTHON) benchmarks/step_time.py
