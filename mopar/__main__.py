"""``python -m mopar`` is the ``mopar`` command."""

from mopar.cli import main

main()
