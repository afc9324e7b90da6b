import sys

from torch.distributed.elastic.multiprocessing.errors import record

from planaria.runtime.worker.trainer import main

# torch's `record`: an uncaught exception is written to TORCHELASTIC_ERROR_FILE when the
# launcher set one (torchrun and Planaria's agents do), which the launcher then reports.
sys.exit(record(main)())
