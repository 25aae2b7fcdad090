"""The ``blockq`` command line: one entry point, every component a subcommand."""

from blockq.cli.main import main

__all__ = ["main"]
