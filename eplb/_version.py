"""The package version, in a module of its own so any module may read it without importing the API."""

from __future__ import annotations

__version__ = "0.1.0"
