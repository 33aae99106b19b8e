"""Supervisor: the daemon's main process (docs/architecture.md, "Processes").

Modules, one concern each:

* `supervisor` — `Supervisor`: start order, main loop, signals, shutdown, watchdog, status;
* `daemon` — ``run(composed, request)``, the entry ``pkgd serve`` calls;
* `sockets` — listening sockets: bind first, or adopt systemd's ``LISTEN_FDS``;
* `runtime` — the private runtime directory (created without following symlinks) and its lock;
* `topology` — which children a config asks for, and their command lines (serve modes);
* `children` — one child process: spawn, ready pipe, exit (pidfd), stop;
* `fleet` — generations (a config and its children), starting and stopping them, crash restarts;
* `restart` — backoff and the crash-loop limit;
* `reload` — SIGHUP: plan the difference, apply it live / rolling / by engine swap;
* `health` — ``/health`` probes of every endpoint;
* `notify` — ``sd_notify`` (READY, RELOADING, STOPPING, STATUS, WATCHDOG);
* `control` — the control socket behind ``pkgd status`` and ``pkgd reload``.

Only this package and `pkgd.cli` import Hydra; nothing here imports torch.
"""
