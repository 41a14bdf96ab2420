"""`python tools/eval_zeroshot.py ...` from a checkout; the code is distsparse/cli/eval_zeroshot.py (installed: `distsparse-eval`)."""

import sys

from distsparse.cli.eval_zeroshot import main

if __name__ == "__main__":
    sys.exit(main())
