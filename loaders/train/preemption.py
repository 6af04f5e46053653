"""Stopping a training run cleanly when it is told to: SIGTERM (a spot reclaim, Kubernetes,
Slurm's cancel, torchrun forwarding its own) or SIGUSR1 (Slurm's ``--signal`` warning).

:func:`stop_signals` installs the handlers for the duration of the training loop
(:func:`loaders.train.train`); the loop asks its :class:`StopRequest` after each step which
signal, if any, has arrived, agrees on it with the other ranks, saves a checkpoint and raises
:class:`Preempted`; ``python -m loaders.train`` then exits with :data:`EXIT_PREEMPTED`.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

from loaders.train.world import World, all_reduce

__all__ = [
    "EXIT_PREEMPTED",
    "STOP_SIGNALS",
    "AgreedStop",
    "Preempted",
    "StopRequest",
    "signal_name",
    "stop_signals",
]

log = logging.getLogger(__name__)

#: The exit status of a run stopped by a signal after its checkpoint was saved: ``EX_TEMPFAIL``
#: of ``sysexits.h`` ("try again later"), neither 0, nor 1 (a crash), nor 2 (bad input), nor
#: 128 + a signal (killed before it could save).
EXIT_PREEMPTED = 75

#: The signals that stop a run after its current step, with a checkpoint.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


# NOTE [ Stopping on a signal ]
# The handler only records the signal number (an attribute store: safe in a handler, which runs
# in the main thread between two bytecodes, maybe in the middle of a step or of a save). The
# training loop reads it after each training step, after each evaluation batch and after each
# epoch, and all-reduces it (MAX) with the other ranks at those same points, so that every rank
# stops after the same step even when the signal reached only some of them (a rank that
# stopped alone would leave the others waiting in DDP's next all-reduce). Rank 0 then saves
# the checkpoint; every rank waits for it (one more all-reduce) before it exits, as torchrun
# stops the other ranks once one has exited. Nothing else reads or writes the number. The
# handlers are removed (the previous ones restored) when the loop ends, normally or not.


class StopRequest:
    """The stop signal this process has received: its number, the largest if several; 0 for
    none (see the NOTE above)."""

    def __init__(self) -> None:
        self.signum = 0

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.signum = max(self.signum, signum)


class Preempted(Exception):
    """Raised by :func:`loaders.train.train` once a stop signal has been agreed on by every
    rank and rank 0 has saved the checkpoint to resume from; ``str()`` is the line to log."""

    def __init__(self, message: str, *, signum: int, checkpoint: str) -> None:
        super().__init__(message)
        self.signum = signum
        self.checkpoint = checkpoint


def signal_name(signum: int) -> str:
    """``SIGTERM`` for 15."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


@contextmanager
def stop_signals() -> Iterator[StopRequest]:
    """A :class:`StopRequest` that :data:`STOP_SIGNALS` set while the block runs. Outside the
    main thread (where Python cannot install handlers) the request is never set and the
    signals keep their previous handling."""
    request = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        log.debug("not in the main thread: %s keep their handlers", ", ".join(s.name for s in STOP_SIGNALS))
        yield request
        return
    previous = {sig: signal.signal(sig, request._handle) for sig in STOP_SIGNALS}
    try:
        yield request
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class AgreedStop:
    """The stop signal the ranks agree on (NOTE [ Stopping on a signal ] in
    :mod:`loaders.train.preemption`): :meth:`agreed` is a collective, which every rank calls at
    the same points, after each training step, evaluation batch and epoch."""

    def __init__(self, request: StopRequest, world: World, checkpoint_uri: str) -> None:
        self._request, self._world, self._checkpoint_uri = request, world, checkpoint_uri
        self.signum = 0  # the largest signal any rank had received when last agreed; 0 for none

    def agreed(self) -> bool:
        """Whether any rank has received a stop signal (:attr:`signum`: the largest)."""
        signum = self._request.signum
        if self._world.active:
            (largest,) = all_reduce([float(signum)], self._world, maximum=True)
            signum = int(largest)
        self.signum = signum
        return self.signum != 0

    def preempted(self, where: str) -> Preempted:
        """Once rank 0 has saved the checkpoint (every rank waits for it: torchrun stops the
        others as soon as one rank exits), the exception that ends the run (its message is the line the loop logs)."""
        all_reduce([0.0], self._world)
        message = (
            f"{signal_name(self.signum)}: saved the checkpoint {self._checkpoint_uri} {where}; "
            f"exiting with status {EXIT_PREEMPTED}: rerun with --resume auto to continue"
        )
        return Preempted(message, signum=self.signum, checkpoint=self._checkpoint_uri)
