"""The format versions of a bundle's two documents, and the one refusal of another version."""

from __future__ import annotations

from mopar.errors import BundleError

__all__ = ["BUNDLE_FORMAT_VERSION", "FUNCTION_FORMAT_VERSION", "check_version"]

BUNDLE_FORMAT_VERSION = 2
"""``plan.json``. 2: the plan is a graph (plan format 3: functions and edges), ``io.functions``."""
FUNCTION_FORMAT_VERSION = 2
"""``function.json``. 2: a function receives and sends frames of named tensors, and may call
others (``calls``, ``dispatch``)."""


def check_version(what: str, found: object, expected: int) -> None:
    """Refuse a document of another format version with one line naming both and the fix.

    Args:
        what: the document, as the message names it (``bundle``, ``function.json``).
        found: the version the document says (anything, when it says nothing sensible).
        expected: the version this mopar reads and writes.

    Raises:
        BundleError: ``found`` is not ``expected``.
    """
    if found == expected and type(found) is int:
        return
    by = ""
    if type(found) is int:
        by = f": it was written by {'an older' if found < expected else 'a newer'} mopar"
    raise BundleError(
        f"{what} format {found} is not supported (expected {expected}){by}; "
        "recompile the bundle with this mopar"
    )
