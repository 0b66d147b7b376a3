"""A free TCP port for a rendezvous (torch.distributed's store, SLURM's daemons)."""

from __future__ import annotations

import socket


def free_port(host: str = "") -> int:
    """A port the OS reports free on `host` ("" = every interface, what other nodes reach).
    Free when asked: the caller binds it soon after, as every rendezvous here does."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
