"""`gridtrain train --nproc N`: start N local processes through torchrun.

Run as `python -m gridtrain.launch TORCHRUN_ARGS...`, this is torchrun with its ending said in one
line: when a rank fails, torchrun raises ChildFailedError, whose traceback and 30-line summary
buried the rank's own message (printed above it, once per rank). Here it is one line naming the
rank that failed first and how; `--debug` on the command line keeps torchrun's own report.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys

log = logging.getLogger("gridtrain")


def launch(nproc: int, argv: list[str], max_restarts: int = 0) -> int:
    """Start `nproc` local processes through torchrun, each running this same command; torchrun
    restarts them all up to `max_restarts` times when one fails (each restart resumes)."""
    forwarded, skip = [], False
    for arg in argv:  # the launcher's own flags (and the values after them) stay here
        if skip:
            skip = False
        elif arg in ("--nproc", "--max-restarts"):
            skip = True
        elif not arg.startswith(("--nproc=", "--max-restarts=")):
            forwarded.append(arg)
    cmd = [sys.executable, "-m", "gridtrain.launch", "--standalone", f"--nproc-per-node={nproc}",
           f"--max-restarts={max_restarts}", "-m", "gridtrain", *forwarded]
    log.info("launching %d processes: torchrun %s", nproc, " ".join(cmd[3:]))
    # A fresh rendezvous store per attempt: restarted ranks never read a dead attempt's keys.
    with subprocess.Popen(cmd, env={**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}) as proc:
        # A scheduler's SIGTERM or SIGUSR1 goes on to torchrun as SIGTERM (it has no SIGUSR1
        # handler), which passes it to every rank: they save and stop (checkpoint.signal_grace_s;
        # torchrun kills them 30 s later) instead of being orphaned.
        previous = {sig: signal.signal(sig, lambda signum, frame: proc.send_signal(signal.SIGTERM))
                    for sig in (signal.SIGTERM, signal.SIGUSR1)}
        try:
            return proc.wait()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def failure_line(err) -> str:
    """One line for torchrun's ChildFailedError: the rank that failed first, and how."""
    rank, failure = err.get_first_failure()
    how = (f"was killed by signal {-failure.exitcode} ({failure.signal_name()})" if failure.exitcode < 0
           else f"exited with status {failure.exitcode}")
    others = len(err.failures) - 1
    more = f"; {others} other rank{'s' if others > 1 else ''} stopped with it" if others else ""
    return f"gridtrain: rank {rank} {how} first{more} (its own message, if any, is above)"


def main(args: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import parse_args, run

    try:
        run(parse_args(args))
    except ChildFailedError as err:
        if "--debug" in args:
            raise
        print(failure_line(err), file=sys.stderr, flush=True)
        failure = err.get_first_failure()[1]  # its status (2: bad input), or 128 + the signal
        return failure.exitcode if failure.exitcode > 0 else 128 - failure.exitcode
    except SignalException as err:  # torchrun was told to stop; the ranks have said why
        return 128 + err.sigval
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
