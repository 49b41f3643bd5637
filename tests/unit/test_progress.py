"""The progress bar (tqdm's, telemetry/progress.py): drawn on a terminal only, its last step always shown,
erased at the epoch's end, no monitor thread left in a training process."""

import io
import threading

from phalanx.telemetry import ProgressBar


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_draws_on_a_terminal_its_last_step_and_erases_at_close():
    stream = _Terminal()
    bar = ProgressBar(label="epoch 2/3", enabled=True, stream=stream)
    for done in range(1, 51):
        bar.update(done, 50)
    drawn = stream.getvalue()
    assert drawn.startswith("\repoch 2/3 [") and "50/50" in drawn and "step/s" in drawn
    assert drawn.count("\r") < 20  # redrawn at most ~10 times a second, not at every step
    bar.close()
    assert stream.getvalue()[len(drawn):].strip(" \r") == ""  # the line is erased


def test_silent_off_a_terminal_or_when_disabled_and_starts_no_thread():
    before = threading.active_count()
    for stream, enabled in ((io.StringIO(), True), (_Terminal(), False)):
        bar = ProgressBar(label="epoch 1/1", enabled=enabled, stream=stream)
        bar.update(1, 2)
        bar.update(2, 2)
        bar.close()
        assert stream.getvalue() == ""
    bar = ProgressBar(label="epoch 1/1", enabled=True, stream=_Terminal())
    bar.update(1, 1)
    assert threading.active_count() == before
    bar.close()


def test_a_bar_makes_no_multiprocessing_lock():
    # tqdm's default lock is a multiprocessing semaphore that a killed worker would leak (the
    # resource tracker then warns after the run's one-line ending).
    from multiprocessing import synchronize

    bar = ProgressBar(label="epoch 1/1", enabled=False, stream=io.StringIO())
    lock = type(bar._bar).get_lock()
    assert not isinstance(lock, synchronize.SemLock) and not hasattr(lock, "mp_lock")
    bar.close()
