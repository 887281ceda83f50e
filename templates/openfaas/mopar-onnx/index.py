"""Entry point of a mopar function (the of-watchdog's ``fprocess``).

It serves the slice in ``function/`` (next to this file) with mopar's torch-free runtime, which
the bundle ships in ``mopar/`` next to this file. Configuration comes from the environment
(``MOPAR_NEXT``, ``MOPAR_TRANSPORT``, ``PORT``...); see ``mopar.runtime.server``.
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
os.environ.setdefault("MOPAR_FUNCTION_DIR", os.path.join(HERE, "function"))

from mopar.runtime.server import main  # noqa: E402  (after the path is set)

if __name__ == "__main__":
    raise SystemExit(main())
