"""The engine processes die with their worker: vLLM starts its engine-core and worker
processes with the spawn method and, when the worker is killed with SIGKILL, they are
re-parented to init and run on, holding the device's memory."""

from __future__ import annotations

import os
import subprocess
import sys

# The watchdog: notes the worker's descendants every half second, and blocks on a pipe
# whose only write end the worker holds; the read returns when the worker is gone,
# however it ended (SIGKILL included), and the watchdog then kills what it noted (psutil
# checks each process's start time, so a reused pid is left alone).
_WATCHDOG = """
import sys, threading, time
import psutil
worker, me, seen = psutil.Process(int(sys.argv[1])), psutil.Process(), {}
def note():
    while True:
        try:
            seen.update((p.pid, p) for p in worker.children(recursive=True) if p.pid != me.pid)
        except psutil.Error:
            return
        time.sleep(0.5)
threading.Thread(target=note, daemon=True).start()
sys.stdin.buffer.read()
for process in seen.values():
    try:
        process.kill()
    except psutil.Error:
        pass
"""
_watchdog_pipe: list[int] = []  # the write end, held open for the process's life


def kill_engine_processes_on_exit() -> None:
    """Make vLLM's engine-core and worker processes die with this process.

    They are started with the spawn method and, when this process is killed with
    SIGKILL, are re-parented to init and run on, holding the device's memory. A watchdog
    process (:data:`_WATCHDOG`) kills them once this process is gone. Call once, before
    the engine starts. (Not a process group of its own: that would take the worker out of
    its terminal's, and Ctrl-C would no longer reach it.)"""
    if _watchdog_pipe:
        return
    read_fd, write_fd = os.pipe()  # not inherited: only this process holds the write end
    subprocess.Popen([sys.executable, "-c", _WATCHDOG, str(os.getpid())], stdin=read_fd,
                     stdout=subprocess.DEVNULL, start_new_session=True)
    os.close(read_fd)
    _watchdog_pipe.append(write_fd)
