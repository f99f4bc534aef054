"""What every reader of text inputs (`data prepare`, `embed`, `generate`) says alike about a
line it cannot take."""

from __future__ import annotations


def json_type(value) -> str:
    """What a JSON value is, in JSON's words (for `field 'text' is not a string (a number)`)."""
    if value is None:
        return "null"
    return {bool: "a boolean", int: "a number", float: "a number", list: "an array",
            dict: "an object"}.get(type(value), type(value).__name__)
