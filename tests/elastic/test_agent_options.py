"""The agent's etcd options as a user gives them: `--etcd-timeout` sets the request timeout
and the streams' keep-alive with it, and a timeout that is no number of seconds is refused
saying so."""
from __future__ import annotations

import pytest

from planaria.elastic.agent_options import agent_parser, etcd_settings

BASE = ["--node", "node0", "--nproc", "1", "--run-id", "job", "--etcd", "10.0.0.5:2379", "--nnodes", "1", "train.py"]


def settings(*more: str):
    return etcd_settings(agent_parser().parse_args([*more, *BASE]))


def test_the_default_is_five_seconds_and_pings_every_ten():
    found = settings()
    assert (found.timeout_s, found.keepalive_s) == (5.0, 10.0)


def test_a_slow_etcd_gets_a_longer_timeout_and_its_streams_pings_follow():
    found = settings("--etcd-timeout", "60")
    assert (found.timeout_s, found.keepalive_s) == (60.0, 120.0)
    assert settings("--etcd-timeout", "2").keepalive_s == 10.0  # etcd refuses pings under 5 s apart


@pytest.mark.parametrize("given", ["0", "-3", "soon"])
def test_a_timeout_that_is_no_number_of_seconds_is_refused(given, capsys):
    with pytest.raises(SystemExit):
        settings("--etcd-timeout", given)
    assert "--etcd-timeout" in capsys.readouterr().err
