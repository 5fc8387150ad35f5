"""The error ``mcore-serve`` reports instead of a traceback."""


class ServeStartupError(RuntimeError):
    """``mcore-serve`` cannot start; the message says what is wrong and what to do."""
