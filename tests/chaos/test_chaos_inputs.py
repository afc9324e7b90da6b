"""`planaria chaos` on input it must refuse before anything starts (bad faults, traces,
random settings, options that would be ignored), the grammar of fault specs, and the key
of the cached fault-free reference."""
from __future__ import annotations

import pytest

from planaria.chaos.faults import FaultSpec, FaultSpecError, parse_fault, validate
from planaria.cli import main as chaos_main
from tests.launch import TINY


@pytest.fixture
def refused(tmp_path, cache, capsys, monkeypatch):
    """`planaria chaos ARGS` run in this process on input it must refuse: checks the exit
    status (2) and returns stderr. In this process, as a subprocess would spend seconds
    importing torch to print one line; a run that did start would still fail the test."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))

    def run(args: list[str]) -> str:
        try:
            code = chaos_main(["chaos", str(TINY), *args, "--out", str(tmp_path / "out")])
        except SystemExit as exit:
            code = exit.code
        err = capsys.readouterr().err
        assert code == 2, err
        return err
    return run


@pytest.mark.parametrize("args, message", [
    (["--fault", "explode-node@3"], "unknown fault kind 'explode-node'"),
    (["--fault", "kill-node@30"], "step 30 is beyond the job's train.steps=30"),
    (["--fault", "kill-node@3:target=7"], "there is no node 7 by step 3"),
    (["--fault", "kill-worker@3:target=1.2"], "local ranks 0 to 0"),
    (["--fault", "kill-etcd-member@3"], "Run with --etcd-members 3"),
    (["--fault", "kill-node"], "expected KIND@STEP[+SECONDS][:target=NODE[.LOCAL]]"),
    (["--fault", "preempt-node@3:target=1"], "a preemption comes with a notice; say how long with :notice=SECONDS"),
    (["--fault", "kill-node@3:notice=20"], "only preempt-node takes :notice=, not kill-node"),
    (["--notice", "30"], "--notice announces a --trace's removals ahead; give --trace too"),
])
def test_bad_faults_are_refused_before_anything_starts(args, message, tmp_path, refused):
    assert message in refused(["--nodes", "4", *args])
    assert not (tmp_path / "out").exists(), "nothing may start for a bad fault"


def test_fault_specs_and_targets():
    assert parse_fault("kill-worker@6:target=2.1") == FaultSpec("kill-worker", 6, 2, 1)
    assert str(parse_fault("add-node@9")) == "add-node@9"
    with pytest.raises(FaultSpecError, match="acts on a whole node"):
        parse_fault("kill-node@3:target=2.0")
    # a node added at step 4 is a target from then on, not before
    validate([parse_fault("add-node@4"), parse_fault("kill-node@5:target=4")],
             steps=10, nodes=4, nproc=1, etcd_members=1)
    with pytest.raises(FaultSpecError, match="no node 4 by step 3"):
        validate([parse_fault("add-node@4"), parse_fault("kill-node@3:target=4")],
                 steps=10, nodes=4, nproc=1, etcd_members=1)


def test_a_preemption_names_its_notice_and_on_hosts_every_notice_is_the_same():
    fault = parse_fault("preempt-node@8:target=2,notice=20")  # the spelling too
    assert fault == FaultSpec("preempt-node", 8, 2, notice_s=20.0)
    assert str(fault) == "preempt-node@8:target=2:notice=20"
    validate([fault], steps=10, nodes=4, nproc=1, etcd_members=1, hosts=True)
    # On hosts the notice is a signal and every agent's --preemption-grace: one for all.
    other = parse_fault("preempt-node@9:target=1:notice=10")
    validate([fault, other], steps=10, nodes=4, nproc=1, etcd_members=1)
    with pytest.raises(FaultSpecError, match="give every preempt-node the same notice"):
        validate([fault, other], steps=10, nodes=4, nproc=1, etcd_members=1, hosts=True)


def test_network_faults_last_a_while_and_need_hosts():
    fault = parse_fault("isolate-node@4:target=1:for=20")
    assert fault == FaultSpec("isolate-node", 4, 1, None, 0.0, 20.0) and str(fault) == "isolate-node@4:target=1:for=20"
    with pytest.raises(FaultSpecError, match="say how long with :for=SECONDS"):
        parse_fault("slow-link@4:target=1")
    with pytest.raises(FaultSpecError, match="kill-node is not a network fault"):
        parse_fault("kill-node@4:for=3")
    validate([fault], steps=10, nodes=4, nproc=1, etcd_members=1, hosts=True)
    with pytest.raises(FaultSpecError, match="run with --hosts"):
        validate([fault], steps=10, nodes=4, nproc=1, etcd_members=1)
    from planaria.chaos.sources import RandomFaults, random_kinds

    assert "isolate-node" not in random_kinds(None, 1)  # without --hosts
    with pytest.raises(FaultSpecError, match="need nodes with networks of their own; run with --hosts"):
        random_kinds("isolate-node", 1)
    drawn = random_kinds(None, 3, hosts=True)
    assert {"isolate-node", "slow-link", "partition", "isolate-etcd-member"} <= set(drawn)
    source = RandomFaults(60, seed=3, low=4, high=6, kinds=("partition",))
    (fault,) = source.due(10.0, 5, True)
    assert fault.kind == "partition" and 5 <= fault.duration_s <= 30  # a drawn network fault lasts


def test_a_partition_names_a_group_of_nodes():
    fault = parse_fault("partition@4:target=4+5:for=12")
    assert fault.group == (4, 5) and fault.node is None and str(fault) == "partition@4:target=4+5:for=12"
    validate([fault], steps=10, nodes=6, nproc=1, etcd_members=1, hosts=True)
    with pytest.raises(FaultSpecError, match="only a partition takes a group"):
        parse_fault("isolate-node@4:target=1+2:for=5")
    with pytest.raises(FaultSpecError, match="name a group of them that leaves some out"):
        validate([parse_fault("partition@4:target=0+1+2+3:for=5")], steps=10, nodes=4, nproc=1,
                 etcd_members=1, hosts=True)
    with pytest.raises(FaultSpecError, match="--etcd-members 3"):
        validate([parse_fault("isolate-etcd-member@4:target=0:for=5")], steps=10, nodes=4, nproc=1,
                 etcd_members=1, hosts=True)


@pytest.mark.parametrize("trace_text, extra, message", [
    ("0,add,a\n0,add,b\n0,add,c\n0,add,d\n2000,remove;a\n", [], "trace.csv:5: expected time_ms,add|remove,NODE"),
    ("0,add,a\n0,add,b\n", [], "never has 4 nodes live at once (at most 2)"),
    ("0,add,a\n0,add,b\n0,add,c\n0,add,d\n", ["--fault", "kill-node@3"], "--trace replays alone"),
    ("0,add,a\n0,add,b\n0,add,c\n0,add,d\n", ["--time-scale", "0"], "--time-scale 0: must be > 0"),
    (None, ["--random", "2", "--random-kinds", "kill-node,melt"], "unknown kind(s) ['melt']"),
    (None, ["--random", "2", "--random-nodes", "5"], "expected LOW-HIGH"),
])
def test_bad_traces_and_random_settings_are_refused_before_anything_starts(trace_text, extra, message,
                                                                           tmp_path, refused):
    if trace_text is not None:
        (tmp_path / "trace.csv").write_text(trace_text)
        extra = ["--trace", str(tmp_path / "trace.csv"), *extra]
    assert message in refused(["--nodes", "4", *extra])
    assert not (tmp_path / "out").exists(), "nothing may start for bad input"


@pytest.mark.parametrize("extra, message", [
    (["--nproc-per-node", "0"], "--nproc-per-node must be at least 1, got 0"),
    (["--timeout", "0"], "--timeout must be positive"),
    (["--random-kinds", "kill-node"], "--random-kinds shape(s) the faults of --random RATE, which was not given"),
    (["--time-scale", "4"], "--time-scale speeds up a --trace replay, and no --trace was given"),
])
def test_options_that_would_be_ignored_or_break_the_reference_are_refused(extra, message, tmp_path, refused):
    """They were dropped silently ("no faults", then "nothing was lost"), or ended in the
    reference run's traceback."""
    assert message in refused(["--nodes", "4", *extra])
    assert not (tmp_path / "out").exists(), "nothing may start for bad input"


def test_a_corpus_prepared_again_gets_a_reference_of_its_own(tmp_path):
    """The cached fault-free reference is keyed by the data the job reads, not only its
    config: shards prepared again at the same path must not reuse the old losses."""
    from pathlib import Path

    from planaria.chaos.harness import ChaosSettings, _reference_key

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "manifest.json").write_text('{"splits": {"train": [{"blake2b": "aa"}]}}')
    settings = ChaosSettings(Path(TINY), [f"data.source={corpus}"], nodes=2)
    before = _reference_key(settings)
    assert _reference_key(settings) == before
    (corpus / "manifest.json").write_text('{"splits": {"train": [{"blake2b": "bbbb"}]}}')
    assert _reference_key(settings) != before
