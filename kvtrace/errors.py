"""The one exception kvtrace's library code raises for user mistakes; the CLI turns it into one line and exit 2."""
from __future__ import annotations


class KvtraceError(Exception):
    """A problem with the user's input (file, option, run folder), stated in one line."""
