"""User-facing errors.

Every stage raises a subclass of :class:`Eagle3Error` for problems the user can fix (bad input,
mismatched contracts, missing files). The CLIs print these as one clear message and exit with
status 2; anything else is a bug and keeps its traceback.
"""


class Eagle3Error(Exception):
    """A problem the user can fix; the message says what and where."""


class BadInputError(Eagle3Error):
    """Input data that cannot be used (names the file, row and field where known)."""


class ContractError(Eagle3Error):
    """Two sides of a stage boundary disagree (capture spec, target identity, vocab map)."""


class IncompleteError(Eagle3Error):
    """A directory that an earlier stage did not finish writing (no manifest)."""


class ConfigError(Eagle3Error):
    """An option value that cannot work (raised by config dataclasses' ``__post_init__``)."""
