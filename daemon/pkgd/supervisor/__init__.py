"""Supervisor: sockets, child processes, signals, reload, sd_notify."""
