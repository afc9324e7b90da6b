"""Layer state across failures: where an epoch's layers come from (`layer_sources`),
copies between workers (`transfer`), peer snapshots in other nodes' memory
(`peer_snapshots`), disk checkpoints (`checkpoints`), saved models (`saved_model`) and
their export to Hugging Face (`hf_export`), and the replica audit (`audit`).

Everything here works on an engine through its layer-state interface (`held_layers`,
`shard`, `empty_shard`, `install_shards`, `drop_shard`); imports
`planaria.runtime.parallel`, `.models`, `.config` and `.contract`; never the planning or
the worker.
"""
