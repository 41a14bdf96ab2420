"""`python tools/export_hf.py ...` from a checkout; the code is distsparse/cli/export_hf.py (installed: `distsparse-export`)."""

import sys

from distsparse.cli.export_hf import main

if __name__ == "__main__":
    sys.exit(main())
