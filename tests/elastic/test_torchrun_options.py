"""Every torchrun option, under `planaria-run -m planaria.train`, is honoured with
torchrun's meaning or refused with a word on what to do: none is silently ignored."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from torch.distributed.run import get_args_parser

from planaria.elastic.launcher import main as planaria_run
from planaria.elastic.torchrun_options import HONOURED, RDZV_CONF_KEYS, REFUSED
from tests.launch import TINY

DOCS = Path(__file__).resolve().parents[2] / "docs" / "control_plane.md"


def _options():
    return [a for a in get_args_parser()._actions if a.dest != "help"]


def _set(action) -> list[str]:
    """The option on a command line, at a value other than its default."""
    flag = action.option_strings[-1] if action.option_strings else None
    if action.nargs == 0:
        return [flag]
    if action.choices:
        return [flag, next(c for c in action.choices if c != action.default)]
    value = {int: "29511"}.get(action.type, "other")
    return [flag, value]


def test_every_option_of_torchruns_parser_is_honoured_or_refused():
    dests = {a.dest for a in _options()}
    neither = sorted(dests - set(HONOURED) - set(REFUSED))
    assert not neither, f"torchrun options neither honoured nor refused: {neither}"
    assert not set(HONOURED) & set(REFUSED)
    assert not (set(HONOURED) | set(REFUSED)) - dests, "options listed that torchrun does not have"


@pytest.mark.parametrize("dest", sorted(REFUSED))
def test_a_refused_option_stops_the_job_before_it_starts_and_says_what_to_do(dest, capsys):
    action = next(a for a in _options() if a.dest == dest)
    code = planaria_run(["--standalone", *_set(action), "-m", "planaria.train", str(TINY)])
    err = capsys.readouterr().err
    assert code == 2
    assert "is not used by a Planaria job" in err and REFUSED[dest] in err
    assert max(action.option_strings, key=len) in err


def test_an_unknown_rdzv_conf_key_is_refused_by_name(capsys):
    code = planaria_run(["--standalone", "--rdzv-conf", "join_timeout=5,keep_alive_interval=3",
                         "-m", "planaria.train", str(TINY)])
    err = capsys.readouterr().err
    assert code == 2 and "--rdzv-conf keep_alive_interval: not read by a Planaria job" in err
    assert "join_timeout" not in err.split("it reads")[0]


@pytest.mark.parametrize("flags, message", [
    (["--tee", "5"], "--tee '5' is not a stream choice"),
    (["--redirects", "0:x"], "--redirects '0:x' is not a stream choice"),
    (["--local-ranks-filter", "a"], "--local-ranks-filter 'a': expected comma-separated local ranks"),
    (["--nnodes", "3:2"], "--nnodes '3:2': MIN must be at least 1 and MAX at least MIN"),
])
def test_malformed_choices_are_one_line_errors(flags, message, capsys):
    assert planaria_run(["--standalone", *flags, "-m", "planaria.train", str(TINY)]) == 2
    assert message in capsys.readouterr().err


def test_the_docs_table_lists_every_option_and_rdzv_conf_key():
    text = DOCS.read_text()
    table = text[text.index("### Every torchrun option"):]
    for action in _options():
        if action.option_strings:
            assert f"`{max(action.option_strings, key=len)}`" in table, action.dest
    for key in RDZV_CONF_KEYS:
        assert f"`{key}`" in table, key


PRINTS = "import os, sys; print('out', os.environ['LOCAL_RANK']); print('err', os.environ['LOCAL_RANK'], file=sys.stderr)"


def _files(run_dir: Path) -> set[str]:
    return {str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if p.is_file()}


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_tee_and_local_ranks_filter_do_what_torchrun_does(tmp_path):
    """`--tee 3 --local-ranks-filter 0 --log-dir D`: torchrun and planaria-run write the
    same files under D (stdout.log and stderr.log per local rank, in attempt_0), and the
    console shows rank 0's lines only, prefixed as torchrun prefixes them."""
    script = tmp_path / "prints.py"
    script.write_text(PRINTS)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    flags = ["--standalone", "--nproc-per-node=2", "--tee", "3", "--local-ranks-filter", "0"]
    theirs = subprocess.run([sys.executable, "-m", "torch.distributed.run", *flags, "--log-dir",
                             str(tmp_path / "torchrun"), str(script)], capture_output=True, text=True,
                            timeout=120, env=env)
    assert theirs.returncode == 0, theirs.stderr[-3000:]
    ours = subprocess.run([sys.executable, "-m", "planaria.elastic.launcher", *flags, "--log-dir",
                           str(tmp_path / "planaria"), "-m", "planaria.train", str(TINY), "train.steps=3",
                           "eval.every=0", f"output.dir={tmp_path / 'out'}"],
                          capture_output=True, text=True, timeout=200, env=env)
    assert ours.returncode == 0, ours.stdout[-3000:] + ours.stderr[-3000:]
    [their_run] = (tmp_path / "torchrun").iterdir()
    [our_run] = (tmp_path / "planaria").iterdir()
    expected = {f"attempt_0/{rank}/{name}" for rank in (0, 1) for name in ("stdout.log", "stderr.log")}
    assert _files(their_run) - {"attempt_0/filtered_stdout.log", "attempt_0/filtered_stderr.log"} == expected
    assert _files(our_run) == expected
    assert re.fullmatch(r".+_\w+", our_run.name) and "out 0" in theirs.stdout
    # rank 1's lines are in its files, never on the console; rank 0's are in both
    assert "[default0]:out 0" in theirs.stdout and "[default1]" not in theirs.stdout + theirs.stderr
    rank1 = (our_run / "attempt_0/1/stdout.log").read_text()
    assert "step 1/3" in rank1 or "epoch" in rank1, rank1[:2000]
    assert "[default0]:" in ours.stdout + ours.stderr
    assert "[default1]" not in ours.stdout + ours.stderr
    shown = [line.split(":", 1)[1] for line in (ours.stdout + ours.stderr).splitlines()
             if line.startswith("[default0]:")]
    written = (our_run / "attempt_0/0/stdout.log").read_text().splitlines() + \
        (our_run / "attempt_0/0/stderr.log").read_text().splitlines()
    assert sorted(shown) == sorted(written)
