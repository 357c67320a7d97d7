"""GenerationLock: writers' sections bump the generation, readers' do not; it stays a reentrant
lock that threading.Condition can wait on."""
from __future__ import annotations

import threading
import time

from engine.generation_lock import GenerationLock


def test_writers_bump_readers_do_not_and_reentry_nests():
    lock = GenerationLock()
    g = lock.generation
    with lock.reading():
        with lock.reading():            # reentrant, as the RLock it replaces
            pass
    assert lock.generation == g
    with lock:
        with lock.reading():            # a reader inside a writer: still one writer's section
            pass
        with lock:
            pass
    assert lock.generation == g + 2
    assert lock.acquire(blocking=False)
    lock.release()
    assert lock.generation == g + 3


def test_the_lock_excludes_other_threads_in_both_modes():
    lock, order = GenerationLock(), []

    def other():
        with lock.reading():
            order.append("other")

    with lock:
        t = threading.Thread(target=other)
        t.start()
        time.sleep(0.05)
        order.append("writer")          # the reader is still blocked
    t.join()
    assert order == ["writer", "other"]
    with lock.reading():
        t = threading.Thread(target=lambda: order.append(lock.acquire(blocking=False)))
        t.start()
        t.join()
    assert order[-1] is False           # held by a reader: a writer cannot enter either


def test_a_condition_waits_on_it_and_a_wake_counts_as_a_writer():
    lock = GenerationLock()
    cond = threading.Condition(lock)
    ready = []

    def waiter():
        with cond:
            while not ready:
                cond.wait(timeout=5)
            ready.append("woke")

    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(0.05)
    g = lock.generation
    with cond:
        ready.append(1)
        cond.notify_all()
    t.join(timeout=5)
    assert ready == [1, "woke"]
    # the notifier's section and the waiter's reacquisition both count
    assert lock.generation >= g + 2
