"""``tether run``: torchrun with recording on in every worker."""

from tether.launcher.run import build_parser, main

__all__ = ["build_parser", "main"]
