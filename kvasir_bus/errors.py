"""User-facing errors: one clear line, never a traceback.

Raise :class:`KvasirError` (or a subclass) for anything caused by the user's input or
environment: a bad file, a bad flag value, a missing dependency. The CLI prints its message on
one line and exits non-zero; services turn it into an error reply.
"""


class KvasirError(Exception):
    """An error whose message is fit to show the user as it is."""

    exit_code = 2


class ModelFileError(KvasirError):
    """A GGUF file is missing, truncated, corrupt or of an unsupported kind."""


class UsageError(KvasirError):
    """A flag or argument has a value that cannot work."""


class DependencyError(KvasirError):
    """An optional dependency (for example llama-cpp-python) is needed but not installed."""
