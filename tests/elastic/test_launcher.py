"""`planaria-run`: torchrun's command line. A plain DDP script sees what torchrun gives
it; a Planaria job recovers in place under it."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.launch import TINY, reference_run
from tests.runtime.test_recovery import JOB, check_against_reference

DDP = """
import json, os, sys, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
NAMES = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
         "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
         "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
         "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE", "OMP_NUM_THREADS"]
dist.init_process_group("gloo")
torch.manual_seed(0)
model = DDP(torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
g = torch.Generator().manual_seed(dist.get_rank())
losses = []
for _ in range(5):
    x = torch.randn(16, 8, generator=g)
    loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    t = loss.detach().clone(); dist.all_reduce(t); losses.append(float(t))
env = {k: os.environ.get(k) for k in NAMES}
with open(f"{sys.argv[1]}/result-{dist.get_rank()}.json", "w") as f:
    json.dump({"rank": dist.get_rank(), "present": sorted(k for k, v in env.items() if v is not None),
               "values": {k: env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                                              "GROUP_RANK", "ROLE_NAME", "TORCHELASTIC_MAX_RESTARTS")},
               "losses": losses}, f)
del model  # DDP's reducer first, then a barrier, then the group: a clean gloo teardown
dist.barrier()
dist.destroy_process_group()
"""


def _results(directory) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(directory.glob("result-*.json"))]


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_plain_ddp_script_sees_what_torchrun_gives(tmp_path):
    script = tmp_path / "ddp.py"
    script.write_text(DDP)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    runs = {}
    for name, cmd in (("torchrun", [sys.executable, "-m", "torch.distributed.run"]),
                      ("planaria-run", [sys.executable, "-m", "planaria.elastic.launcher"])):
        out = tmp_path / name
        out.mkdir()
        flags = ["--standalone", "--nproc-per-node=2", "--max-restarts=0", str(script), str(out)]
        proc = subprocess.run([*cmd, *flags], capture_output=True, text=True, timeout=150, env=env)
        runs[name] = _results(out)
        # gloo can abort a process at exit, after the script's work (a teardown race in
        # torch's gloo, rare, seen under torchrun and planaria-run alike); the results
        # are what this test compares, so only a run that did not write them fails it.
        teardown_abort = proc.returncode != 0 and len(runs[name]) == 2 and "(SIGABRT)" in proc.stderr
        assert proc.returncode == 0 or teardown_abort, f"{name}: {proc.stderr[-6000:]}"
    assert len(runs["torchrun"]) == 2 and len(runs["torchrun"][0]["present"]) == 17
    assert runs["planaria-run"] == runs["torchrun"]


def test_flags_torchrun_rejects_are_rejected_the_same_way():
    bad = ["--nproc-per-node", "--no-such-flag", "x.py"]
    ours = subprocess.run([sys.executable, "-m", "planaria.elastic.launcher", *bad], capture_output=True, text=True)
    theirs = subprocess.run([sys.executable, "-m", "torch.distributed.run", *bad], capture_output=True, text=True)
    assert ours.returncode == theirs.returncode == 2
    assert ours.stderr.splitlines()[-1].split(": ", 1)[1] == theirs.stderr.splitlines()[-1].split(": ", 1)[1]


def test_agent_flags_follow_torchruns_options_on_every_torch_it_supports():
    """torchrun's --shutdown-timeout exists from torch 2.12 on: on an older torch the
    parsed options lack it (planaria-run died on that attribute) and the agent keeps its
    own default."""
    from torch.distributed.run import get_args_parser

    from planaria.elastic.launcher import agent_flags

    args = get_args_parser().parse_args(["--max-restarts", "2", "--log-dir", "logs", "--tee", "3", "--rdzv-conf",
                                         "timeout=60,last_call_timeout=5", "-m", "planaria.train", "x"])
    args.shutdown_timeout = 12.5
    flags = agent_flags(args, {"ca_cert": "ca.pem"}, 5, os.path.join("logs", "run-1_x"))
    assert flags[flags.index("--shutdown-timeout") + 1] == "12.5"
    assert flags[flags.index("--max-restarts") + 1] == "2" and flags[flags.index("--etcd-ca-cert") + 1] == "ca.pem"
    assert flags[flags.index("--run-log-dir") + 1] == os.path.join("logs", "run-1_x")
    assert flags[flags.index("--tee") + 1] == "3" and flags[flags.index("--join-timeout") + 1] == "60"
    assert flags[flags.index("--last-call-timeout") + 1] == "5"
    del args.shutdown_timeout  # as torch 2.11's parser leaves it
    assert "--shutdown-timeout" not in agent_flags(args, {}, 5)


def test_tls_files_that_do_not_exist_are_refused_before_anything_starts(tmp_path):
    missing = tmp_path / "ca.pem"
    proc = subprocess.run([sys.executable, "-m", "planaria.elastic.launcher", "--rdzv-backend", "etcd3",
                           "--rdzv-endpoint", "127.0.0.1:1", "--rdzv-conf", f"cacert={missing}",
                           "-m", "planaria.train", str(TINY)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert f"etcd TLS file ca_cert='{missing}' does not exist" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow  # the default suite's time (~15 min on 2 cores): `make test-slow`
@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_sigterm_to_planaria_run_stops_the_job_on_this_machine(tmp_path):
    """SIGTERM reaches every agent as a preemption notice (30 s of grace); with every node
    leaving, nobody is left to train, so the job ends at once, saying why; planaria-run
    exits 143 and leaves no process behind (the private etcd included)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "planaria.elastic.launcher", "--standalone", "--nproc-per-node=2",
         "-m", "planaria.train", str(TINY), *JOB, "train.steps=100000", f"output.dir={tmp_path}"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"), start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not list(tmp_path.glob("commits-*.jsonl")):
            assert time.monotonic() < deadline and proc.poll() is None, "the job did not start"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 128 + signal.SIGTERM, out[-4000:]
    assert out.count("preemption notice (SIGTERM, 30 s of grace)") == 2, out[-4000:]
    assert "were told they will be gone: a preemption notice or SIGTERM" in out, out[-4000:]
    leftovers = subprocess.run(["pgrep", "-s", str(proc.pid)], capture_output=True, text=True).stdout
    assert leftovers == "", f"processes left behind: {leftovers}"


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_planaria_job_under_planaria_run_recovers_in_place(tmp_path):
    """Four workers on one machine (--standalone, tp = 1: a node each); the fourth is
    SIGKILLed in iteration 2; the job finishes with the reference's losses."""
    reference = reference_run(JOB)
    victim = f"{socket.gethostname()}-3.0"
    env = dict(os.environ, OMP_NUM_THREADS="1", PLANARIA_FAULTS=f"{victim}:backward@2#2")
    proc = subprocess.run(
        [sys.executable, "-m", "planaria.elastic.launcher", "--standalone", "--nproc-per-node=4",
         "-m", "planaria.train", str(TINY), *JOB, "fault_tolerance.f=1",
         f"output.dir={tmp_path}"], capture_output=True, text=True, timeout=250, env=env)
    logs = proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.returncode == 0, logs
    assert f"failed ['{victim}']" in proc.stdout
    check_against_reference(tmp_path, reference, type("Job", (), {"logs": lambda self: logs})())


FROZEN_PEER_SCRIPT = """
import os, sys, time, torch, torch.distributed as dist
from datetime import timedelta
restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
dist.init_process_group("gloo", timeout=timedelta(seconds=600))  # a collective waits 10 minutes
open(os.path.join(sys.argv[1], f"start-{os.environ['GROUP_RANK']}-{restart}-{dist.get_world_size()}"), "w").write(str(time.time()))
t = torch.ones(1)
while restart == 0:  # the first world trains until something restarts it
    dist.all_reduce(t)
    time.sleep(0.05)
dist.destroy_process_group()
"""


@pytest.mark.slow  # the default suite's time (~15 min on 2 cores): `make test-slow`
@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_frozen_peer_restarts_the_world_through_its_lease_not_a_collective_timeout(etcd, tmp_path):
    """A plain (non-Planaria) script on two nodes under `planaria-run --rdzv-backend etcd3`.
    One node freezes (SIGSTOP: its sockets stay open, so no collective fails). Its lease
    expires after 3 s; the other node stops its workers, torchrun restarts the world
    without it, and the script finishes, instead of waiting out the 10-minute timeout."""
    script = tmp_path / "peer.py"
    script.write_text(FROZEN_PEER_SCRIPT)
    cmd = [sys.executable, "-m", "planaria.elastic.launcher", "--nnodes", "1:2", "--nproc-per-node", "1",
           "--rdzv-backend", "etcd3", "--rdzv-endpoint", etcd.endpoint, "--rdzv-id", "frozen",
           "--rdzv-conf", "lease_ttl=3,last_call_timeout=5", "--max-restarts", "1", str(script), str(tmp_path)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    nodes = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                              start_new_session=True) for _ in range(2)]
    try:
        deadline = time.monotonic() + 120
        while len(list(tmp_path.glob("start-*-0-2"))) < 2:
            assert time.monotonic() < deadline and all(n.poll() is None for n in nodes), "no 2-node world"
            time.sleep(0.2)
        frozen_at = time.time()
        os.killpg(nodes[1].pid, signal.SIGSTOP)
        out, _ = nodes[0].communicate(timeout=150)
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
    assert nodes[0].returncode == 0, out[-4000:]
    assert "gone (lease expired); stopping this node's 1 worker(s)" in out, out[-4000:]
    (restarted,) = tmp_path.glob("start-*-1-1")  # the second world: one node
    waited = float(restarted.read_text()) - frozen_at
    assert waited < 60, f"the world restarted {waited:.0f} s after the peer froze"


def _planaria_run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "planaria.elastic.launcher", *argv],
                          capture_output=True, text=True, timeout=60)


def test_a_job_of_several_machines_without_a_run_id_is_refused():
    """torchrun's --rdzv-id defaults to "none": each machine would invent its own run id
    and wait for the others forever."""
    proc = _planaria_run("--nnodes", "2", "--rdzv-backend", "etcd3", "--rdzv-endpoint", "127.0.0.1:1",
                         "-m", "planaria.train", str(TINY))
    assert proc.returncode == 2 and "same --rdzv-id" in proc.stderr and "Traceback" not in proc.stderr


def test_a_bad_config_is_a_clear_error_not_a_traceback(tmp_path):
    proc = _planaria_run("--standalone", "-m", "planaria.train", str(tmp_path / "missing.yaml"))
    assert proc.returncode == 2 and "not found" in proc.stderr and "Traceback" not in proc.stderr
    proc = _planaria_run("--standalone", "-m", "planaria.train", str(TINY), "train.nope=1")
    assert proc.returncode == 2 and "unknown config key train.nope" in proc.stderr


def test_standalone_one_worker_nodes_each_get_their_own_gpu(monkeypatch):
    """Each of --standalone's one-worker nodes runs its worker as local rank 0; on a GPU
    machine each must see its own GPU, or all of them train on the first. (The GPU count
    is set here: this test runs where there is none.)"""
    import torch

    from planaria.elastic.launcher import one_gpu_each

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert one_gpu_each(4, "auto", environ={}) == [{"CUDA_VISIBLE_DEVICES": str(i)} for i in range(4)]
    assert one_gpu_each(2, "nccl", environ={"CUDA_VISIBLE_DEVICES": "3,5,6,7"}) == [
        {"CUDA_VISIBLE_DEVICES": "3"}, {"CUDA_VISIBLE_DEVICES": "5"}]
    with pytest.raises(ValueError, match="--nproc-per-node=5 but 4 GPU"):
        one_gpu_each(5, "auto", environ={})
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert one_gpu_each(3, "auto", environ={}) == [{}, {}, {}]


def test_nproc_per_node_is_read_as_torchrun_reads_it():
    from planaria.elastic.launcher import _nproc

    assert _nproc("3") == 3
    assert _nproc("cpu") == os.cpu_count()
    with pytest.raises(ValueError, match="--nproc-per-node bogus: Unsupported nproc_per_node value"):
        _nproc("bogus")
