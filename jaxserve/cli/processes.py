"""An engine for a command, and the command run on process 0 of a multi-process run while the others follow its
steps."""
from __future__ import annotations


def load_llm(config):
    """The offline engine of an EngineConfig (imported when a command runs: the router and --help load none)."""
    from jaxserve import LLM
    return LLM.from_config(config)


def lead(llm, command, grace_s: float = 30.0) -> None:
    """command(llm) on process 0; the other processes of a multi-process run follow its steps until it is done.

    SIGTERM (JAX's preemption notifier would swallow it) ends the run wherever it lands: on process 0 as a stop
    (serve drains for its grace period), on another process as a request to process 0 to stop the same way; that
    process ends on its own if the run has not ended when process 0's drain (grace_s) and shutdown should be over."""
    import signal

    from jaxserve.multihost import HEARTBEAT_TIMEOUT_S, exit_now, take_held_sigterm
    processes = llm.processes
    if processes.is_follower:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C reaches every process: process 0 decides

        def stop(*_):
            import threading
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # asked once
            processes.request_stop()
            # Process 0's drain: the grace period, then its engines' shutdown (30 s at most) and the server's
            # cleanup (5 s), and the heartbeat that tells this process it is gone.
            limit = grace_s + 30 + 5 + 2 * HEARTBEAT_TIMEOUT_S
            message = f"jaxserve: error: process 0 did not end the run within {limit:.0f} s of this process's SIGTERM"
            timer = threading.Timer(limit, exit_now, (1, message))
            timer.daemon = True
            timer.start()
        signal.signal(signal.SIGTERM, stop)
        if take_held_sigterm():  # it came while the model loaded
            stop()
        try:
            llm.follow()
        except BaseException as e:  # noqa: BLE001 - whatever it is, the leader must not wait for this process
            # Not through JAX's shutdown barrier, which would hold this process while the leader waits on it in a
            # step: gone, it is noticed by the coordination service, which ends the others.
            exit_now(1, f"jaxserve: error: {type(e).__name__}: {e}")
        return
    if processes.multi_process:
        import os
        signal.signal(signal.SIGTERM, signal.default_int_handler)  # generate / chat: as Ctrl-C; serve sets its own
        processes.watch_stop_requests(lambda: os.kill(os.getpid(), signal.SIGTERM))
    try:
        if not take_held_sigterm():  # one that came while the model loaded ends the run before it starts
            command(llm)
    finally:
        llm.shutdown()
