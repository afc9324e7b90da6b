"""`python -m planaria.train CONFIG.yaml [section.key=value ...]` (see planaria.runtime.worker.trainer)."""
from planaria.runtime.worker.trainer import main

__all__ = ["main"]
