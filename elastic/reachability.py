"""Which nodes can train together when the network splits them: the largest group of
nodes that all reach each other (docs/recovery.md, "Partitions").

Every agent reports the nodes it cannot reach (`planaria.elastic.peer_probe`); two
nodes can share an epoch only if neither reports the other. A job's nodes after a
partition are then a graph whose edges are the pairs that reach each other both ways,
and an epoch needs a clique of it: every stage exchanges activations with its
neighbours and gradients with its replicas, and any pair may be asked to copy layers.
The controller plans over the largest clique; ties go to the group holding the
leader (its agent can keep leading it), then to the group whose sorted names come
first (a choice that does not depend on the order of the reports). The other nodes wait as nodes that no
plan uses do, and are planned in once they reach every node of the job again.

A maximum clique is NP-hard in general; the graphs here are a job's nodes with a few
cuts (a partition's cliques are its sides), for which networkx's Bron-Kerbosch
enumeration of maximal cliques (`find_cliques`) is fast. It is only run when some
node reports an unreachable peer.

`Partitions` is the leader's side: it ends an epoch two of whose nodes cannot reach each
other, plans over the largest group once every cut is reported from both ends, keeps a
joiner out until it reaches every node of the plan, and waits while no group can train.
It says each of these once while it lasts. Loaded by an agent, through the controller:
no torch.
"""
from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Callable


def cut_pairs(nodes: Iterable[str], unreachable: Mapping[str, Iterable[str]]) -> list[tuple[str, str]]:
    """The pairs of `nodes` (sorted, each pair sorted) of which one reports the other
    unreachable."""
    nodes = set(nodes)
    pairs = {tuple(sorted((a, b))) for a, cut in unreachable.items() if a in nodes
             for b in cut if b in nodes and b != a}
    return sorted(pairs)


def reachable_group(nodes: Iterable[str], unreachable: Mapping[str, Iterable[str]],
                    leader: str | None = None) -> list[str]:
    """The largest set of `nodes` that all reach each other (module docstring for the
    tie-breaks), sorted."""
    nodes = sorted(set(nodes))
    cuts = cut_pairs(nodes, unreachable)
    if not cuts:
        return nodes
    import networkx  # only when the network is split (a few hundred ms to import)

    graph = networkx.complete_graph(nodes)
    graph.remove_edges_from(cuts)
    cliques = [sorted(c) for c in networkx.find_cliques(graph)]
    return min(cliques, key=lambda c: (-len(c), leader not in c, c))


def reaches_all(node: str, group: Iterable[str], unreachable: Mapping[str, Iterable[str]]) -> bool:
    """True when `node` and every node of `group` reach each other."""
    return not any(node in pair for pair in cut_pairs([node, *group], unreachable))


class Partitions:
    """The leader's handling of a network split (module docstring)."""

    def __init__(self, unreachable: Callable[[], Mapping[str, Iterable[str]]], leader: str | None = None,
                 log: Callable[[str], None] = print):
        self.unreachable = unreachable
        """{node: the nodes it reports it cannot reach} (`planaria.elastic.peer_probe`);
        the default, nobody, for a job whose nodes share one host."""
        self.leader = leader
        """The leader's own node (it wins a tie between two sides of a partition)."""
        self.log = log
        self._said: dict[str, object] = {}
        """What was last logged of a condition that lasts (a cut, joiners out of reach)."""

    def cut(self, nodes: list[str], epoch: int, views: Mapping[str, Iterable[str]]) -> bool:
        """True when two of `nodes` (epoch `epoch`'s) cannot reach each other: the epoch
        cannot go on (its collectives across the cut hang), and is ended as a failure at
        once rather than at the collective timeout."""
        cuts = cut_pairs(nodes, views)
        if cuts and self._said.get("cut") != (epoch, cuts):
            self._said["cut"] = (epoch, cuts)
            self.log(f"controller: nodes of epoch {epoch} cannot reach each other "
                     f"({', '.join(f'{a} - {b}' for a, b in cuts)}); ending the epoch")
        return bool(cuts)

    def reachable_joiners(self, joiners: set[str], planned: list[str],
                          views: Mapping[str, Iterable[str]]) -> set[str]:
        """The joiners that reach every node of `planned`; the others wait (said once)."""
        out_of_reach = sorted(n for n in joiners if not reaches_all(n, planned, views))
        if out_of_reach and self._said.get("out of reach") != out_of_reach:
            self.log(f"controller: {out_of_reach} cannot reach every node of the job; they wait "
                     "until they can")
        self._said["out of reach"] = out_of_reach
        return joiners - set(out_of_reach)

    def largest_group(self, nodes: list[str]) -> tuple[list[str], list[str]]:
        """(the largest group of `nodes` that all reach each other, the rest): the rest
        stay alive and wait, and join again once they reach the job's nodes."""
        group = reachable_group(nodes, self.settled_views(nodes), leader=self.leader)
        rest = sorted(set(nodes) - set(group))
        if rest and self._said.get("partition") != (group, rest):
            self._said["partition"] = (group, rest)
            self.log(f"controller: {rest} cannot reach {group} (a partition); planning over "
                     f"{group}, the others wait until they reach it")
        return group, rest

    def wait_out(self, cut_off: list[str], why: str) -> None:
        """Publish nothing: every node is alive, only the network splits them, and the
        epoch is tried again at the next poll (the failed epoch's statuses stand), with
        the reachability of then. A job is never failed for a partition: it heals."""
        if self._said.get("waiting") != (tuple(cut_off), why):
            self._said["waiting"] = (tuple(cut_off), why)
            self.log(f"controller: {why}; waiting for the partition to heal ({cut_off} alive, out of reach)")

    def settled_views(self, nodes: list[str], quiet_s: float = 1.0, limit_s: float = 6.0):
        """The nodes' reachability once every cut is reported from both ends (a moment
        later), or once nothing changed for `quiet_s` (several probe rounds: a node cut
        off etcd as well cannot report), at most `limit_s`. Each node's probes see a cut
        on their own clock (within a round or two of each other: `peer_probe`): planned
        over the first reports alone, a side could keep a node whose own cuts were not
        reported yet, and the epoch would fail once more."""
        views = self.unreachable()
        if not cut_pairs(nodes, views):
            return views
        started = changed = time.monotonic()
        while time.monotonic() - started < limit_s:
            quiet = time.monotonic() - changed
            if quiet >= quiet_s or (quiet >= 0.25 and _seen_whole(nodes, views)):
                break
            time.sleep(0.05)
            now = self.unreachable()
            if cut_pairs(nodes, now) != cut_pairs(nodes, views):
                views, changed = now, time.monotonic()
        return views


def isolated(nodes: Iterable[str], views: Mapping[str, Iterable[str]]) -> set[str]:
    """The nodes of `nodes` that every other node of them reports unreachable: cut off
    from all of them (it may not reach etcd to report anything itself; whatever it
    reports, no plan keeps it with any of them)."""
    nodes = set(nodes)
    if len(nodes) < 2:
        return set()
    # Counted from the reports (a few cuts each, none in the usual case), not by asking
    # every node about every other: the leader asks while the statuses come in.
    reported = Counter(b for a in nodes for b in set(views.get(a, ())) if b in nodes and b != a)
    return {node for node, count in reported.items() if count == len(nodes) - 1}


def _seen_whole(nodes: list[str], views: Mapping[str, Iterable[str]]) -> bool:
    """True when every cut between `nodes` is seen whole: each end of it reports the
    other, or one end is cut off from all the others (`isolated`)."""
    alone = isolated(nodes, views)
    return all((b in views.get(a, ()) and a in views.get(b, ())) or a in alone or b in alone
               for a, b in cut_pairs(nodes, views))
