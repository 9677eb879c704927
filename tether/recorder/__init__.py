"""The flight recorder: every collective and p2p operation of every process group, per rank.

A leaf: torch, :mod:`tether.events` and the config. :mod:`tether.runtime` builds it and patches
torch to record (:mod:`.patch`); :mod:`.writer` writes its dumps.
"""
