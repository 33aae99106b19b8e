"""Listening sockets, owned by the supervisor and inherited by the API servers.

The supervisor binds before anything heavy starts (a port in use fails in milliseconds, not
after a model load) and keeps every listening socket open for its whole life, so API servers
can be restarted or rolled over on the held socket without a refused connection: while no API
server accepts, the kernel queues connections in the listen backlog. This is hypercorn's
``fd://`` design (the parent owns sockets, workers inherit them), which also fits systemd socket
activation (``LISTEN_FDS``, ``sd_listen_fds(3)``): adopted sockets are used as they are.

Which sockets: one shared socket (``frontend.host:port`` or ``frontend.uds``) for every mode
with API servers, except the external load balancer, where DP rank ``r`` listens on
``port + r`` (each rank its own endpoint behind the operator's balancer). Headless: none.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import os
import socket
import stat
import struct

from pkgd.config.vllm_config import ServePlan, VllmConfig

LISTEN_BACKLOG = 1024
SD_LISTEN_FDS_START = 3  # sd_listen_fds(3): passed sockets start at fd 3
SO_ATTACH_FILTER = 26  # <asm-generic/socket.h>; Python's socket module does not export it

# Classic BPF (linux/filter.h) run on a TCP listener's packets, offsets from the TCP header:
# drop a segment whose SYN flag is set and ACK flag clear (a new connection's first packet),
# pass everything else (the final ACK of a handshake already under way, and, in connections
# accepted later, which inherit the filter, every data segment).
_TCP_FLAGS_OFFSET = 13  # RFC 9293 section 3.1: the flags byte of the TCP header
_SYN, _ACK = 0x02, 0x10
_DROP_NEW_SYNS = (
    (0x30, 0, 0, _TCP_FLAGS_OFFSET),  # BPF_LD | BPF_B | BPF_ABS: A = flags byte
    (0x54, 0, 0, _SYN | _ACK),  # BPF_ALU | BPF_AND | BPF_K: A &= SYN | ACK
    (0x15, 0, 1, _SYN),  # BPF_JMP | BPF_JEQ | BPF_K: A == SYN (a bare SYN)?
    (0x06, 0, 0, 0),  # BPF_RET | BPF_K: drop
    (0x06, 0, 0, 0xFFFFFFFF),  # BPF_RET | BPF_K: pass whole
)


class BindError(Exception):
    """A listening socket could not be bound or adopted; the message names the key and fix."""


@dataclasses.dataclass(frozen=True)
class ListenSpec:
    """Where one listener should be: TCP ``host:port`` or a Unix socket path (``uds``).

    ``rank`` is the DP rank it serves with the external LB (None: all ranks); ``scheme`` is
    the protocol its API servers speak (``http``, or ``grpc`` with ``frontend.grpc``).
    """

    host: str
    port: int
    uds: str | None
    rank: int | None = None
    scheme: str = "http"


@dataclasses.dataclass(eq=False)
class Listener:
    """A bound, listening socket; ``url`` is where clients reach it (actual port if 0)."""

    spec: ListenSpec
    sock: socket.socket
    url: str
    from_systemd: bool = False

    def fileno(self) -> int:
        return self.sock.fileno()

    def refuse_new_connections(self) -> None:
        """Stop new TCP connections before the socket closes (see `refuse_new_connections`).

        A socket systemd passed is left as it is: systemd keeps listening on it, queues what
        comes while pkgd is down and starts pkgd again on it.
        """
        if not self.from_systemd:
            refuse_new_connections(self.sock)

    def close(self) -> None:
        """Close the socket (and remove a Unix socket file we created)."""
        self.sock.close()
        if self.spec.uds and not self.from_systemd:
            try:
                if stat.S_ISSOCK(os.stat(self.spec.uds).st_mode):
                    os.unlink(self.spec.uds)
            except FileNotFoundError:
                pass


def refuse_new_connections(sock: socket.socket) -> bool:
    """Make a TCP listening socket drop new connections' SYNs from now on; False if not TCP.

    Used when the daemon stops, before the last copies of the socket close: closing a
    listener resets every connection still in its accept queue (Linux ``inet_csk_listen_stop``),
    so a connection completed between an API server's last ``accept`` and its ``close`` would
    be reset instead of answered or refused. With the SYNs dropped, the queue stops growing, the
    API servers accept what it holds, and a client that connects meanwhile retransmits its SYN
    (after ~1 s, RFC 6298's initial RTO) to a closed port and is refused. The filter is on the
    socket, not the descriptor, so every process sharing it sees it.

    Raises OSError when the kernel refuses the filter.
    """
    if sock.family not in (socket.AF_INET, socket.AF_INET6):
        return False
    program = b"".join(struct.pack("HBBI", *insn) for insn in _DROP_NEW_SYNS)
    buf = ctypes.create_string_buffer(program)
    # struct sock_fprog: unsigned short len; struct sock_filter *filter (padded to a pointer)
    fprog = struct.pack("HP", len(_DROP_NEW_SYNS), ctypes.addressof(buf))
    sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, fprog)
    return True


def listen_specs(config: VllmConfig, plan: ServePlan) -> list[ListenSpec]:
    """The listeners a config needs, in rank order (empty when headless)."""
    f = config.frontend
    scheme = "grpc" if f.grpc else "http"
    if plan.api_server_count == 0:
        return []
    if plan.mode != "external_lb":
        return [ListenSpec(f.host, f.port, f.uds, scheme=scheme)]
    if f.uds:
        raise BindError(
            "frontend.uds cannot be used with lb.mode: external (each DP rank needs its own "
            "endpoint on frontend.port + rank); use frontend.host/port"
        )
    ranks = range(plan.dp_start_rank, plan.dp_start_rank + plan.dp_local)
    return [ListenSpec(f.host, f.port + r if f.port else 0, None, r, scheme) for r in ranks]


def bind(spec: ListenSpec) -> Listener:
    """Bind and listen; raises `BindError` with the config key and a fix."""
    if spec.uds:
        return _bind_unix(spec)
    try:
        infos = socket.getaddrinfo(spec.host, spec.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise BindError(f"frontend.host: cannot resolve {spec.host!r}: {exc.strerror}") from exc
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        # SO_REUSEADDR lets a restarted daemon bind despite TIME_WAIT; it never allows two
        # listeners on one port (that would be SO_REUSEPORT, deliberately not set).
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(LISTEN_BACKLOG)
    except OSError as exc:
        sock.close()
        raise BindError(_bind_message(spec, exc)) from exc
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if family == socket.AF_INET6 else host
    return Listener(spec, sock, f"{spec.scheme}://{shown}:{port}")


def _bind_message(spec: ListenSpec, exc: OSError) -> str:
    where = f"{spec.host}:{spec.port}"
    key = "frontend.port" if spec.rank is None else f"frontend.port (+ DP rank {spec.rank})"
    if exc.errno == errno.EADDRINUSE:
        return (
            f"{key}: {where} is already in use by another process; choose another port (0 = any free port) or "
            "stop that process"
        )
    if exc.errno == errno.EACCES:
        return f"{key}: permission denied binding {where} (ports below 1024 need CAP_NET_BIND_SERVICE)"
    if exc.errno == errno.EADDRNOTAVAIL:
        return f"frontend.host: {spec.host} is not an address of this machine"
    return f"{key}: cannot bind {where}: {exc.strerror}"


def _bind_unix(spec: ListenSpec) -> Listener:
    path = spec.uds
    assert path is not None
    if os.path.exists(path):
        if not stat.S_ISSOCK(os.stat(path).st_mode):
            raise BindError(f"frontend.uds: {path} exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except OSError:
            os.unlink(path)  # stale file of a dead server
        else:
            raise BindError(f"frontend.uds: {path} is in use by a running server")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        sock.listen(LISTEN_BACKLOG)
    except OSError as exc:
        sock.close()
        raise BindError(f"frontend.uds: cannot bind {path}: {exc.strerror}") from exc
    return Listener(spec, sock, f"unix:{path}")


def systemd_fds(environ: dict[str, str] | None = None) -> list[int]:
    """File descriptors passed by systemd socket activation (empty when none or not ours)."""
    env = os.environ if environ is None else environ
    if env.get("LISTEN_PID") != str(os.getpid()):
        return []
    try:
        count = int(env.get("LISTEN_FDS", "0"))
    except ValueError:
        return []
    return list(range(SD_LISTEN_FDS_START, SD_LISTEN_FDS_START + count))


def adopt(specs: list[ListenSpec], fds: list[int]) -> list[Listener]:
    """Use systemd's listening sockets for ``specs`` (one fd per spec, in order)."""
    if len(fds) != len(specs):
        raise BindError(
            f"systemd passed {len(fds)} listening socket(s) (LISTEN_FDS) but this serve mode needs "
            f"{len(specs)}; give pkgd.socket one ListenStream= per endpoint"
        )
    listeners = []
    for spec, fd in zip(specs, fds):
        sock = socket.socket(fileno=fd)
        if sock.type != socket.SOCK_STREAM:
            raise BindError(f"systemd socket fd {fd} is not a stream socket (use ListenStream=)")
        sock.set_inheritable(False)
        name = sock.getsockname()
        if sock.family == socket.AF_UNIX:
            url = f"unix:{name}"
        else:
            host = f"[{name[0]}]" if sock.family == socket.AF_INET6 else name[0]
            url = f"{spec.scheme}://{host}:{name[1]}"
        listeners.append(Listener(spec, sock, url, from_systemd=True))
    return listeners


def open_listeners(specs: list[ListenSpec], environ: dict[str, str] | None = None) -> list[Listener]:
    """Adopt systemd's sockets when passed, else bind ``specs``; all or nothing."""
    fds = systemd_fds(environ)
    if fds:
        return adopt(specs, fds)
    listeners: list[Listener] = []
    try:
        for spec in specs:
            listeners.append(bind(spec))
    except BindError:
        for listener in listeners:
            listener.close()
        raise
    return listeners
