"""Make the helper module ``simulator`` (next to this file) importable as ``import simulator``."""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
