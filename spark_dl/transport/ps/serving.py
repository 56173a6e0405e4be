"""The parameter server's socket and connections: each connection's thread sends its nonce
and reads its hello; from then on it serves the connection's frames itself, or hands it to
the event loop (loop.py) where the server serves every worker from one thread. Every frame
goes to the server's ``_dispatch``; a malformed one closes its connection only, with the
reason sent to the worker."""

from __future__ import annotations

import contextlib
import os
import socket
import threading

from ..channel import Arrivals, accept_loop, stop_listening
from .loop import EventLoop, fault
from .payload import quiet_numpy
from .wire import Conn, Growing, PSError

__all__ = ["Connections"]


class Connections:
    """``server``'s connections on ``host`` (a port of its own), served by a thread each or,
    with ``loop``, by the event loop once their hello is done."""

    def __init__(self, server, host: str, loop: bool):
        self.server = server
        self.rejected = 0
        self.arrivals = Arrivals()        # connections whose hello has not come yet
        self._handlers: set[socket.socket] = set()    # sockets a thread of _handle serves
        self._lock = threading.Lock()
        self.sock = socket.create_server((host, 0))
        self.sock.settimeout(0.2)
        self.address = (host, self.sock.getsockname()[1])
        self.loop = EventLoop(self._dispatch, server.max_payload, self.refused,
                              server._closed, on_start=quiet_numpy) if loop else None
        self.thread = threading.Thread(target=self._serve, name="spark_dl-ps", daemon=True)
        self.thread.start()

    def _dispatch(self, conn, *frame) -> bool:
        return self.server._dispatch(conn, *frame)

    def _serve(self):
        accept_loop(self.sock, self.server._stop, self._handle, tick=self.arrivals.reap)

    def _handle(self, sock: socket.socket):
        """A connection's thread: the nonce, the hello, and every frame after it unless the
        event loop takes the connection over once the hello is done (loop.py)."""
        quiet_numpy()
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        server = self.server
        nonce = os.urandom(16)
        conn = Conn(sock, server.secret, nonce)
        buf = Growing()
        adopted = refused = False
        if not self.arrivals.admit(sock):   # too many peers mid-handshake: not served
            sock.close()
            return
        with self._lock:
            self._handlers.add(sock)
        try:
            sock.settimeout(server.timeout_s)
            sock.sendall(nonce)
            while not server._stop.is_set():
                frame = conn.recv(server.max_payload, buf)
                if not self._dispatch(conn, *frame):
                    break
                if self.loop is not None and conn.worker is not None:
                    adopted = True               # the loop serves (or closes) it from now
                    self.loop.adopt(conn)
                    return
        except (PSError, ValueError, KeyError, IndexError) as e:
            self.refused(e)
            conn.send_error(e)
            refused = True
        except OSError:
            pass                                         # peer went away (e.g. a killed task)
        except Exception as e:           # a fault of the server's: the worker is told, the
            conn.send_error(fault(e))    # traceback goes to the driver's log (the thread's)
            refused = True
            raise
        finally:            # whatever ended the thread (a fault of ours too): the worker's
            with self._lock:                # connection closes, it does not wait for a reply
                self._handlers.discard(sock)
            self.arrivals.arrived(sock)
            if not adopted:
                server._closed(conn)
                if refused:
                    conn.close_after_error()
                else:
                    sock.close()

    def refused(self, error: Exception) -> None:
        with self._lock:
            self.rejected += 1

    def stop_listening(self) -> None:
        stop_listening(self.sock)

    def close(self) -> None:
        """After the server's stop: the connections served by threads (hellos too) shut, so
        that a thread blocked in recv returns at once; the loop closed."""
        with self._lock:
            handled = list(self._handlers)
        for sock in handled:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self.thread.join(timeout=2)
        if self.loop is not None:
            self.loop.close()
