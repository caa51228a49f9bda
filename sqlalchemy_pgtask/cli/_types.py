"""cli._types: argument types shared by the commands' parsers (numbers with bounds)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

__all__ = ["int_between", "positive_seconds", "seconds"]


def seconds(text: str) -> float:
    """A finite, non-negative number of seconds (``inf`` and ``nan`` parse as floats)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds, got {text!r}")
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {text!r}")
    return value


def positive_seconds(text: str) -> float:
    """A finite number of seconds above zero."""
    value = seconds(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be more than 0 seconds")
    return value


def int_between(low: int, high: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be between {low} and {high}, got {value}")
        return value

    return parse
