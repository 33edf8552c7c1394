"""Errors a user can act on: the CLI prints their message on one line and exits non-zero."""


class KFedError(Exception):
    """Base class of every error kfed-spark reports to its user."""

    exit_code = 2
    """The CLI's exit code: 2 for the user's mistakes, 1 for what went wrong around them."""


class ConfigError(KFedError):
    """The configuration is invalid."""


class InputError(KFedError):
    """The input table is missing or does not fit the data contract."""


class Terminated(KeyboardInterrupt):
    """The process was asked to stop (SIGTERM). A KeyboardInterrupt, as PySpark's own SIGINT handler
    raises, so that py4j drops the connection whose answer will never be read."""
