"""The one exception type of the checker: a condition that makes a command exit with status 2."""


class ApiCompatError(Exception):
    """The checker cannot give a verdict: bad workspace, missing baseline, unloadable package."""
