import signal
import threading

from amp_tui.core.signals import handling_signals, install_handlers, restore_handlers


def _handler(_signum, _frame):
    pass


def test_handlers_are_installed_inside_the_block_and_the_previous_ones_come_back():
    before = signal.getsignal(signal.SIGUSR1)
    with handling_signals((signal.SIGUSR1,), _handler) as previous:
        assert signal.getsignal(signal.SIGUSR1) is _handler
        assert previous == {signal.SIGUSR1: before}
    assert signal.getsignal(signal.SIGUSR1) is before


def test_a_signal_that_cannot_be_handled_is_left_out():
    previous = install_handlers((signal.SIGKILL, signal.SIGUSR1), _handler)
    try:
        assert list(previous) == [signal.SIGUSR1]
    finally:
        restore_handlers(previous)
    assert previous == {}


def test_off_the_main_thread_nothing_is_installed():
    seen = []
    thread = threading.Thread(target=lambda: seen.append(install_handlers((signal.SIGUSR1,), _handler)))
    thread.start()
    thread.join()
    assert seen == [{}]
    assert signal.getsignal(signal.SIGUSR1) is not _handler
