"""`python -m planaria.train CONFIG.yaml [section.key=value ...]` (see planaria.runtime.trainer)."""
from planaria.runtime.trainer import main

__all__ = ["main"]
