"""Authenticated messages from Spark tasks to the driver (progress and metrics), and the
driver's one reply: the statuses of a barrier stage's tasks, gathered (``gather_statuses``).

A frame is ``b"SDL1" | length (4 bytes) | HMAC-SHA256(secret, body) | body``, the body a
JSON object of at most 1 MiB. The secret is made per fit on the driver and reaches the tasks
inside the task closure (Spark's own channel), never over this socket. The server binds to
the driver's address, drops any connection whose frame is malformed, too big or carries a
wrong MAC, and never unpickles anything.

Why the driver gathers: ``BarrierTaskContext.allGather`` answers no sooner than a second after
it is called (Spark's JVM side polls its reply once a second), a second added to every fit.
Through the driver the same exchange takes milliseconds. When the driver cannot be reached, or
not every task has joined within ``StatusGather.patience_s`` of the first, the driver answers
"fall back" to every task of that stage, and they all take allGather: one verdict per round,
so that no task waits in allGather for tasks that went the other way.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import socket
import struct
import threading
import time
from collections.abc import Callable

__all__ = ["MAX_BODY", "BadFrame", "MessageClient", "MessageServer", "StatusGather",
           "accept_loop", "gather_statuses", "pack", "read_frame", "stop_listening"]

MAGIC = b"SDL1"
MAX_BODY = 1 << 20
_HEAD = struct.Struct("!4sI32s")


def pack(secret: bytes, message: dict) -> bytes:
    body = json.dumps(message, separators=(",", ":")).encode()
    if len(body) > MAX_BODY:
        raise ValueError(f"message of {len(body)} bytes exceeds {MAX_BODY}")
    return _HEAD.pack(MAGIC, len(body), hmac.new(secret, body, hashlib.sha256).digest()) + body


def _read_exact(conn: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


class BadFrame(ValueError):
    """A frame that is malformed, too big, cut short or carries a wrong MAC."""


def read_frame(conn: socket.socket, secret: bytes) -> dict | None:
    """The next frame's message (a JSON object); None when the peer closed the connection
    between frames; BadFrame for anything else that is not a whole, authentic frame."""
    head = _read_exact(conn, _HEAD.size)
    if head is None:
        return None
    magic, length, mac = _HEAD.unpack(head)
    if magic != MAGIC or length > MAX_BODY:
        raise BadFrame("not a spark_dl frame, or too big")
    body = _read_exact(conn, length)
    if body is None or not hmac.compare_digest(mac, hmac.new(secret, body,
                                                             hashlib.sha256).digest()):
        raise BadFrame("cut short, or a wrong MAC")
    try:
        message = json.loads(body)
    except ValueError:
        raise BadFrame("not JSON") from None
    if not isinstance(message, dict):
        raise BadFrame("not a JSON object")
    return message


def stop_listening(sock: socket.socket) -> None:
    """Close a listening socket so that a thread blocked in its ``accept`` returns at once
    (closing alone leaves it there until the socket's timeout)."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


def accept_loop(sock: socket.socket, stop: threading.Event,
                handle: Callable[[socket.socket], None],
                tick: Callable[[], None] | None = None) -> None:
    """Accept connections on ``sock`` until ``stop`` is set or ``sock`` is closed, each handled
    by ``handle`` on a daemon thread of its own; ``sock``'s timeout is how soon ``stop`` is
    seen, and ``tick`` (if given) is called that often too. The serving loop of the message
    channel and of the parameter server."""
    while not stop.is_set():
        if tick is not None:
            tick()
        try:
            conn, _ = sock.accept()
        except TimeoutError:
            continue
        except OSError:
            if stop.is_set() or sock.fileno() == -1:
                return
            time.sleep(0.1)        # out of file descriptors (EMFILE) or the like: transient,
            continue               # not the end of serving (peers that hold sockets let go)
        try:
            threading.Thread(target=handle, args=(conn,), daemon=True).start()
        except RuntimeError:       # no thread to be had now: this peer is closed, not served
            conn.close()
            time.sleep(0.1)


class Arrivals:
    """The connections of a server that have not yet sent a valid first frame (the parameter
    server's hello, the message channel's first message): each gets ``seconds`` to, however
    slowly it sends its bytes, and at most ``most`` wait at once (each holds a thread), so a
    peer that connects and stalls cannot hold the server's threads and descriptors for
    long. ``reap`` (the accept loop's tick) shuts the late ones; their threads then end."""

    def __init__(self, seconds: float = 30.0, most: int = 256):
        self.seconds, self.most = seconds, most
        self.turned_away = 0                  # closed unserved or shut for being late
        self._due: dict[socket.socket, float] = {}
        self._lock = threading.Lock()

    def admit(self, sock: socket.socket) -> bool:
        """Whether ``sock`` is served (False: too many wait; the caller closes it)."""
        with self._lock:
            if len(self._due) >= self.most:
                self.turned_away += 1
                return False
            self._due[sock] = time.monotonic() + self.seconds
            return True

    def arrived(self, sock: socket.socket) -> None:
        """``sock``'s first valid frame came (in time), or its connection ended."""
        if sock in self._due:
            with self._lock:
                self._due.pop(sock, None)

    def reap(self) -> None:
        now = time.monotonic()
        with self._lock:
            late = [sock for sock, due in self._due.items() if due < now]
            for sock in late:
                del self._due[sock]
            self.turned_away += len(late)
        for sock in late:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class MessageServer:
    """Receives authenticated messages on ``host`` (a free port) and calls ``on_message``."""

    def __init__(self, host: str, secret: bytes, on_message: Callable[[dict], None]):
        self.secret, self.on_message = secret, on_message
        self.rejected = 0                  # connections dropped for a bad frame or MAC
        self._sock = socket.create_server((host, 0))
        self._sock.settimeout(0.2)
        self.address = (host, self._sock.getsockname()[1])
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.gather = StatusGather()
        self.arrivals = Arrivals()        # a task's first message comes as it connects
        self._thread = threading.Thread(target=self._serve, name="spark_dl-messages", daemon=True)
        self._thread.start()

    def _serve(self):
        accept_loop(self._sock, self._stop, self._handle, tick=self.arrivals.reap)

    def _handle(self, conn: socket.socket):
        if not self.arrivals.admit(conn):
            conn.close()
            return
        with conn:
            conn.settimeout(None)
            while not self._stop.is_set():
                try:
                    message = read_frame(conn, self.secret)
                except BadFrame:
                    self.rejected += 1
                    return
                except OSError:
                    return
                finally:                                  # a valid frame, or the end
                    self.arrivals.arrived(conn)
                if message is None:                       # the task closed: the normal end
                    return
                if message.get("type") == "gather":       # a task waits for the answer
                    reply = self.gather.join(message, self._stop)
                    try:
                        conn.sendall(pack(self.secret, reply))
                    except OSError:
                        return
                    continue
                with self._lock:
                    if self._stop.is_set():       # closed: the owner has moved on
                        return
                    self.on_message(message)

    def close(self):
        """Stop serving; when it returns, no ``on_message`` call is running or will run."""
        with self._lock:
            self._stop.set()
        stop_listening(self._sock)
        self._thread.join(timeout=2)


class MessageClient:
    """Sends messages to a MessageServer; best effort: a lost driver never stops training."""

    def __init__(self, address: tuple[str, int] | None, secret: bytes, timeout: float = 5.0):
        self.address, self.secret, self.timeout = address, secret, timeout
        self._sock: socket.socket | None = None
        self.failed = address is None

    def send(self, message: dict) -> bool:
        if self.failed:
            return False
        try:
            if self._sock is None:
                self._sock = socket.create_connection(tuple(self.address), timeout=self.timeout)
            self._sock.sendall(pack(self.secret, {"time": time.time(), **message}))
            return True
        except OSError:
            self.failed = True            # progress is a convenience; training goes on
            self.close()
            return False

    def close(self):
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class StatusGather:
    """The driver's side of ``gather_statuses``: per barrier stage (the message's "key"),
    every task's status, answered to all of them at once when the last one joins.

    A round gets one verdict, for every task that asks: the statuses in rank order, or None
    (fall back to Spark's allGather) when not every task has joined ``patience_s`` after the
    first did (one cannot reach the driver, or is still reading a much larger partition), when
    a message does not fit the round (a rank twice, out of range, another world size), or
    when the server closes. A round whose statuses every task has received is over: a task
    that asks again under its key (Spark retrying the stage) starts a new one. A round that
    fell back stays so: a retried stage takes allGather too."""

    PATIENCE_S = 30.0

    def __init__(self, patience_s: float | None = None):
        self.patience_s = self.PATIENCE_S if patience_s is None else patience_s
        self._cond = threading.Condition()
        self._rounds: dict[str, dict] = {}
        self.answered = self.fell_back = 0          # tasks answered, rounds given up

    def join(self, message: dict, stop: threading.Event) -> dict:
        key, rank, world = str(message.get("key")), message.get("rank"), message.get("world")
        with self._cond:
            rnd = self._rounds.get(key)
            if rnd is None or (rnd["verdict"] not in ("open", None) and rank in rnd["answered"]):
                rnd = self._rounds[key] = {"world": world, "statuses": {}, "verdict": "open",
                                           "answered": set(),
                                           "deadline": time.monotonic() + self.patience_s}
            if rnd["verdict"] == "open":
                fits = (isinstance(rank, int) and isinstance(world, int) and world == rnd["world"]
                        and 0 <= rank < world and rank not in rnd["statuses"])
                if not fits:
                    self._decide(rnd, None)
                else:
                    rnd["statuses"][rank] = message.get("status")
                    if len(rnd["statuses"]) == world:
                        self._decide(rnd, [rnd["statuses"][r] for r in range(world)])
            while rnd["verdict"] == "open":
                left = rnd["deadline"] - time.monotonic()
                if left <= 0 or stop.is_set():
                    self._decide(rnd, None)
                    break
                self._cond.wait(min(left, 0.25))
            rnd["answered"].add(rank)
            self.answered += 1
            return {"type": "gathered", "key": key, "rank": rank, "statuses": rnd["verdict"]}

    def _decide(self, rnd: dict, verdict: list | None) -> None:
        rnd["verdict"] = verdict
        rnd["statuses"] = {}
        self.fell_back += verdict is None
        self._cond.notify_all()


def gather_statuses(address: tuple[str, int], secret: bytes, key: str, rank: int, world: int,
                    status: dict, connect_s: float = 5.0, patience_s: float = 30.0
                    ) -> list[dict] | None:
    """Every task's ``status`` in rank order, through the driver at ``address`` (a task of a
    barrier stage; ``key`` names the stage). None: the driver could not be reached
    (nothing was sent) or it answered "fall back": take Spark's allGather, as every task of the
    stage then does. Raises ConnectionError when the question went out but no answer
    came back: the other tasks may have gone either way, so the attempt must fail (Spark
    retries it)."""
    try:
        conn = socket.create_connection(tuple(address), timeout=connect_s)
    except OSError:
        return None
    with conn:
        try:
            conn.sendall(pack(secret, {"type": "gather", "key": key, "rank": rank,
                                       "world": world, "status": status}))
        except OSError:
            return None                      # the driver drops a frame cut short: not counted
        conn.settimeout(patience_s + 30.0)
        try:
            reply = read_frame(conn, secret)
        except (OSError, BadFrame) as e:
            raise ConnectionError(f"task {rank}: no answer from the driver to the rendezvous of "
                                  f"stage {key} ({e})") from e
    if reply is None or reply.get("type") != "gathered" or reply.get("key") != key \
            or reply.get("rank") != rank:
        raise ConnectionError(f"task {rank}: the driver closed the rendezvous of stage "
                              f"{key} without an answer")
    return reply["statuses"]
