"""Round numbers as people read them: counted from 1.

The store, the records and the code number lock-step rounds from 0 (``rounds/00000003/`` holds the fourth
round); every log line, error message, table and JSON field a person reads counts them from 1, so that one
screen never shows two numberings (issue 34, finding 3). Every such message converts with
:func:`shown_round`; ``tests/test_round_numbers.py`` holds the package's log and error formats to it.
A store key in a message keeps its 0-based number: it names an object, not a round.
"""

from __future__ import annotations


def shown_round(index: int) -> int:
    """The round people read for the store's 0-based round ``index`` (``0`` -> ``1``).

    Invariant: ``round_index(shown_round(i)) == i``. A negative ``index`` (no round yet) is returned as it
    is, so a "-1" sentinel never reads as round 0.
    """
    return index + 1 if index >= 0 else index


def round_index(shown: int) -> int:
    """The store's 0-based index of the round people call ``shown`` (counted from 1; ``>= 1``)."""
    if shown < 1:
        raise ValueError(f"--round {shown}: rounds are counted from 1")
    return shown - 1


__all__ = ["round_index", "shown_round"]
