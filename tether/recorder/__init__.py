"""The flight recorder: every collective and p2p operation of every process group, per rank."""

from tether.recorder.dump import dump
from tether.recorder.install import current, install, uninstall
from tether.recorder.load import load_dump

__all__ = ["current", "dump", "install", "load_dump", "uninstall"]
