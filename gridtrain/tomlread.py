"""Reading TOML: the standard library's tomllib (Python 3.11 and later), or on Python 3.10 tomli,
the package tomllib was taken from (a dependency there only)."""

from __future__ import annotations

try:
    from tomllib import TOMLDecodeError, load, loads
except ModuleNotFoundError:  # Python 3.10
    from tomli import TOMLDecodeError, load, loads

__all__ = ["TOMLDecodeError", "load", "loads"]
