"""Small checks shared by everything that takes input from users: text and error messages."""

from __future__ import annotations


def is_unicode(text: str) -> bool:
    """False for strings holding lone surrogates, which no UTF-8 text can carry."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def short_repr(value: object, limit: int = 80) -> str:
    """repr() cut to a readable length: an error message must not echo megabytes back."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
