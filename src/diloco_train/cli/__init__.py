"""The ``diloco`` command: every command's parser and entry."""

from .main import main

__all__ = ["main"]
