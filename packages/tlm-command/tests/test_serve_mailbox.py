"""The scheduler thread's pieces reach the event loop with one wake-up for all those posted before the loop runs
(a step of many streaming rows wakes it once), each queue getting its own pieces in order."""

import asyncio
import threading

from tlm_command.openai_api.jobs import _Mailbox
from tlm_model.scheduler import Piece


def test_pieces_posted_together_wake_the_loop_once_and_arrive_in_order():
    loop = asyncio.new_event_loop()
    try:
        mailbox = _Mailbox(loop)
        wakes = []
        call_soon_threadsafe = loop.call_soon_threadsafe

        def counted(*args):
            wakes.append(args)
            return call_soon_threadsafe(*args)

        loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
        queues = [asyncio.Queue() for _ in range(3)]

        def step(n: int) -> None:  # the scheduler thread: one piece per row, rows in turn
            for k in range(n):
                mailbox.post(queues[k % 3], (k % 3, Piece(str(k))))

        thread = threading.Thread(target=step, args=(16,))
        thread.start()
        thread.join()
        loop.run_until_complete(asyncio.sleep(0))
        assert len(wakes) == 1
        got = [[q.get_nowait()[1].text for _ in range(q.qsize())] for q in queues]
        assert got == [[str(k) for k in range(16) if k % 3 == r] for r in range(3)]
        step(2)  # the next step's pieces wake it again
        loop.run_until_complete(asyncio.sleep(0))
        assert len(wakes) == 2 and [q.qsize() for q in queues] == [1, 1, 0]
    finally:
        loop.close()


def test_a_closed_loop_refuses_the_post_and_the_mailbox_stays_usable():
    loop = asyncio.new_event_loop()
    loop.close()
    mailbox = _Mailbox(loop)
    queue = asyncio.Queue()
    for _ in range(2):  # each post tries to wake the loop (nothing is left waiting for a wake-up that never comes)
        try:
            mailbox.post(queue, (0, Piece("x")))
        except RuntimeError:
            pass
        else:
            raise AssertionError("a closed loop accepted a wake-up")
        assert mailbox.items == []
