"""The errors a user can act on (the CLI prints their message as its last line on stderr and exits with
their exit_code); kfed_spark.runtime.failures describes any other failure in one line."""


class KFedError(Exception):
    """Base class of every error kfed-spark reports to its user."""

    exit_code = 2
    """The CLI's exit code: 2 for the user's mistakes, 1 for what went wrong around them."""


class ConfigError(KFedError):
    """The configuration is invalid."""


class InputError(KFedError):
    """The input table is missing or does not fit the data contract."""


class UnreachableError(KFedError):
    """A server the job needs (Spark Connect) does not answer."""

    exit_code = 1


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message: Spark's own messages carry a JVM trace after it."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class AttemptConflict(KFedError):
    """Another attempt of the same run id was published first (or at the same moment)."""

    exit_code = 1
