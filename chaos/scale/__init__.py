"""The scale harness: Planaria's real control plane for thousands of simulated workers.

`planaria.chaos.scale` runs N simulated nodes of G simulated workers against a real etcd
cluster of three members, in one process or, for hundreds of nodes, spread over node
processes (`node_host`, `hosted_nodes`; their steps meet in `step_hub`):

- each node is the real agent (`planaria.elastic.agent.Agent`: registration and lease,
  the leader's campaign, the controller and its planner, notices, kill requests), whose
  workers are threads instead of processes and whose reachability probe is told the
  network by the harness instead of probing it (`sim_node`);
- each worker makes every request a real worker makes to the control plane, through the
  runtime's own `StoreCoordinator` and the process groups' bootstrap keys (`sim_worker`,
  `bootstrap`), with the same keys, sizes and order; its epoch watcher and its
  rendezvous's abandon watch, threads of a real worker, are tasks of its node process's
  relay loop making the same requests (`loop_watches`); a step is a sleep, and the steps of an epoch meet in an in-memory stand-in for the commit
  all-reduce (`data_plane`), so that every worker stops after the same step;
- faults are a node killed (its agent and workers stop making requests, its lease
  lapses, and its epoch's peers fail their step at once, as gloo's collectives do on
  a closed connection), the leader's node killed, a node joining, a planned leave (a
  preemption notice), a partition (`scale_run`);
- every worker's requests can be traced (`ScaleHarness(trace_dir=...)`) by the code that
  traces a real worker's (`PLANARIA_STORE_TRACE`), and compared with a real job's
  (`traffic`; tests/chaos/test_scale_traffic.py: the same requests, key by key);
- etcd's own counters say what it served (`etcd_metrics`), and the harness's clients
  the largest request and transaction (`cutoff`).

What the simulation leaves out, and why it does not change what etcd sees: the
arithmetic and the collectives (in memory here), the workers' heartbeat files (a file
on the node's disk), and the reachability probes' TCP connections (node to node).
"""
