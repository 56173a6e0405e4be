"""The driver's live progress line during a fit.

Step reports (epoch, step, loss, samples/s, staleness) replace one another; epoch summaries
stay. Where the line goes depends on where ``print`` writes:

- a notebook (an IPython kernel): one output area, updated in place, holding the epoch lines
  and below them the current step line;
- a terminal: the step line rewritten in place (carriage return), epoch lines printed above it;
- anything else (a log file, a pipe, a ``log=`` callable of the user's): every report as its
  own line, as a logger expects.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable

__all__ = ["ProgressLine"]


def _in_notebook() -> bool:
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"


class ProgressLine:
    """``update(text)`` shows a transient step report, ``line(text)`` a lasting one, ``close()``
    ends the live line so that later output starts on a fresh line.

    ``log`` is the fit's ``log`` argument: the builtin ``print`` gets the live forms above, any
    other callable every report as a line, None nothing."""

    def __init__(self, log: Callable[[str], None] | None, stream=None):
        self.log = log
        self.stream = stream if stream is not None else sys.stdout
        if log is not print:
            self.mode = "lines"
        elif _in_notebook():
            self.mode = "notebook"
        elif getattr(self.stream, "isatty", lambda: False)():
            self.mode = "terminal"
        else:
            self.mode = "lines"
        self._lines: list[str] = []       # notebook: the lasting lines of this fit
        self._live = ""                   # the current step report, if shown
        self._handle = None               # notebook: the display area

    def update(self, text: str) -> None:
        if self.log is None:
            return
        if self.mode == "lines":
            self.log(text)
        elif self.mode == "terminal":      # cut to the width: a wrapped line is not rewritten
            text = text[:max(shutil.get_terminal_size().columns - 1, 20)]
            self.stream.write("\r" + text + "\x1b[K")
            self.stream.flush()
            self._live = text
        else:
            self._live = text
            self._show()

    def line(self, text: str) -> None:
        if self.log is None:
            return
        if self.mode == "lines":
            self.log(text)
        elif self.mode == "terminal":
            self.stream.write("\r" + text + "\x1b[K\n")     # over the step line
            self.stream.flush()
            self._live = ""
        else:
            self._lines.append(text)
            self._live = ""
            self._show()

    def close(self) -> None:
        if self.mode == "terminal" and self._live:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
        self._live = ""
        if self.mode == "notebook" and self._handle is not None:
            self._show()

    def _show(self) -> None:
        from IPython.display import display
        text = "\n".join(self._lines + ([self._live] if self._live else []))
        data = {"text/plain": text}
        if self._handle is None:
            self._handle = display(data, raw=True, display_id=True)
        else:
            self._handle.update(data, raw=True)
