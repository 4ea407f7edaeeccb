"""The ``python`` a warm run's child processes start (``sys.executable`` there; tests/helpers/warm.py).

A child rank that the app's launcher starts as ``python -m MODULE ARGS`` is started warm: this
process sends its command line, environment, folder and open files to the run's zygote (a fork of
the run's first process, taken before the app ran), which forks the child rank from its imports.
This process stands for that rank to its parent: it forwards the signals sent to it, and exits as
the rank exits (the same code, or killed by the same signal). The rank runs in the parent's process
group, as a fresh child would; this process leaves it, so that a signal to the group reaches the
rank once. Anything else (``python -c``, a script) is run fresh by the real interpreter. Runs
under ``python -S``: the standard library only.
"""

import json
import os
import signal
import socket
import sys

ZYGOTE = "DDP_PLUGINS_WARM_ZYGOTE"  # the zygote's abstract socket address, "@" for its leading NUL
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGQUIT)


def main() -> None:
    args = sys.argv[1:]
    address = os.environ.pop(ZYGOTE, "")
    if not address or len(args) < 2 or args[0] != "-m":
        os.execv(sys.executable, [sys.executable, *args])
    os.setpgid(0, 0)
    fds = [fd for fd in map(int, os.listdir("/proc/self/fd")) if _is_open(fd)]
    request = {"args": args[1:], "env": dict(os.environ), "cwd": os.getcwd(), "fds": fds}
    rank = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    rank.connect("\0" + address[1:])
    socket.send_fds(rank, [json.dumps(request).encode()], fds)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in fds:  # the rank holds them now: a pipe's end is the rank's alone, as in a fresh child
        if fd != rank.fileno():
            os.dup2(null, fd) if fd <= 2 else os.close(fd)
    pid = int(rank.recv(64).split()[1])
    for sig in FORWARDED:
        signal.signal(sig, lambda signum, frame: os.kill(pid, signum))
    answer = rank.recv(64)  # "exit CODE" from the zygote once the rank has ended; nothing if it was killed
    code = int(answer.split()[1]) if answer else -signal.SIGKILL
    if code < 0:
        if -code in FORWARDED:  # this process's handler forwards it
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:  # the listing's own folder, closed since
        return False
    return True


if __name__ == "__main__":
    main()
