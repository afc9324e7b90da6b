"""`python -m planaria.cli ...`: the `planaria` command."""
import sys

from planaria.cli import main

sys.exit(main())
