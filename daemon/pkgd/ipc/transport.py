"""ZeroMQ sockets between API servers (DEALER, one per engine core) and engine cores (ROUTER).

Addresses are ``ipc:///path/engine-I.sock`` on one node and ``tcp://HOST:PORT`` across nodes.
Each ZeroMQ message carries one msgpack frame from `pkgd.ipc.messages`; a ROUTER message is
``[client identity, frame]``.

Liveness: both ends enable ZMTP heartbeats (``HEARTBEAT_IVL`` / ``HEARTBEAT_TIMEOUT``). They
run in ZeroMQ's I/O thread, so an engine busy in a long step still answers them, and a core
whose host vanished is noticed within ``HEARTBEAT_TIMEOUT_MS`` instead of at the next TCP
timeout. The client watches connect/disconnect through a socket monitor.

Delivery rules that keep requests from hanging:
- DEALER keeps ``IMMEDIATE`` off, so its pipe outlives a dropped connection: the last frames
  a dying core sent (the errors naming its requests) are still read after the disconnect.
  (With ``IMMEDIATE`` on, ZeroMQ drops a disconnected pipe's unread inbound frames.) Frames
  queued while the core was down reach its successor before our new `Hello`, which refuses
  them (unknown client): nothing stale ever runs.
- ROUTER sets ``ROUTER_MANDATORY``: sending to a client that is gone raises
  ``EHOSTUNREACH``, and the core aborts that client's requests.
"""

from __future__ import annotations

from pathlib import Path

import zmq

HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 5000
# How long close() may spend flushing frames still queued (the error frames sent to clients
# when a core shuts down), in milliseconds.
LINGER_MS = 500


def _common(sock: zmq.Socket) -> None:
    sock.setsockopt(zmq.LINGER, LINGER_MS)
    sock.setsockopt(zmq.SNDHWM, 0)  # outputs are small; never drop or block on them
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TTL, HEARTBEAT_TIMEOUT_MS)


def bind_router(ctx: zmq.Context, address: str) -> zmq.Socket:
    """The engine core's ROUTER socket, bound at ``address``.

    For ``ipc://`` the parent directory must exist (the supervisor's runtime dir); a stale
    socket file from a crashed core is replaced.

    Raises:
        ValueError: ``address`` is neither ``ipc://`` nor ``tcp://``.
        zmq.ZMQError: binding failed (address in use, directory missing, permission).
    """
    check_address(address)
    sock = ctx.socket(zmq.ROUTER)
    _common(sock)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    try:
        sock.bind(address)
    except zmq.ZMQError:
        sock.close(linger=0)
        raise
    return sock


def dealer(ctx: zmq.Context, identity: bytes) -> zmq.Socket:
    """A client's DEALER socket, configured but not connected (attach a monitor first, so
    no connect event is missed, then ``connect``); ZeroMQ reconnects by itself.

    ``identity`` becomes the routing id the core sees (stable across reconnects).
    """
    sock = ctx.socket(zmq.DEALER)
    _common(sock)
    sock.setsockopt(zmq.IMMEDIATE, 0)
    sock.setsockopt(zmq.ROUTING_ID, identity)
    sock.setsockopt(zmq.RECONNECT_IVL, 100)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
    return sock


def connect_dealer(ctx: zmq.Context, address: str, identity: bytes) -> zmq.Socket:
    """`dealer` connected to ``address`` (for clients that watch no connection events)."""
    check_address(address)
    sock = dealer(ctx, identity)
    sock.connect(address)
    return sock


def check_address(address: str) -> None:
    """Raise `ValueError` unless ``address`` is ``ipc://PATH`` or ``tcp://HOST:PORT``."""
    if address.startswith("ipc://") and len(address) > len("ipc://"):
        return
    if address.startswith("tcp://"):
        host, _, port = address[len("tcp://") :].rpartition(":")
        if host and port.isdigit() and 0 < int(port) < 65536:
            return
    raise ValueError(f"engine address {address!r} must be ipc://PATH or tcp://HOST:PORT")


def ipc_address(runtime_dir: str | Path, engine_index: int) -> str:
    """The local engine core address the supervisor hands out: ``ipc://DIR/engine-I.sock``."""
    return f"ipc://{Path(runtime_dir) / f'engine-{engine_index}.sock'}"
