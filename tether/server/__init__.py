"""The debug server: every rank answers HTTP about itself, and rank 0 serves a live page of the
whole job that names the rank holding everyone back.

Every rank (``rank.py``)      GET /health /trace /stacks /metrics, POST /dump
Rank 0 also (``cluster.py``)  GET /  (the cluster page), /api/cluster, /api/events,
                              /metrics/job (every rank's metrics, ``jobmetrics.py``), and
                              writes the Prometheus targets file (``discovery.py``)

Standard library and prometheus-client. Loopback by default; anywhere else every request needs
the job's token (``auth.py``). ``web.py`` bounds what a client can make the training process do.
"""

from tether.server.blame import Holdup, holding_back
from tether.server.server import DebugServer, start_debug_server

__all__ = ["DebugServer", "Holdup", "holding_back", "start_debug_server"]
