"""What every reader of text inputs (`data prepare`, `embed`, `generate`) says alike about a
line it cannot take. Text is UTF-8: a byte that is not is refused, never replaced, naming
the file, the line and where in the line."""

from __future__ import annotations

import re

# What errors="surrogateescape" makes of a byte that is not UTF-8 (decoded UTF-8 never holds these).
_ESCAPED = re.compile("[\udc80-\udcff]")


def not_utf8(text: str) -> tuple[int, str] | None:
    """For `text` read with errors="surrogateescape": None when every byte was UTF-8, else
    (the line of the first one that was not, from 1; what to say about it)."""
    found = None if text.isascii() else _ESCAPED.search(text)
    if found is None:
        return None
    start = text.rfind("\n", 0, found.start()) + 1
    column = len(text[start : found.start()].encode("utf-8", "surrogateescape"))
    byte = ord(found.group()) - 0xDC00
    return text.count("\n", 0, start) + 1, f"not UTF-8 text (byte 0x{byte:02x} at offset {column} in the line)"


def json_type(value) -> str:
    """What a JSON value is, in JSON's words (for `field 'text' is not a string (a number)`)."""
    if value is None:
        return "null"
    return {bool: "a boolean", int: "a number", float: "a number", list: "an array", dict: "an object"}.get(
        type(value), type(value).__name__
    )
