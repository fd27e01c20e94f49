"""The `tokenyard` command: one module per command group, assembled in `app.py`."""

from __future__ import annotations

from tokenyard.cli.app import app, main

__all__ = ["app", "main"]
