"""Errors a user can act on: the CLI prints their message on one line and exits non-zero."""


class KFedError(Exception):
    """Base class of every error kfed-spark reports to its user."""


class ConfigError(KFedError):
    """The configuration is invalid."""


class InputError(KFedError):
    """The input table is missing or does not fit the data contract."""
