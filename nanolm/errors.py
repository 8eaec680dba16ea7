"""The one exception type for mistakes a user can fix.

Anything raised as :class:`NanolmError` is printed by the command line as a single
line (no traceback) and the process exits with status 2. Everything else is a bug
in nanolm and keeps its traceback.
"""


class NanolmError(ValueError):
    """A user error: bad input, bad configuration, a file that is not what it claims."""


def brief(text, limit: int = 160) -> str:
    """``text`` (a library's message, a value from a file) cut to what a one-line error can quote:
    a crafted file's megabyte string must not become a megabyte message."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else f"{text[: limit - 40]}... ({len(text)} characters)"
