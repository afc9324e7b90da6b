"""A worker's exit codes that its agent acts on (the agent imports no torch: they live here)."""

EXIT_LEFT = 0
"""Its node left the job with notice (`EpochRecord.leaving`)."""
EXIT_TORN_STEP = 3
"""Its optimizer step failed part-way (`TornStep`): its state must not be used."""
EXIT_STUCK_AFTER_RELEASE = 4
"""Its epoch's collectives did not return after their release (`EpochWatcher`): its
agent starts it again as a new worker, whatever `--max-restarts` says (a reset the
worker asked for, not a failure of the node)."""
