"""Argument checks shared by every layer: one wording for every "must be an integer / a number" error.

Each check raises ``ValueError`` naming the argument and what was expected, and returns the value, so
callers can write ``window = check_int("window", window, minimum=1)``. ``bool`` is never accepted as a
number (``True`` is an ``int`` in Python, but never what a user meant).
"""

from __future__ import annotations

import math
from typing import Optional


def _range_text(minimum: Optional[float], maximum: Optional[float], exclusive_minimum: bool = False) -> str:
    low = None if minimum is None else f"{'>' if exclusive_minimum else '>='} {minimum:g}"
    high = None if maximum is None else f"<= {maximum:g}"
    if low and high:
        return f" in {'(' if exclusive_minimum else '['}{minimum:g}, {maximum:g}]"
    return f" {low or high}" if (low or high) else ""


def check_int(name: str, value, *, minimum: Optional[int] = None, maximum: Optional[int] = None, hint: str = "") -> int:
    """``value`` if it is an ``int`` (not a ``bool``) within ``[minimum, maximum]``, else ``ValueError``."""
    if (isinstance(value, bool) or not isinstance(value, int) or (minimum is not None and value < minimum)
            or (maximum is not None and value > maximum)):
        raise ValueError(f"{name} must be an integer{_range_text(minimum, maximum)}{hint}, got {shown(value)}")
    return value


def shown(value) -> str:
    """``repr(value)`` for an error message, except an integer too long to print (Python refuses over 4300 digits):
    its size instead."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 1000:
        return f"an integer of about {int(value.bit_length() * 0.30103) + 1} digits"
    return repr(value)


def check_number(name: str, value, *, minimum: Optional[float] = None, maximum: Optional[float] = None,
                 exclusive_minimum: bool = False, hint: str = "") -> float:
    """``value`` if it is a finite real number (not a ``bool``) within the bounds, else ``ValueError``.

    ``exclusive_minimum`` makes the lower bound strict (``value > minimum``)."""
    bad = isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
    if not bad and minimum is not None:
        bad = value <= minimum if exclusive_minimum else value < minimum
    if not bad and maximum is not None:
        bad = value > maximum
    if bad:
        raise ValueError(f"{name} must be a finite number{_range_text(minimum, maximum, exclusive_minimum)}{hint}, got {value!r}")
    return value


def writable_ancestor(folder: str, label: str, path: str) -> str:
    """The nearest existing ancestor of ``folder`` (itself if it exists), where folders can be made and written:
    the missing folders below it can then be created. Permission bits are not enough (root may "write" anywhere, yet
    cannot make a folder in ``/proc``, on a read-only mount or under a file), so a uniquely named folder is made and
    removed at once: nothing is left behind and concurrent checks do not meet. ``ValueError`` naming ``label`` (the
    flag or argument) and ``path`` (what the user typed)."""
    import os
    import tempfile

    existing = os.path.abspath(folder)
    while not os.path.isdir(existing):
        if os.path.lexists(existing):  # a file (or a dangling link) where a folder must be made
            raise ValueError(f"{label} {path!r}: {existing} is a file, so the folder cannot be made")
        existing = os.path.dirname(existing)
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".vispec-write-check-", dir=existing))
    except OSError as err:
        action = "write in it" if existing == os.path.abspath(folder) else f"make folders in {existing}"
        raise ValueError(f"{label} {path!r}: cannot {action} ({err.strerror or err}); expected a folder that can be "
                         "made and written") from None
    return existing
