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


def check_numbers(
    section: object, prefix: str = "", *, positive: tuple[str, ...] = (), non_negative: tuple[str, ...] = ()
) -> None:
    """Range checks of a config dataclass's numeric fields, each failing with a one-line
    :class:`ConfigError` that names the option as it is written (``prefix`` + field): ``positive``
    fields must be > 0, ``non_negative`` ones >= 0. NaN fails both; None (an unset optional
    field) passes."""
    for names, ok, bound in ((positive, lambda v: v > 0, "positive"), (non_negative, lambda v: v >= 0, ">= 0")):
        for name in names:
            value = getattr(section, name)
            if value is not None and not ok(value):
                raise ConfigError(f"{prefix}{name} must be {bound}, got {value}")


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) or SIGTERM during a stage, with what the stage kept: the commands print it
    as one line with the command that continues, and exit with status 130."""
