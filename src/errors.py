"""Errors that are the user's to fix: reported as one line naming what to change, exit code 2."""


class UsageError(Exception):
    """A mistake in the config, the command line or the files a run needs.

    `train.py` prints the message alone (no traceback) and exits with code 2, so the
    message must say what is wrong and what to change.
    """


def find_usage_error(error: BaseException) -> UsageError | None:
    """The UsageError behind `error`, if any (Hydra's instantiate wraps what a builder raises)."""
    current: BaseException | None = error
    while current is not None:
        if isinstance(current, UsageError):
            return current
        current = current.__cause__ or current.__context__
    return None
