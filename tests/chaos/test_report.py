"""The chaos report read back from the commit logs a run leaves, written and loaded again,
and drawn."""
from __future__ import annotations

from dataclasses import replace

from planaria.chaos.plot import plot_report
from planaria.chaos.report import InjectedFault, build_report, load_report, longest_commit_gap, write_report
from planaria.chaos.report_tables import format_epoch_event
from planaria.runtime.contract.epochs import EpochEvent, EpochTiming
from planaria.runtime.contract.logs import CommitEntry


def entry(iteration, loss, epoch, time, rolled_forward=False) -> CommitEntry:
    return CommitEntry(step=iteration, loss=loss, grad_norm=1.0, epoch=epoch, time=time,
                       rolled_forward=rolled_forward)


def entries(*dicts) -> list[CommitEntry]:
    return [entry(**d) for d in dicts]


def event(epoch, detected_s, published_s, failed=(), joined=(), **more) -> EpochEvent:
    return EpochEvent(epoch=epoch, reason=more.pop("reason", "failure"), detected_s=detected_s,
                      statuses_s=detected_s, planned_s=published_s, published_s=published_s,
                      failed=tuple(failed), joined=tuple(joined), **more)


def commit_log(path, dicts):
    path.write_text("".join(entry(**d).to_json() + "\n" for d in dicts))


def test_a_report_from_commit_logs_round_trips_and_draws(tmp_path):
    """Two nodes train steps 0-4 in epoch 0; node1 dies; node0 trains 5-9 alone in epoch 1,
    after going back to a checkpoint of step 2 (so 3 and 4 are committed twice)."""
    t0 = 1000.0
    node0 = [{"iteration": i, "loss": 5.0 - i * 0.1, "epoch": 0, "time": t0 + i} for i in range(5)]
    node0 += [{"iteration": i, "loss": 5.0 - i * 0.1, "epoch": 1, "time": t0 + 4 + i} for i in range(3, 10)]
    node1 = [{"iteration": i, "loss": 5.0 - i * 0.1, "epoch": 0, "time": t0 + i + 0.01} for i in range(5)]
    commit_log(tmp_path / "commits-node0.0.jsonl", node0)
    commit_log(tmp_path / "commits-node1.0.jsonl", node1)
    reference = {"losses": {str(i): 5.0 - i * 0.1 for i in range(10)}, "step_s": 1.0}
    fault = InjectedFault("kill-node@5:target=1", 5, t0 + 5.5)
    restore = event(1, t0 + 6, t0 + 6.5, restored=2, transfers=0, plan_shape=(1,))
    report = build_report(out_dir=tmp_path, steps=10, outcome="ok", faults=[fault], events=[restore],
                          timings={1: [EpochTiming(record_s=t0 + 6.5, rendezvous_s=t0 + 6.6, transfer_s=t0 + 6.7,
                                                   first_step_s=t0 + 7)]},
                          reference=reference, live_nodes=[(t0, 2), (t0 + 5.5, 1)], wall_s=20.0)
    assert report.completed and report.steps_committed == 10
    assert report.committed_steps_lost == 2 and report.checkpoint_loads == 1
    assert report.max_loss_diff == 0.0
    assert report.training_nodes == [(0.0, 2), (7.0, 1)]
    recovery, = report.recoveries
    assert recovery.detect_s == 0.5 and recovery.total_s == 1.5  # iteration 3 again at t0 + 7
    assert abs(recovery.rendezvous_s - 0.1) < 1e-9
    # From step 4's commit (t0 + 4.01) to the next (t0 + 7), one step of 1 s of it training.
    assert abs(recovery.pause_s - 2.99) < 1e-9 and report.own_step_s == 1.0
    assert abs(recovery.switch_s - 1.99) < 1e-9
    # The steps after it are of 1 s again: the longest gap around the change is the pause,
    # counted from each step's first commit (step 4's: node0's, at t0 + 4).
    assert abs(recovery.longest_gap_s - 3.0) < 1e-9

    write_report(report, tmp_path)
    again = load_report(tmp_path / "report.json")
    assert again == report
    png = plot_report(again, tmp_path / "report.png")
    assert png.stat().st_size > 10_000


def test_an_epoch_event_reads_as_a_line():
    change = event(3, 10.0, 10.25, failed=["node2.0"], joined=["node6.0"], transfers=1,
                   moved_bytes=3 * 2**19, plan_shape=(2, 2), first_iteration=61)
    assert format_epoch_event(change) == (
        "  [cyan]epoch 3[/]: failure (failed node2.0; joined node6.0) -> pipelines of [2, 2] stages "
        "from step 61, 1 layer copy (1.50 MiB), published 0.25 s after detection")
    change = replace(change, restored=40, failed=(), joined=())
    assert "(-) -> " in format_epoch_event(change)
    assert "back to the checkpoint of step 40" in format_epoch_event(change)


def test_a_roll_forward_is_not_a_lost_step_but_a_second_commit_is():
    from planaria.chaos.report import step_losses

    def entry(iteration, epoch, rolled=False):
        return globals()["entry"](iteration, 1.0, epoch, 100.0 + iteration + epoch, rolled_forward=rolled)

    # node1 was one step behind when epoch 0 failed: epoch 1 rolls step 2 forward on it.
    rolled = {"node0": [entry(0, 0), entry(1, 0), entry(2, 0), entry(3, 1)],
              "node1": [entry(0, 0), entry(1, 0), entry(2, 1, rolled=True), entry(3, 1)]}
    assert step_losses(rolled)[2] == 0
    # Every replica lost: epoch 1 went back to the checkpoint of step 1 and ran step 2 again.
    redone = {"node0": [entry(0, 0), entry(1, 0), entry(2, 0), entry(2, 1), entry(3, 1)]}
    assert step_losses(redone)[2] == 1


def test_ettr_against_the_runs_own_steps_leaves_out_the_machines_drift():
    """The run stepped every 0.8 s where its reference took 1.0 s, and lost 10 s to one
    fault: against its own steps (those 20 s or more after the fault, and before it) the
    ETTR counts the fault alone."""
    from planaria.chaos.report import ettr_against, own_step_s

    times = [0.8 * i for i in range(50)] + [40 + 10 + 0.8 * i for i in range(50)]  # fault at 40 s
    own = own_step_s(times, [40.0])
    assert abs(own - 0.8) < 1e-9
    quiet_after = [b - a for a, b in zip(times, times[1:]) if a >= 60]
    assert quiet_after, "the steps 20 s after the fault count too"
    assert abs(ettr_against(100, times[-1], own) - 100 * 0.8 / (times[-1] + 0.8)) < 1e-12
    assert ettr_against(100, times[-1], 1.0) > ettr_against(100, times[-1], own)  # the drift inflates it
    assert own_step_s(times, [0.8 * i for i in range(0, 100, 10)]) is None  # no step far from a fault


def test_a_fault_during_a_reconfiguration_is_credited_to_the_one_that_took_it_in():
    """node2 dies at t=10; the controller detects it at 10.2 and collects statuses until
    13. node5's agent is killed at 11: that reconfiguration counts node5.0 among the
    failed too, and it is the one that recovered from both. A fault it did not count
    (node4 at 12.9, seen only after the plan went out) goes to the next one."""
    from planaria.chaos.report import recoveries

    events = [event(**{"epoch": 1, "detected_s": 10.2, "published_s": 13.0, "failed": ["node2.0", "node5.0"]}),
              event(**{"epoch": 2, "detected_s": 13.5, "published_s": 14.0, "failed": ["node4.0"]})]
    logs = {"node0.0": [entry(3, 1.0, 1, 13.4),
                        entry(4, 1.0, 2, 14.3)]}
    faults = [InjectedFault("kill-node@3:target=2", 3, 10.0), InjectedFault("kill-agent@3+1:target=5", 3, 11.0),
              InjectedFault("kill-node@3:target=4", 3, 12.9)]
    node, agent, late = recoveries(faults, events, {}, logs)
    assert (node.epoch, node.note) == (1, "") and abs(node.detect_s - 0.2) < 1e-9
    assert agent.epoch == 1 and agent.detect_s is None and "under way" in agent.note
    assert abs(agent.plan_s - 2.0) < 1e-9 and abs(agent.total_s - 2.4) < 1e-9
    assert late.epoch == 2 and abs(late.detect_s - 0.6) < 1e-9


def test_a_node_added_during_a_recovery_is_credited_to_the_epoch_it_joined():
    """node1 is preempted at t=10; the controller detects it at 10.4 and publishes epoch 1
    at 13.2. node4 arrives at 12, while that plan is being made, and epoch 1 takes it in
    (joined). A node that arrives after the last epoch never joined: the job ended first."""
    from planaria.chaos.report import recoveries

    events = [event(**{"epoch": 1, "detected_s": 10.4, "published_s": 13.2, "failed": ["node1.0"],
               "joined": ["node4.0"]}),
              event(**{"epoch": 2, "detected_s": 20.0, "published_s": 21.0, "failed": ["node2.0"]})]
    logs = {"node0.0": [entry(43, 1.0, 1, 15.0),
                        entry(60, 1.0, 2, 22.0)]}
    faults = [InjectedFault("kill-node@43:target=1", 43, 10.0), InjectedFault("add-node@43:target=4", 43, 12.0),
              InjectedFault("add-node@55:target=5", 55, 19.0), InjectedFault("kill-node@55:target=2", 55, 19.5)]
    removal, addition, late, second = recoveries(faults, events, {}, logs)
    assert removal.epoch == 1 and abs(removal.detect_s - 0.4) < 1e-9
    assert addition.epoch == 1 and addition.detect_s is None and "arrived while" in addition.note
    assert abs(addition.plan_s - 1.2) < 1e-9 and abs(addition.total_s - 3.0) < 1e-9
    # epoch 2 only replaced node2: node5 never joined, however close the epoch came after it
    assert late.epoch is None and late.note == "the job ended before the node joined"
    assert second.epoch == 2


def test_a_step_run_again_after_a_rollback_is_compared_with_the_reference_too(tmp_path):
    """Steps 3 and 4, run again after going back to a checkpoint, came out wrong: the
    report must say so (it compared only each step's first commit)."""
    t0 = 1000.0
    first = [{"iteration": i, "loss": 5.0 - i * 0.1, "epoch": 0, "time": t0 + i} for i in range(5)]
    again = [{"iteration": i, "loss": 99.0 if i < 5 else 5.0 - i * 0.1, "epoch": 1, "time": t0 + 4 + i}
             for i in range(3, 8)]
    commit_log(tmp_path / "commits-node0.0.jsonl", first + again)
    reference = {"losses": {str(i): 5.0 - i * 0.1 for i in range(8)}, "step_s": 1.0}
    report = build_report(out_dir=tmp_path, steps=8, outcome="ok", faults=[], events=[], timings={},
                          reference=reference, live_nodes=[(t0, 1)], wall_s=12.0)
    assert abs(report.max_loss_diff - (99.0 - 4.6)) < 1e-9


def test_a_kill_is_credited_to_the_epoch_that_names_its_node_not_a_join_in_between():
    """node3 is killed at t=10; a join is handled at 10.5 (epoch 2) before the failure is
    (epoch 3, naming node3): the kill's recovery is epoch 3's."""
    from planaria.chaos.report import recoveries

    events = [event(**{"epoch": 2, "detected_s": 10.5, "published_s": 11.0, "failed": [], "joined": ["node6.0"]}),
              event(**{"epoch": 3, "detected_s": 13.1, "published_s": 14.0, "failed": ["node3.0"]})]
    logs = {"node0.0": [entry(7, 1.0, 2, 11.5),
                        entry(8, 1.0, 3, 14.5)]}
    (kill,) = recoveries([InjectedFault("kill-node@7:target=3", 7, 10.0)], events, {}, logs)
    assert kill.epoch == 3 and abs(kill.detect_s - 3.1) < 1e-9


def test_the_longest_gap_around_a_change_can_be_a_step_after_it():
    """A switch can leave work to the new epoch's next steps: the longest gap between two
    commits is looked for up to `GAP_STEPS` steps after its first."""
    steps = [(0.0, 0), (1.0, 0), (2.0, 0), (3.5, 1), (5.5, 1), (6.5, 1), (7.5, 1)]
    assert longest_commit_gap(steps, 1, resumed=3.5) == 2.0
    assert longest_commit_gap(steps[:4], 1, resumed=3.5) == 1.5  # the job's end
    assert longest_commit_gap(steps, 1, resumed=None) is None
    # A second change within those steps is its own: its pause is not the first's.
    assert longest_commit_gap([*steps[:5], (9.5, 2)], 1, resumed=3.5) == 2.0
