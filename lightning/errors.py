"""Errors that several layers raise and catch, in a module that imports nothing of ours."""


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the field and the fix."""
