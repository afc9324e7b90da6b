import sys

from planaria.runtime.trainer import main

sys.exit(main())
