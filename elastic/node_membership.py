"""A node's membership of the job under its agent's etcd lease, and the campaign for
the leadership under the same lease (docs/control_plane.md, "Agents and the leader").

Keys, under /planaria/<run-id>/ (the job's `EtcdKeyValue` prefix):

    nodes/<node>            the node, bound to its agent's lease
    leader                  the leading agent's node, bound to its lease

`Membership` owns the lease in force, the flag that says it was lost, and the lock under
which the two change together. The other keys an agent binds to its lease (its workers'
`alive/` keys, its notice, its probe's address) are its other parts'; the agent writes
them again after `register` (`Agent._register`).

A lease lost while etcd was away is replaced by the agent's main loop; a leader acts on
membership only once every agent has had a lease period to renew its own (`settled`),
so that a returning etcd causes no reconfiguration. Imports no torch (a node's agent
loads it).
"""
from __future__ import annotations

import threading
import time
import uuid
from typing import Callable

from planaria.elastic.etcd_client import EtcdClient, EtcdUnavailable, LeaseExpired
from planaria.runtime.contract import keys
from planaria.runtime.contract.membership import NodeRegistration


class NodeNameTaken(RuntimeError):
    """Another live agent of the run registered under this agent's node name."""


class Membership:
    """This node's lease, its registration under it, its renewal, and its loss."""

    def __init__(self, client: EtcdClient, prefix: str, *, node: str, nproc: int, run_id: str, ttl_s: int,
                 log: Callable[[str], None], leader_view: Callable[[], bytes | None] | None = None):
        self.client, self.prefix, self.node, self.nproc, self.run_id = client, prefix, node, nproc, run_id
        self.leader_view = leader_view
        """`leader` as a watch mirrors it (no request); None: read from etcd at every campaign."""
        self.ttl_s = ttl_s
        self.log = log
        self.lease = None
        """The lease in force (None before `register`): every key of this node is bound to it."""
        self.lost = threading.Event()
        """Set once the lease in force expired: the agent's main loop registers again."""
        self._swap = threading.Lock()
        """Held while a lease is declared lost or replaced: a refresh of the old lease that
        fails as `register` puts the new one in place must not mark the new one lost."""
        self.agent_id = uuid.uuid4().hex
        """Tells this agent's claim on its node name from another's (`register`)."""
        self._said_settling: float | None = None

    def register(self) -> None:
        """A lease, and under it the node (again, after a lease expired).

        The node's key is created, never overwritten: two agents under one name (two
        machines given the same --node-rank, say) would each count the other's workers
        as their own. A name held by a live agent is waited for one lease TTL and a half
        (an agent that died and is started again finds its old lease still running),
        then refused (`NodeNameTaken`)."""
        lease = self.client.lease(self.ttl_s)
        key = self.prefix + keys.node_registration(self.node)
        mine = NodeRegistration(self.nproc, self.agent_id).to_json().encode()
        deadline = time.monotonic() + 1.5 * self.ttl_s + 1
        while True:
            created, lease = self._create(key, mine, lease)
            if created:
                break
            if self.client.get(key)[0] == mine:
                break  # ours: the create's reply was lost and it was retried
            if time.monotonic() > deadline:
                raise NodeNameTaken(f"refused: another live agent of run {self.run_id!r} is node "
                                    f"{self.node!r}; give each machine its own --node-rank (or --node)")
            time.sleep(0.5)
            if not self.client.refresh(lease):  # kept alive while waiting: nobody else does yet
                lease = self.client.lease(self.ttl_s)
        # The flag is cleared only once the new lease is in place: cleared first, a refresh
        # of the old lease failing meanwhile (the keep-alive thread, the controller's
        # `still_leading`) set it again, and the node registered twice.
        with self._swap:
            self.lease = lease
            self.lost.clear()

    def _create(self, key: str, value: bytes, lease) -> tuple[bool, object]:
        """Create `key` under `lease`: whether it was (False: it exists), and the lease it
        is under. A lease that expired between its grant and the create (an agent whose
        host stalled longer than the TTL) is granted again, and the create made under it."""
        try:
            return self.client.put_if_absent(key, value, lease=lease), lease
        except LeaseExpired:
            lease = self.client.lease(self.ttl_s)
            return self.client.put_if_absent(key, value, lease=lease), lease

    def keep_alive(self, stop: threading.Event, signalled: Callable[[], bool]) -> None:
        """Renew the lease a third of its TTL apart until `stop` (a thread's loop);
        `signalled`: the agent is stopping on a signal (etcd's failure is then its abort's)."""
        while not stop.wait(self.ttl_s / 3):
            if self.lost.is_set():
                continue  # the main loop registers again
            lease = self.lease
            try:
                if not self.client.refresh(lease):
                    self.mark_lost(lease)
            except EtcdUnavailable as err:  # past --etcd-outage-limit: the main loop ends it
                if not signalled():
                    self.log(str(err))
            except Exception as err:  # noqa: BLE001 - a dead keep-alive thread would let the
                # lease expire and take a healthy node out of the job: say it, try again
                self.log(f"keeping the lease alive failed ({type(err).__name__}: {err}); trying again")

    def mark_lost(self, lease) -> None:
        """`lease` expired: the main loop registers again, unless `register` has replaced
        it already (a refresh of the old lease that fails late says nothing of the new one)."""
        with self._swap:
            if lease is self.lease:
                self.lost.set()

    def campaign(self) -> str | None:
        """Campaign for `leader` (a create-if-absent under the lease), or read who holds
        it: a lease that expired while etcd was away may have handed it to another agent.
        The node that leads the job now (this one, if it won), or None.

        With a mirror of `leader` (`leader_view`) a campaign is only made while the key is
        absent: one create when a leader's lease is gone, not one at every look (ten a
        second per node). A stale view does no harm: the controller asks `still_leading`
        of etcd itself before it acts."""
        if self.leader_view is not None and (held := self.leader_view()) is not None:
            return held.decode()
        won = self.client.put_if_absent(self.prefix + keys.LEADER, self.node.encode(), lease=self.lease)
        holder = self.node.encode() if won else self.client.get(self.prefix + keys.LEADER)[0]
        return None if holder is None else holder.decode()

    def still_leading(self) -> bool:
        """The lease still exists and the leader key is still this node's: asked by the
        controller before acting, since a node cut off for longer than its lease's TTL
        may have a successor already."""
        lease = self.lease
        try:
            alive = self.client.refresh(lease)
        except LeaseExpired:
            alive = False
        if not alive:
            self.mark_lost(lease)
            return False
        return self.client.get(self.prefix + keys.LEADER)[0] == self.node.encode()

    def settled(self) -> bool:
        """False for a lease period (and a margin) after an etcd outage ended: every agent
        renews its lease or registers again meanwhile, so that the leader never takes a
        worker whose key has not come back yet for a dead one.

        Not after an outage shorter than a third of the TTL (an agent's renewal period): a
        lease renewed every third of its TTL has two thirds of it left when its renewal
        is due, so a renewal held up for less than a third still lands in time, and no
        agent's key can have lapsed for it. Such blips (a request retried once on a
        loaded etcd, a member's failover) would otherwise hold every decision for a whole
        TTL: at a long TTL, minutes."""
        back_at = self.client.back_at
        if back_at is None or self.client.away_s < self.ttl_s / 3:
            return True
        wait = back_at + self.ttl_s + 2 - time.monotonic()
        if wait <= 0:
            return True
        if self._said_settling != back_at:
            self._said_settling = back_at
            self.log(f"etcd is back; the leader waits {wait:.0f} s for every node to renew its "
                     "membership before acting on it")
        return False
