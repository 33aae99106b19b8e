"""A fake engine core: binds a ZeroMQ ROUTER, answers Hello and AddRequest, no model.

Behaviour comes from ``model.source`` of its configuration: ``fake:load=S`` (seconds before ready),
``fail=MSG`` (report ChildFailed), ``die=1`` (exit 1 without a frame), ``die_if=PATH`` (the
same while PATH exists: a restart that fails), ``crash_after=S``
(exit 3 that long after ready). Each AddRequest is answered by one finished output whose
token ids are [engine_index, pid].
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

import zmq
from common import config_source, die_with_parent, fake_options, report

from pkgd.ipc import messages

stop = False


def on_term(signum, frame):
    global stop
    stop = True


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--config-file")
    p.add_argument("--config-fd", type=int)
    p.add_argument("--parent-pid", type=int)
    p.add_argument("--ready-fd", type=int, required=True)
    p.add_argument("--engine-index", type=int, required=True)
    p.add_argument("--address", required=True)
    args = p.parse_args()
    die_with_parent(args.parent_pid)
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    cfg = config_source(args).initial()
    opts = fake_options(cfg.model.source, "fake:")
    if "die" in opts or ("die_if" in opts and os.path.exists(opts["die_if"])):
        return 1
    if "fail" in opts:
        report(args.ready_fd, messages.ChildFailed(role="engine-core", message=opts["fail"] or "fake failure"))
        return 1
    deadline = time.monotonic() + float(opts.get("load", 0))
    while time.monotonic() < deadline:  # "loading": SIGTERM must end it promptly
        if stop:
            return 0
        time.sleep(0.02)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(args.address)
    name = cfg.model.name or "fake"
    hs = messages.Handshake(
        version=messages.PROTOCOL_VERSION,
        engine_index=args.engine_index,
        pid=os.getpid(),
        model_name=name,
        max_model_len=2048,
        vocab_size=100,
        eos_token_id=None,
        num_kv_blocks=16,
        block_size=16,
    )
    report(args.ready_fd, hs)
    crash_at = time.monotonic() + float(opts["crash_after"]) if "crash_after" in opts else None
    while not stop:
        if crash_at and time.monotonic() > crash_at:
            return 3
        if not sock.poll(50):
            continue
        ident, data = sock.recv_multipart()
        msg = messages.decode_client(data)
        if isinstance(msg, messages.Hello):
            sock.send_multipart([ident, messages.encode(hs)])
        elif isinstance(msg, messages.AddRequest):
            out = messages.EngineCoreOutput(
                request_id=msg.request.request_id,
                new_token_ids=[args.engine_index, os.getpid()],
                finish_reason=messages.FinishReason.LENGTH,
            )
            sock.send_multipart(
                [ident, messages.encode(messages.EngineOutputs(engine_index=args.engine_index, outputs=[out]))]
            )
    sock.close(linger=0)
    ctx.term()
    return 0


if __name__ == "__main__":
    sys.exit(main())
