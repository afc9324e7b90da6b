"""Whether a worker's process is stopped: its state in Linux's /proc, which its agent
on the same host reads at every look.

A stopped process (SIGSTOP, SIGTSTP: state "T") keeps its sockets open and answers
nothing; its peers see nothing wrong until a collective times out, and its heartbeat
(`runtime/contract/heartbeat.py`) shows it only after `comm.heartbeat_timeout_s`. Its
state says so at once. Read by hand: one field of one line, where psutil would be a
compiled dependency of the agent for it. Torch-free.
"""
from __future__ import annotations


def is_stopped(pid: int) -> bool:
    """The process is stopped by a signal (state "T"; not "t", stopped by a debugger that
    traces it, which is someone's deliberate pause). False once it is gone, and where
    there is no /proc."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            line = stat.read()
    except OSError:
        return False
    # "pid (comm) state ...": comm may hold spaces and parentheses; the state follows the last ")".
    rest = line[line.rfind(b")") + 1:].split()
    return bool(rest) and rest[0] == b"T"
