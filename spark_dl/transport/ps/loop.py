"""One thread that serves the parameter server's connections once their hello is done.

A thread per connection (as the hello still is) costs the server little with a few workers,
but with many each push wakes a thread that must take Python's GIL and the shard's lock from
the others, several context switches and about twice the server's CPU a push (docs/guides/
downpour.md, "How many replicas one server feeds"). So where a push never waits for another
worker (modes "async" and "sequential", no ``max_staleness``) and one shard's lock serialises
the pushes anyway, one thread serves them all from a selector: it reads each connection's
frames as their bytes arrive (a frame half-sent by a slow peer holds up nobody), hands every
whole frame to the server's dispatch, and writes the replies without blocking (what the peer's
socket does not take yet is kept and written when it can).

The frames, their checks and the dispatch are the server's own (wire.py, server.py); a
connection the dispatch refuses gets the error frame and is closed, as in the threaded server.
A connection stays open until its worker says bye, the peer goes away or the server closes:
there is no idle timeout (a worker may validate or checkpoint for long between pushes).
"""

from __future__ import annotations

import collections
import itertools
import selectors
import socket
import threading
import traceback
from collections.abc import Callable

from .wire import HEADER_BYTES, Conn, PSError

__all__ = ["EventLoop", "fault"]

_REFUSED = (PSError, ValueError, KeyError, IndexError)   # the dispatch's "bad request"
_FRAMES_PER_TURN = 8               # a peer's frames handled before the others get a turn
_FIRST_BUFFER = 1 << 16            # bytes; a peer's receive buffer grows to its largest frame
_MAX_QUEUED = 256                  # reply pieces waiting for a peer that reads none: refused


class _Peer:
    """One adopted connection: the bytes it has sent that are not yet a whole frame, and the
    replies not yet written."""

    __slots__ = ("buf", "closed", "conn", "fields", "got", "out", "sock", "view")

    def __init__(self, conn: Conn):
        self.conn, self.sock = conn, conn.sock
        self.buf = bytearray(_FIRST_BUFFER)      # grows to the largest frame (a header first)
        self.view = memoryview(self.buf)
        self.got = 0                             # bytes in buf: a frame, maybe the next's start
        self.fields = None                       # the checked header of the frame in buf
        self.out: collections.deque = collections.deque()   # unwritten reply bytes
        self.closed = False

    def fill(self, n: int) -> bool:
        """Receive what has arrived, into the buffer's free room; True once it holds ``n``
        bytes. One receive usually brings a whole frame, header and payload."""
        while self.got < n:
            try:
                k = self.sock.recv_into(self.view[self.got:])
            except BlockingIOError:
                return False
            if k == 0:
                raise ConnectionError("connection closed")
            self.got += k
        return True

    def room(self, n: int) -> None:
        """A buffer of at least ``n`` bytes, keeping what it holds."""
        if len(self.buf) < n:
            grown = bytearray(n)
            grown[:self.got] = self.buf[:self.got]
            self.buf, self.view = grown, memoryview(grown)


class EventLoop:
    """Serves adopted connections on one thread: ``dispatch(conn, *frame)`` as the threaded
    handler calls it (False: close the connection), ``on_refused(error)`` when it raises a bad
    request, ``on_close(conn)`` once per connection closed, ``on_start()`` first in the loop's
    thread."""

    def __init__(self, dispatch: Callable[..., bool], max_payload: int,
                 on_refused: Callable[[Exception], None], on_close: Callable[[Conn], None],
                 name: str = "spark_dl-ps-loop", on_start: Callable[[], None] | None = None):
        self.dispatch, self.max_payload, self.on_start = dispatch, max_payload, on_start
        self.on_refused, self.on_close = on_refused, on_close
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._new: collections.deque = collections.deque()
        self._adopting = threading.Lock()       # adopt() against close(): none left behind
        self._closing = False
        self._peers: set[_Peer] = set()
        self._backlog: set[_Peer] = set()        # peers with whole frames left in their buffer
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def adopt(self, conn: Conn) -> None:
        """Serve ``conn`` from now on (called by its thread, which then leaves it alone); once
        the loop is closing, close it instead."""
        with self._adopting:
            if not self._closing:
                self._new.append(conn)
                self._wake()
                return
        self.on_close(conn)
        conn.sock.close()

    def close(self) -> None:
        """Stop serving and close every adopted connection."""
        with self._adopting:
            self._closing = True
        self._stop.set()
        self._wake()
        self._thread.join(timeout=5)
        for peer in list(self._peers):
            self._drop(peer)
        while self._new:                         # adopted after the loop had stopped
            conn = self._new.popleft()
            self.on_close(conn)
            conn.sock.close()
        self._sel.close()
        self._wake_r.close()
        self._wake_w.close()

    @property
    def connections(self) -> int:
        return len(self._peers)

    # -- the loop ------------------------------------------------------------------------
    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except (BlockingIOError, OSError):       # already pending, or closed
            pass

    def _run(self) -> None:
        if self.on_start is not None:             # the loop thread's own settings
            self.on_start()
        while not self._stop.is_set():
            ready = self._sel.select(timeout=0 if self._backlog else 0.5)
            for key, events in ready:
                if key.data is None:
                    self._take_new()
                else:
                    self._serve(key.data, events)
            backlog, self._backlog = self._backlog, set()
            for peer in backlog:                 # frames its last turn left unhandled
                if not peer.closed:
                    self._serve(peer, selectors.EVENT_READ)

    def _serve(self, peer: _Peer, events: int) -> None:
        try:
            if events & selectors.EVENT_WRITE:
                self._flush(peer)
            if events & selectors.EVENT_READ and not peer.closed:
                self._read(peer)
        except _REFUSED as e:
            self._refuse(peer, e)
        except OSError:                          # the peer went away (e.g. a killed task)
            self._drop(peer)
        except Exception as e:                   # a fault of the server's: that worker is
            traceback.print_exc()                # told, its traceback goes to the driver's
            self._refuse(peer, e, counted=False)     # log, the others are served on

    def _take_new(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, OSError):
            pass
        while self._new:
            conn = self._new.popleft()
            peer = _Peer(conn)
            try:
                conn.sock.setblocking(False)
                self._sel.register(conn.sock, selectors.EVENT_READ, peer)
            except (OSError, ValueError):        # gone before the loop took it
                self.on_close(conn)
                conn.sock.close()
                continue
            conn.sink = lambda head, view, p=peer: self._send(p, head, view)
            self._peers.add(peer)

    def _read(self, peer: _Peer) -> None:
        """Read what has arrived; dispatch every frame that is whole (at most
        ``_FRAMES_PER_TURN``, then the others' turn: the rest waits in the backlog)."""
        for _ in range(_FRAMES_PER_TURN):
            if peer.fields is None:                  # the header
                if not peer.fill(HEADER_BYTES):
                    return
                peer.fields = peer.conn.header(bytes(peer.view[:HEADER_BYTES]),
                                               self.max_payload)
                peer.room(HEADER_BYTES + peer.fields[-1])
            end = HEADER_BYTES + peer.fields[-1]
            if not peer.fill(end):
                return
            fields, peer.fields = peer.fields, None
            peer.conn.received(fields[-1])
            if not self.dispatch(peer.conn, *fields[:-1], peer.view[HEADER_BYTES:end]):
                self._drop(peer)                     # bye
                return
            if peer.closed:
                return
            extra = peer.got - end                   # the next frame's first bytes
            if extra:
                peer.buf[:extra] = peer.buf[end:peer.got]
            peer.got = extra
            if not extra:             # the peer waits for its reply: back to the selector
                return
            if peer.out:              # its replies wait for the socket: no more is read from
                return                # it until they are out (_flush), so it holds no more
        self._backlog.add(peer)              # a whole turn: the rest waits for the next

    def _send(self, peer: _Peer, head: bytes, view) -> None:
        """Conn.send's writer here: write now what the socket takes, keep the rest."""
        if peer.closed:
            return
        if len(peer.out) > _MAX_QUEUED:
            raise PSError("this worker reads no replies: more than 256 are waiting for it")
        parts = [head, view] if len(view) else [head]
        if not peer.out:
            try:
                sent = peer.sock.sendmsg(parts)
            except BlockingIOError:
                sent = 0
            parts = _rest(parts, sent)
            if not parts:
                return
            self._sel.modify(peer.sock, selectors.EVENT_WRITE, peer)   # read again once out
        peer.out.extend(parts)

    def _flush(self, peer: _Peer) -> None:
        while peer.out:
            parts = list(itertools.islice(peer.out, 64))     # below any system's IOV_MAX
            try:
                sent = peer.sock.sendmsg(parts)
            except BlockingIOError:
                return
            for _ in parts:
                peer.out.popleft()
            peer.out.extendleft(reversed(_rest(parts, sent)))
        if not peer.closed:
            self._sel.modify(peer.sock, selectors.EVENT_READ, peer)
            if peer.got:                     # frames read before the replies were out
                self._backlog.add(peer)

    def _refuse(self, peer: _Peer, error: Exception, counted: bool = True) -> None:
        """A bad request (``counted``), or a fault serving it: the error frame, when the
        socket takes it at once and no reply is half written, then the connection closes."""
        if counted:
            self.on_refused(error)
        else:
            error = fault(error)
        told = not peer.out and not peer.closed
        if told:
            peer.conn.sink = None                # straight to the non-blocking socket: a
            peer.conn.send_error(error)          # full or gone one is just closed
        self._drop(peer, told)

    def _drop(self, peer: _Peer, told: bool = False) -> None:
        """Close ``peer``'s connection; ``told``: after an error frame, which a thread reads
        past (Conn.close_after_error) so that the worker gets the reason, not a reset."""
        if peer.closed:
            return
        peer.closed = True
        peer.conn.sink = None                    # (the sink's closure holds the peer: freed
        self._peers.discard(peer)                # with it, its buffer too, without a cycle)
        try:
            self._sel.unregister(peer.sock)
        except (KeyError, ValueError):
            pass
        self.on_close(peer.conn)
        if told:
            threading.Thread(target=peer.conn.close_after_error, daemon=True).start()
        else:
            peer.sock.close()


def fault(error: Exception) -> RuntimeError:
    """What a worker is told when serving its request failed on the server's side (not a bad
    request of its own)."""
    return RuntimeError(f"the parameter server failed serving this request: "
                        f"{type(error).__name__}: {error}")


def _rest(parts: list, sent: int) -> list:
    """What of ``parts`` (bytes-like) is left after ``sent`` bytes of them were written."""
    for i, part in enumerate(parts):
        n = len(part)
        if sent < n:
            return [memoryview(part)[sent:], *parts[i + 1:]]
        sent -= n
    return []
