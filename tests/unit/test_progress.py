"""The driver's live progress line: rewritten in place on a terminal, one line per report
for a logger, nothing with log=None (the notebook form is checked by tests/spark/test_notebooks)."""

import io

from spark_dl.progress import ProgressLine


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_terminal_rewrites_the_step_line_and_keeps_the_epoch_lines():
    out = _Terminal()
    live = ProgressLine(print, stream=out)
    assert live.mode == "terminal"
    live.update("  epoch 1/2 step 10/50 loss 2.1")
    live.update("  epoch 1/2 step 20/50 loss 1.7")
    live.line("epoch 1: loss 1.5")
    live.update("  epoch 2/2 step 10/50 loss 1.2")
    live.close()
    text = out.getvalue()
    # what a terminal shows: each \r returns to the line's start, \x1b[K clears the rest
    screen = [seg.split("\r")[-1].replace("\x1b[K", "") for seg in text.split("\n")]
    assert screen == ["epoch 1: loss 1.5", ""]
    assert text.count("\n") == 1 and text.endswith("\r\x1b[K")


def test_a_logger_gets_every_report_as_a_line_and_none_gets_nothing():
    got = []
    live = ProgressLine(got.append)
    assert live.mode == "lines"
    live.update("step 1")
    live.line("epoch 1")
    live.close()
    assert got == ["step 1", "epoch 1"]
    quiet = ProgressLine(None)
    quiet.update("step 1")
    quiet.line("epoch 1")
    quiet.close()


def test_print_into_a_pipe_or_file_is_one_line_per_report(capsys):
    live = ProgressLine(print)              # pytest's captured stdout is not a terminal
    assert live.mode == "lines"
    live.update("step 1")
    live.line("epoch 1")
    assert capsys.readouterr().out == "step 1\nepoch 1\n"


def test_the_terminal_line_is_cut_to_the_width(monkeypatch):
    monkeypatch.setenv("COLUMNS", "30")         # a wrapped line could not be rewritten
    out = _Terminal()
    live = ProgressLine(print, stream=out)
    live.update("x" * 100)
    assert out.getvalue() == "\r" + "x" * 29 + "\x1b[K"
