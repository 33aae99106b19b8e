"""Health of the API endpoints, as the supervisor sees them from outside.

The supervisor probes ``GET /health`` on every listener it holds (one per DP rank with the
external load balancer, as vLLM's DP supervisor checks each rank's server), so ``pkgd status``
and systemd's ``STATUS=`` show whether each endpoint answers, and the watchdog stops when an
endpoint stays unhealthy while every child claims to be ready (a hung server: systemd then
restarts the service). A 200 is healthy; a 503 (engine core restarting, draining) or no answer
within ``timeout`` seconds is not. A gRPC listener (``frontend.grpc``) is probed with
``VllmEngine.HealthCheck`` instead, its answer recorded as 200 or 503.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import httpx

from pkgd.supervisor.sockets import Listener


@dataclasses.dataclass
class EndpointHealth:
    """Latest probe of one endpoint. Times are ``time.monotonic()`` seconds."""

    url: str
    status: int | None = None  # HTTP status of the last answer (gRPC: 200/503); None: no answer
    error: str | None = None
    checked_at: float | None = None
    failing_since: float | None = None  # start of the current run of failed probes

    @property
    def healthy(self) -> bool:
        return self.status == 200

    def as_dict(self) -> dict[str, object]:
        return {"url": self.url, "healthy": self.healthy, "status": self.status, "error": self.error}


class HealthMonitor:
    """Probes listeners' ``/health``; keeps one `EndpointHealth` per URL."""

    def __init__(self, timeout: float = 3.0) -> None:
        self.timeout = timeout
        self.endpoints: dict[str, EndpointHealth] = {}

    async def probe(self, listener: Listener) -> EndpointHealth:
        """Probe one listener now and record the result."""
        entry = self.endpoints.setdefault(listener.url, EndpointHealth(listener.url))
        if listener.spec.scheme == "grpc":
            entry.status, entry.error = await self._probe_grpc(listener.url)
        else:
            entry.status, entry.error = await self._probe_http(listener.url)
        now = time.monotonic()
        entry.checked_at = now
        if entry.healthy:
            entry.failing_since = None
        elif entry.failing_since is None:
            entry.failing_since = now
        return entry

    async def _probe_http(self, url: str) -> tuple[int | None, str | None]:
        if url.startswith("unix:"):
            transport = httpx.AsyncHTTPTransport(uds=url[len("unix:") :])
            base = "http://localhost"
        else:
            transport = httpx.AsyncHTTPTransport()
            base = url
        try:
            async with httpx.AsyncClient(transport=transport, timeout=self.timeout) as client:
                response = await client.get(f"{base}/health", headers={"connection": "close"})
        except httpx.HTTPError as exc:
            return None, f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        return response.status_code, None

    async def _probe_grpc(self, url: str) -> tuple[int | None, str | None]:
        """``VllmEngine.HealthCheck`` (``frontend.grpc``): healthy is recorded as 200, not
        healthy (draining, no engine core) as 503 with the server's message."""
        import grpc
        from smg_grpc_proto.generated import vllm_engine_pb2, vllm_engine_pb2_grpc

        target = url.removeprefix("grpc://")
        try:
            async with grpc.aio.insecure_channel(target) as channel:
                stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
                reply = await stub.HealthCheck(vllm_engine_pb2.HealthCheckRequest(), timeout=self.timeout)
        except grpc.aio.AioRpcError as exc:
            return None, f"{exc.code().name}: {exc.details()}"
        return (200, None) if reply.healthy else (503, reply.message)

    async def probe_all(self, listeners: list[Listener]) -> list[EndpointHealth]:
        """Probe every listener concurrently; forget endpoints no longer held."""
        urls = {listener.url for listener in listeners}
        for url in list(self.endpoints):
            if url not in urls:
                del self.endpoints[url]
        return list(await asyncio.gather(*(self.probe(listener) for listener in listeners)))

    def reset(self) -> None:
        """Forget failure runs (after a restart or reload changed the children)."""
        for entry in self.endpoints.values():
            entry.failing_since = None

    def failing_longer_than(self, seconds: float, now: float | None = None) -> list[EndpointHealth]:
        """Endpoints unhealthy for more than ``seconds``."""
        now = time.monotonic() if now is None else now
        return [e for e in self.endpoints.values() if e.failing_since is not None and now - e.failing_since > seconds]

    def summary(self) -> str:
        """``"2/2 endpoints healthy"`` (empty when no endpoint was probed)."""
        if not self.endpoints:
            return ""
        ok = sum(e.healthy for e in self.endpoints.values())
        return f"{ok}/{len(self.endpoints)} endpoints healthy"
