"""The version of this dsec (the SDK sends it as its user agent, servers report it)."""

__version__ = "0.1.0"
