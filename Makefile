# The commands of the README, each doing its own set-up on a fresh machine:
#   make demo    # 4 local nodes train; two are killed, one comes back; nothing is lost (a few minutes)
#   make soak    # 30 minutes of random faults on 4-6 nodes (docs/chaos.md); make replay: the p3 trace
#                # (ARGS="--notice 30": every removal announced 30 s ahead, docs/spot.md)
#   make soak-net  # the soak on simulated hosts, network faults mixed in (root and iproute2)
#   make train   # train configs/tiny.yaml in 2 processes, plan chosen by the planner (torchrun, CPU or GPU)
#   make test    # the test suite (10 to 20 minutes on 2 CPU cores, as fast and as busy as the machine is)
#   make test-slow  # the longer scenarios kept out of it (30 to 40 minutes)
PYTHON ?= python3
NPROC ?= 2
CONFIG ?= configs/tiny.yaml
ARGS ?=

.PHONY: setup demo soak soak-net replay train test test-only test-slow bench

setup:
	@bash .ci/setup

demo: setup
	$(PYTHON) -m planaria.cli demo $(ARGS)

# The long chaos runs of docs/chaos.md, not part of the test suite.
soak: setup
	$(PYTHON) -m planaria.cli chaos configs/soak.yaml --nodes 6 --etcd-members 3 \
		--random 1.5 --random-nodes 4-6 --seed 1 --fresh-reference --timeout 5400 --out soak-out $(ARGS)

soak-net: setup
	$(PYTHON) -m planaria.cli chaos configs/tiny.yaml --nodes 6 --etcd-members 3 --hosts --fault-tolerance 1 \
		--random 1.5 --random-follow-up 0.3 --random-nodes 4-6 --seed 2 --fresh-reference --timeout 5400 --out soak-net-out \
		parallel.min_stages=2 comm.timeout_s=10 checkpoint.every=100 train.steps=6000 train.log_every=500 $(ARGS)

# A peer snapshot on every node (memory_copies=5 of 6): the trace takes 4 of 6 nodes at
# once, which two copies do not cover (docs/chaos.md, "The trace replay").
replay: setup
	$(PYTHON) -m planaria.cli chaos configs/tiny.yaml --nodes 6 --fault-tolerance 1 \
		--trace p3 --time-scale 68 --fresh-reference --timeout 3600 --out replay-out \
		parallel.min_stages=2 comm.timeout_s=10 checkpoint.every=20 checkpoint.memory_copies=5 \
		train.steps=6000 train.log_every=500 $(ARGS)

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
