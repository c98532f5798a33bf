"""The errors a user can cause, at the bottom of the import graph: every layer raises them,
none of them needs the config tree to do so."""

from __future__ import annotations


class ConfigError(ValueError):
    """A user's configuration mistake; the message says what is wrong and how to fix it."""
