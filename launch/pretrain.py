"""`launch/pretrain.py` from a checkout; the code is distsparse/cli/pretrain.py (installed: `distsparse-train`)."""

import sys

from distsparse.cli.pretrain import main

if __name__ == "__main__":
    sys.exit(main())
