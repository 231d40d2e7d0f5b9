"""``python -m purlin_sglang.bench collectives|offline ...`` (the same as ``purlin-sglang bench ...``)."""

import sys

from ..cli import main

if __name__ == "__main__":  # spawned baseline workers import this module too
    sys.exit(main(["bench", *sys.argv[1:]]))
