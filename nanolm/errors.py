"""The one exception type for mistakes a user can fix.

Anything raised as :class:`NanolmError` is printed by the command line as a single
line (no traceback) and the process exits with status 2. Everything else is a bug
in nanolm and keeps its traceback.
"""


class NanolmError(ValueError):
    """A user error: bad input, bad configuration, a file that is not what it claims."""
