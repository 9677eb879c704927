"""The debug server of one rank: its lifecycle, and how it is started for a rank: what it
reads (a :class:`~tether.server.rank.RankSource`, the rank's report) and what it does through
the rank's link to the job (a :class:`~tether.server.rank.RankLink`)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from tether._log import get_logger, say
from tether.events.layout import dump_root
from tether.job.jobfile import targets_file
from tether.server.auth import Guard, job_token, needs_token
from tether.server.cluster import Cluster
from tether.server.discovery import TargetsWriter
from tether.server.rank import RankEndpoints
from tether.server.torch_worker import TorchWorkerRoutes, TorchWorkerSource
from tether.server.web import App, DebugHTTPServer

if TYPE_CHECKING:
    from tether.server.rank import RankLink, RankSource

    class ServedRank(RankSource, TorchWorkerSource, Protocol):
        """What a rank's server reads: tether's routes and torch's worker routes."""


__all__ = ["DebugServer", "start_debug_server"]

logger = get_logger(__name__)

REQUEST_TIMEOUT_S = 5.0
"""Each read or write of a connection; a client slower than that is dropped."""
MAX_CONNECTIONS = 32
POLL_S = 0.1
"""How often the serving thread checks for shutdown: the most :meth:`DebugServer.close` waits."""

_WILDCARDS = frozenset({"", "0.0.0.0", "::"})


class DebugServer:
    """Serves ``app`` on a named daemon thread from :meth:`start` until :meth:`close`. Binds in
    the constructor, so a taken port raises ``OSError`` there."""

    def __init__(
        self,
        app: App,
        *,
        host: str,
        port: int,
        request_timeout: float = REQUEST_TIMEOUT_S,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        self.host = host
        self._httpd = DebugHTTPServer(
            (host, port), app, request_timeout=request_timeout, max_connections=max_connections
        )
        self.port: int = self._httpd.server_address[1]
        self._thread = threading.Thread(
            target=self._httpd.serve_forever,
            kwargs={"poll_interval": POLL_S},
            name="tether-debug-server",
            daemon=True,
        )
        self._closed = False
        self.on_close: list[Callable[[], None]] = []
        """Called by :meth:`close` once the server has stopped (what was started with it)."""

    def url(self, public_host: str | None = None) -> str:
        """Where to reach the server; ``public_host`` names this machine when it is bound to
        every interface."""
        host = (public_host or self.host) if self.host in _WILDCARDS else self.host
        return f"http://[{host}]:{self.port}" if ":" in host else f"http://{host}:{self.port}"

    def start(self) -> None:
        if self._closed:
            raise RuntimeError("a closed debug server cannot start again; create a new one")
        self._thread.start()

    def close(self, timeout: float = 2.0) -> None:
        """Stop serving and release the port. Idempotent. Requests being answered finish on
        their own daemon threads, bounded by the request timeout."""
        if self._closed:
            return
        self._closed = True
        if self._thread.is_alive():
            self._httpd.shutdown()  # returns once serve_forever has seen it: within POLL_S
            self._thread.join(timeout)
        self._httpd.server_close()
        for close in self.on_close:
            close()


def start_debug_server(report: ServedRank, link: RankLink) -> DebugServer | None:
    """Serve this rank's ``report`` over HTTP and, on rank 0, the cluster page; publish the
    address in the store through ``link``, which also raises the alarm of ``POST /dump``. None
    when the server is off (``debug_port`` None) or cannot listen: the job runs on without it."""
    config, rec = report.config, report.recorder
    if config.debug_port is None or link.board is None:
        return None
    board = link.board.clone()  # the server's threads must not queue behind the alarms'
    try:
        token = job_token(board.store)
    except RuntimeError as exc:  # the store refused: the job runs on, without its server
        logger.warning("no debug server: no token from the store: %s", exc)
        return None
    dump_dir = dump_root(config.dump_dir)
    routes = dict(RankEndpoints(report, dump_dir, request_dump=link.request_dump).routes())
    routes |= TorchWorkerRoutes(report, rank=rec.global_rank).routes()
    cluster = None
    if rec.global_rank == 0:
        cluster = Cluster(
            board,
            local=report,
            rank=rec.global_rank,
            world_size=rec.world_size,
            token=token,
            dump_dir=dump_dir,
            job_id=link.job_id,  # the name of its job and targets files
        )
        routes |= cluster.routes()
    app = App(routes, Guard(token if needs_token(config.debug_host) else None))
    # A fixed port is rank 0's: the address people open. The other ranks, maybe several on this
    # host, take free ports; every address is in the store.
    port = config.debug_port if rec.global_rank == 0 else 0
    try:
        server = DebugServer(app, host=config.debug_host, port=port)
    except OSError as exc:
        logger.warning("no debug server on %s port %d: %s", config.debug_host, port, exc)
        return None
    if cluster is not None:
        server.on_close.append(cluster.close)
    server.start()
    url = server.url(public_host=rec.host)
    logger.debug("debug server at %s", url)
    if rec.global_rank != 0:
        link.publish(debug_url=url)
    else:
        page = f"{url}/?token={token}" if app.guard.token else f"{url}/"
        # tether run says it from the store (its workers' output may go to files); the token is
        # the store's already.
        link.publish(debug_url=url, cluster_page=page)
        if not link.launcher_says_page():
            # Printed, not logged: the one line people look for, whatever the logging set-up.
            say(f"tether: cluster page {page}")
        # For Prometheus (file_sd_configs), once every rank's server is known.
        sd = TargetsWriter(
            board.clone(),
            targets_file(dump_dir, link.job_id),
            job_id=link.job_id,
            world_size=rec.world_size,
            attempt=config.attempt,
            on_written=link.wrote,
        )
        server.on_close.append(sd.close)
        sd.start()
    return server
