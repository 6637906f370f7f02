"""Pass file descriptors between processes on one host (Unix socket, SCM_RIGHTS).

    fds = exchange_fds(my_fd, rank, world_size, tag)   # all-gather; fds[rank] is my_fd itself

Every rank listens on a socket named by (tag, rank): in Linux's abstract namespace, or under
``$DISTNORM_FDPASS_DIR`` / the temp dir when that variable is set or abstract sockets are not
available. Ranks connect to each other in any order (connects retry until the deadline), send
``(tag, rank)`` with the descriptor, and wait for an acknowledgement, so no descriptor is in
flight when the call returns. Peers must run as the same user. The tag must be unique per
exchange and identical on all ranks: make it on one rank and broadcast it
(``Bootstrap.broadcast_object``), e.g. ``uuid.uuid4().hex``.
"""
from __future__ import annotations

import os
import socket
import struct
import sys
import tempfile
import time

__all__ = ["exchange_fds", "socket_address"]

_MAGIC = b"DNFD1"
_HEADER = struct.Struct("!5sI")  # magic, sender rank; then the tag bytes


def _use_abstract() -> bool:
    return sys.platform.startswith("linux") and not os.environ.get("DISTNORM_FDPASS_DIR")


def socket_address(tag: str, rank: int) -> str:
    """Where rank ``rank`` listens for exchange ``tag``."""
    name = f"distnorm-fd-{tag}-{rank}"
    if _use_abstract():
        return "\0" + name
    directory = os.environ.get("DISTNORM_FDPASS_DIR") or tempfile.gettempdir()
    return os.path.join(directory, name + ".sock")


def _check_peer_uid(conn: socket.socket) -> bool:
    if not hasattr(socket, "SO_PEERCRED"):
        return True
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return uid == os.getuid()


def _recv_one(conn: socket.socket, tag: bytes, world_size: int) -> tuple[int, int] | None:
    """Read (sender rank, fd) from one connection; None (fds closed) when it is not ours."""
    msg, fds, _flags, _addr = socket.recv_fds(conn, _HEADER.size + len(tag), 4)
    ok = (len(fds) == 1 and len(msg) == _HEADER.size + len(tag) and _check_peer_uid(conn))
    if ok:
        magic, sender = _HEADER.unpack(msg[:_HEADER.size])
        ok = magic == _MAGIC and msg[_HEADER.size:] == tag and 0 <= sender < world_size
    if not ok:
        for fd in fds:
            os.close(fd)
        return None
    return sender, fds[0]


def _connect(address: str, deadline: float, peer: int) -> socket.socket:
    delay = 0.001
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(max(deadline - time.monotonic(), 0.01))
        try:
            sock.connect(address)
            return sock
        except (FileNotFoundError, ConnectionRefusedError, BlockingIOError, socket.timeout):
            sock.close()
            if time.monotonic() >= deadline:
                raise TimeoutError(f"exchange_fds: rank {peer} never opened its socket "
                                   f"{address!r} before the deadline") from None
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
        except BaseException:
            sock.close()
            raise


def exchange_fds(my_fd: int, rank: int, world_size: int, tag: str, *,
                 timeout_s: float = 60.0) -> list[int]:
    """All-gather one file descriptor per rank among ``world_size`` processes on this host.

    Returns a list indexed by rank. ``fds[rank]`` is ``my_fd`` itself (still owned by the caller);
    every other entry is a new descriptor the caller owns and must ``os.close``. Raises
    TimeoutError naming the missing ranks when the peers do not all show up within ``timeout_s``.
    """
    for name, value in (("my_fd", my_fd), ("rank", rank), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank} world_size={world_size}")
    if not isinstance(tag, str) or not tag or len(tag) > 64 or not tag.replace("-", "").replace("_", "").isalnum():
        raise ValueError(f"tag must be 1-64 characters of [A-Za-z0-9_-], got {tag!r}")
    os.fstat(my_fd)  # raises OSError(EBADF) early on a closed descriptor
    result: list[int | None] = [None] * world_size
    result[rank] = my_fd
    if world_size == 1:
        return [my_fd]

    deadline = time.monotonic() + timeout_s
    tag_bytes = tag.encode()
    address = socket_address(tag, rank)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    clients: list[socket.socket] = []
    try:
        if not address.startswith("\0") and os.path.exists(address):
            os.unlink(address)
        listener.bind(address)
        listener.listen(world_size)
        payload = _HEADER.pack(_MAGIC, rank) + tag_bytes
        # 1. send my fd to every peer; the kernel queues it until the peer accepts
        for peer in range(world_size):
            if peer == rank:
                continue
            sock = _connect(socket_address(tag, peer), deadline, peer)
            clients.append(sock)
            socket.send_fds(sock, [payload], [my_fd])
        # 2. accept the peers' fds and acknowledge each
        while any(fd is None for fd in result):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = [r for r, fd in enumerate(result) if fd is None]
                raise TimeoutError(f"exchange_fds(tag={tag!r}): rank {rank} got no descriptor "
                                   f"from ranks {missing} within {timeout_s:g} s")
            listener.settimeout(remaining)
            try:
                conn, _ = listener.accept()
            except socket.timeout:
                continue
            with conn:
                conn.settimeout(max(deadline - time.monotonic(), 0.01))
                got = _recv_one(conn, tag_bytes, world_size)
                if got is None:
                    continue
                sender, fd = got
                if result[sender] is not None:  # duplicate sender: keep the first
                    os.close(fd)
                    continue
                result[sender] = fd
                conn.sendall(b"k")
        # 3. wait for every peer's acknowledgement before closing my side
        for sock in clients:
            sock.settimeout(max(deadline - time.monotonic(), 0.01))
            try:
                ack = sock.recv(1)
            except socket.timeout:
                ack = b""
            if ack != b"k":
                raise TimeoutError(f"exchange_fds(tag={tag!r}): rank {rank} got no "
                                   "acknowledgement from a peer within the deadline")
    except BaseException:
        for r, fd in enumerate(result):
            if fd is not None and r != rank:
                os.close(fd)
        raise
    finally:
        for sock in clients:
            sock.close()
        listener.close()
        if not address.startswith("\0"):
            try:
                os.unlink(address)
            except FileNotFoundError:
                pass
    return [int(fd) for fd in result]  # type: ignore[arg-type]
