"""`launch/slurm.py` from a checkout; the code is distsparse/cli/slurm.py (installed: `distsparse-slurm`)."""

import sys

from distsparse.cli.slurm import main

if __name__ == "__main__":
    sys.exit(main())
