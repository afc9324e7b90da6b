"""etcd's request limits (1.5 MiB a request, 128 operations a transaction), checked by the
client before a request is sent, and by the controller where an epoch record is made;
and the records of a 4,096-node job of LLaMA 3 70B, well under them."""
from __future__ import annotations

import dataclasses

import pytest

from planaria.elastic.controller import Controller
from planaria.elastic.etcd_client import EtcdClient, EtcdLimitExceeded, EtcdSettings
from planaria.elastic.etcd_kv import EtcdKeyValue
from planaria.elastic.etcd_limits import MAX_REQUEST_BYTES, MAX_TXN_OPS, EtcdLimits
from planaria.runtime.config.loading import load_config
from planaria.runtime.contract import env, keys
from planaria.runtime.contract.epochs import EpochRecord
from planaria.runtime.contract.exactly_once import INCOMPLETE, CommitRecord, WorkerStatus
from planaria.runtime.planning.job_plans import build_planner, cost_model
from tests.launch import REPO, TINY

LLAMA3_70B = REPO / "configs" / "llama3-70b.yaml"


@pytest.fixture(scope="module")
def client(etcd):
    client = EtcdClient(EtcdSettings(endpoint=etcd.endpoint, retry_s=5))
    yield client
    client.close()


class Sends:
    """Counts what reaches the wire: wraps the client's pyetcd calls."""

    def __init__(self, client: EtcdClient, monkeypatch):
        self.count = 0
        for name in ("put", "transaction"):
            monkeypatch.setattr(client._client, name, self._counted(getattr(client._client, name)))

    def _counted(self, send):
        def counted(*args, **kwargs):
            self.count += 1
            return send(*args, **kwargs)
        return counted


def largest_accepted(accepts, low: int, high: int) -> int:
    """The largest n in [low, high) with accepts(n), given accepts(low) and not accepts(high)."""
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if accepts(middle) else (low, middle)
    return low


def etcd_takes(send) -> bool:
    """Whether etcd takes the request `send()` makes straight through pyetcd (no check)."""
    try:
        send()
        return True
    except Exception as err:  # noqa: BLE001 - etcd's refusal is a bare gRPC error
        assert "request is too large" in str(err), err
        return False


# ---------------------------------------------------------------- the client's check
@pytest.mark.timeout(120)
def test_a_put_just_under_the_limit_goes_through_and_one_just_over_is_refused_before_it_is_sent(client, monkeypatch):
    key = "/planaria/limits/put"
    fits = MAX_REQUEST_BYTES - len(key) - client.limits.envelope_bytes(1)
    sends = Sends(client, monkeypatch)
    client.put(key, b"a" * fits)
    assert client.get(key)[0] == b"a" * fits and sends.count == 1

    with pytest.raises(EtcdLimitExceeded) as refused:
        client.put(key, b"b" * (fits + 1))
    assert sends.count == 1  # never sent, never retried
    message = str(refused.value)
    assert key in message and str(MAX_REQUEST_BYTES) in message and "--max-request-bytes" in message
    assert str(MAX_REQUEST_BYTES + 1) in message  # the request's size
    assert client.get(key)[0] == b"a" * fits


@pytest.mark.timeout(180)
def test_the_client_refuses_nothing_etcd_takes_but_within_its_stated_allowance(client):
    """For each kind of request the client makes, the largest value etcd itself takes is
    at least the largest the client lets through (the client is never looser) and at most
    the framing allowance above it (never stricter by more). etcd 3.5 counts key + value
    + its framing of 24 bytes for a put, 40 for a create-if-absent, ~57 for
    set_if_revision's four operations (`planaria.elastic.etcd_limits`)."""
    raw, t = client._client, client.ops
    lease = client.lease(60)
    key, expected = "/planaria/limits/fit", b"e" * 100

    def cas_absent(n):
        raw.delete(key)
        return raw.transaction(compare=[t.version(key) == 0], success=[t.put(key, b"v" * n)], failure=[])

    def cas_value(n):
        raw.put(key, expected)
        return raw.transaction(compare=[t.value(key) == expected], success=[t.put(key, b"v" * n)], failure=[])

    def set_if_absent(n):
        raw.delete(key)
        return raw.transaction(compare=[t.version(key) == 0], success=[t.put(key, b"v" * n, lease=lease), t.get(key)],
                               failure=[t.get(key)])

    kinds = {  # the raw request etcd is sent; how the client sends it; its compares and operations
        "put": (lambda n: raw.put(key, b"v" * n, lease=lease),
                lambda n: client.put(key, b"v" * n, lease=lease), [key], 1),
        "compare_and_set on an absent key": (cas_absent, lambda n: (raw.delete(key), client.compare_and_set(
            key, b"", b"v" * n)), [key, key], 2),
        "compare_and_set on a value": (cas_value, lambda n: (raw.put(key, expected), client.compare_and_set(
            key, expected, b"v" * n)), [key, key, expected], 2),
        "set_if_revision": (set_if_absent, lambda n: (raw.delete(key), client.set_if_revision(
            key, None, b"v" * n, lease=lease)), [key] * 4, 4),
    }
    for kind, (raw_send, client_send, others, ops) in kinds.items():
        allowance = client.limits.envelope_bytes(ops)
        fits = MAX_REQUEST_BYTES - sum(len(part) for part in others) - allowance  # the client's largest
        client_send(fits)  # sent, so etcd took it
        with pytest.raises(EtcdLimitExceeded):
            client_send(fits + 1)
        assert not etcd_takes(lambda: raw_send(fits + allowance + 1)), kind
        etcd_largest = largest_accepted(lambda n: etcd_takes(lambda: raw_send(n)), fits, fits + allowance + 1)
        assert fits <= etcd_largest <= fits + allowance, kind
        framing = MAX_REQUEST_BYTES - sum(len(part) for part in others) - etcd_largest
        assert 0 < framing < allowance, (kind, framing, allowance)
    client.revoke(lease)


@pytest.mark.timeout(60)
def test_a_transaction_of_129_operations_is_refused_before_it_is_sent(client, monkeypatch):
    t, sends = client.ops, Sends(client, monkeypatch)
    puts = [t.put(f"/planaria/limits/txn/{i:03d}", b"1") for i in range(MAX_TXN_OPS + 1)]
    with pytest.raises(EtcdLimitExceeded) as refused:
        client.transaction("write 129 keys", "/planaria/limits/txn/", compare=[], success=puts)
    message = str(refused.value)
    assert "129 operations" in message and "128" in message and "--max-txn-ops" in message
    assert sends.count == 0 and client.count_prefix("/planaria/limits/txn/") == 0

    ok, _ = client.transaction("write 128 keys", "/planaria/limits/txn/", compare=[], success=puts[:MAX_TXN_OPS])
    assert ok and client.count_prefix("/planaria/limits/txn/") == MAX_TXN_OPS


@pytest.mark.timeout(60)
def test_etcd_refusing_what_the_client_let_through_says_so_and_is_not_retried(etcd):
    """A client told a larger limit than etcd was started with: etcd's own refusal comes
    back as the same clear error, at once."""
    client = EtcdClient(EtcdSettings(endpoint=etcd.endpoint, retry_s=30, max_request_bytes=2 * MAX_REQUEST_BYTES))
    with pytest.raises(EtcdLimitExceeded, match="--max-request-bytes is lower than this client was told"):
        client.put("/planaria/limits/told", b"x" * MAX_REQUEST_BYTES)
    client.close()


def test_limits_other_than_etcds_defaults_reach_the_workers_through_the_environment():
    settings = EtcdSettings(max_request_bytes=8 * 2**20, max_txn_ops=1024)
    environ = settings.to_env()
    assert environ == {env.ETCD_MAX_REQUEST_BYTES: str(8 * 2**20), env.ETCD_MAX_TXN_OPS: "1024"}
    assert EtcdSettings.from_env("10.0.0.5:2379", environ).limits == EtcdLimits(8 * 2**20, 1024)
    assert EtcdSettings().to_env() == {}  # the defaults are not spelled out
    with pytest.raises(ValueError, match=env.ETCD_MAX_REQUEST_BYTES):
        EtcdSettings.from_env("10.0.0.5:2379", {env.ETCD_MAX_REQUEST_BYTES: "1.5MiB"})
    with pytest.raises(ValueError, match="--max-txn-ops"):
        EtcdSettings(max_txn_ops=2)


# ------------------------------------------------------------ the controller's check
def report_statuses(client: EtcdClient, prefix: str, plan, last_stepped: int, workers) -> None:
    """What each worker of `plan` publishes when its epoch stops after `last_stepped`,
    written 128 to a transaction (one put each would take minutes at 32,768 workers)."""
    ranks, t = plan.rank_of_worker(), client.ops
    puts = []
    for worker in sorted(workers):
        status = WorkerStatus(worker=worker, last_stepped=last_stepped, state=INCOMPLETE,
                              commit=CommitRecord(last_stepped, 1.0, 1.0),
                              holds=tuple((layer, worker[1]) for layer in plan.layers_of(ranks[worker])))
        puts.append(t.put(prefix + keys.epoch_status(plan.epoch, worker), status.to_json().encode()))
    for start in range(0, len(puts), MAX_TXN_OPS):
        client.transaction("report statuses", prefix, compare=[], success=puts[start:start + MAX_TXN_OPS])
    client.put(prefix + keys.epoch_trained(plan.epoch), b"1")


def tiny_controller(client: EtcdClient, run: str, logs: list[str]) -> tuple[Controller, EtcdKeyValue]:
    cfg = load_config(TINY, ["fault_tolerance.f=1"])
    planner = build_planner(cfg, cost_model(cfg, hardware_name="h100", gpus_per_node=1))
    store = EtcdKeyValue(client, keys.run_prefix(run))
    return Controller(store, planner, total_steps=100, log=logs.append), store


def record_size(store: EtcdKeyValue, record: EpochRecord) -> int:
    return store.compare_set_bytes(keys.epoch_record(record.plan.epoch), "", record.to_json())


@pytest.mark.timeout(60)
def test_a_record_over_the_limit_fails_the_job_before_anything_of_it_is_written(etcd):
    client = EtcdClient(EtcdSettings(endpoint=etcd.endpoint, retry_s=5))
    logs: list[str] = []
    controller, store = tiny_controller(client, "limits-start", logs)
    workers = [(f"node{i}", 0) for i in range(4)]
    record = EpochRecord(controller.planner.instantiate(4, node_ids=[n for n, _ in workers]).plan)
    client.limits = EtcdLimits(max_request_bytes=record_size(store, record) - 1)  # an etcd started so

    controller.start(workers)
    assert controller.outcome.startswith(f"{keys.JOB_FAILED}the record of epoch 0 takes ")
    assert "--max-request-bytes" in controller.outcome and "a plan of 4 nodes" in controller.outcome
    assert not store.check([keys.epoch_record(0)]) and not store.check([keys.EPOCH])  # no half publication
    assert store.get(keys.DONE).decode() == controller.outcome
    assert controller.poll(lambda: set(workers), kill=lambda worker: None) == "failed"
    client.close()


@pytest.mark.timeout(60)
def test_a_record_over_half_the_limit_is_warned_of_once_and_one_over_it_after_a_loss_fails_the_job(etcd):
    client = EtcdClient(EtcdSettings(endpoint=etcd.endpoint, retry_s=5))
    logs: list[str] = []
    controller, store = tiny_controller(client, "limits-loss", logs)
    workers = [(f"node{i}", 0) for i in range(4)]
    first = EpochRecord(controller.planner.instantiate(4, node_ids=[n for n, _ in workers]).plan)
    client.limits = EtcdLimits(max_request_bytes=int(1.5 * record_size(store, first)))  # epoch 0: 2/3 of it

    plan = controller.start(workers)
    warnings = [line for line in logs if "warning" in line]
    assert len(warnings) == 1 and "the record of epoch 0 takes" in warnings[0]
    assert "of etcd's request limit" in warnings[0] and "a plan of 4 nodes" in warnings[0]
    assert "0 layer transfers" in warnings[0] and "--max-request-bytes" in warnings[0]
    alive = set(workers) - {("node3", 0)}
    report_statuses(client, store.prefix, plan, 3, alive)
    # An etcd whose limit no record fits, but the controller's other writes do (its failure
    # message in `done` among them).
    client.limits = EtcdLimits(max_request_bytes=640)

    assert controller.poll(lambda: alive, kill=lambda worker: None) == "failed"
    assert "the record of epoch 1 takes" in controller.outcome and "layer transfers" in controller.outcome
    assert not store.check([keys.epoch_record(1)]) and store.get(keys.EPOCH) == b"0"
    assert len([line for line in logs if "warning" in line]) == 1  # once
    client.close()


# ------------------------------------------- the records of a 4,096-node job: the must-show
@dataclasses.dataclass(frozen=True)
class RecordingLimits(EtcdLimits):
    """etcd's default limits, noting every request checked against them: everything the
    client sends that writes (what, key, size, operations of its largest branch)."""

    sent: list = dataclasses.field(default_factory=list, compare=False)

    def check(self, what, key, size, ops=1, *, why=None):
        self.sent.append((what, key, size, ops))
        super().check(what, key, size, ops, why=why)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("nodes", [1024, 4096])
def test_the_records_of_llama3_70b_on_4096_nodes_of_8_gpus_are_within_etcds_limits(etcd, nodes):
    """Epoch 0 and the epoch after a node is lost, planned and published by the real
    controller over etcd, for LLaMA 3 70B on `nodes` nodes of 8 H100s (as `planaria plan
    configs/llama3-70b.yaml --nodes 4096 --gpus-per-node 8 --hardware h100` plans it):
    every request the controller sends for both publications is under 1.5 MiB, and every
    transaction has at most 128 operations (with etcd's defaults, which etcd enforces too)."""
    client = EtcdClient(EtcdSettings(endpoint=etcd.endpoint, retry_s=30))
    client.limits = RecordingLimits()
    sent = client.limits.sent
    cfg = load_config(LLAMA3_70B, [])
    planner = build_planner(cfg, cost_model(cfg, hardware_name="h100", gpus_per_node=8))
    store = EtcdKeyValue(client, keys.run_prefix(f"llama3-70b-{nodes}"))
    logs: list[str] = []
    controller = Controller(store, planner, total_steps=cfg.train.steps, gpus_per_node=8, log=logs.append)
    workers = [(f"node{i:04d}", local) for i in range(nodes) for local in range(8)]

    plan = controller.start(workers)
    assert controller.outcome is None and controller.epoch == 0
    started = list(sent)
    alive = set(workers) - {("node0000", local) for local in range(8)}
    report_statuses(client, store.prefix, plan, 3, alive)
    sent.clear()
    assert controller.poll(lambda: alive, kill=lambda worker: None) == "running"
    assert controller.epoch == 1, logs
    recovered = list(sent)

    for requests in (started, recovered):
        assert requests and all(size <= MAX_REQUEST_BYTES for _, _, size, _ in requests)
        assert all(ops <= MAX_TXN_OPS for _, _, _, ops in requests)
    record = {epoch: next(size for what, key, size, _ in started + recovered
                          if key == store.prefix + keys.epoch_record(epoch)) for epoch in (0, 1)}
    transfers = len(EpochRecord.from_json(store.get(keys.epoch_record(1))).transfers)
    assert transfers > 0 and record[1] > record[0]
    # Under half the limit, where the controller would warn: at 1,024 nodes the re-plan
    # re-cuts the pipelines (17,392 transfers, docs/planner.md), and still is.
    assert record[1] < 0.5 * MAX_REQUEST_BYTES and not [line for line in logs if "warning" in line]
    statuses = client.items_with_prefix(store.prefix + keys.epoch_statuses(0))  # read whole (over 4 MiB at 4,096)
    assert len(statuses) == len(alive)
    print(f"\n{nodes} nodes x 8: epoch 0's record {record[0]} bytes ({record[0] / 2**10:.1f} KiB), after a node "
          f"is lost {record[1]} bytes ({record[1] / 2**10:.1f} KiB, {transfers} transfers); largest request "
          f"{max(size for *_, size, _ in started + recovered)} bytes, largest transaction "
          f"{max(ops for *_, ops in started + recovered)} operations; the statuses of epoch 0: "
          f"{sum(map(len, statuses.values())) / 2**20:.2f} MiB in one read")
    client.close()
