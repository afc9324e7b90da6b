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
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping


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
