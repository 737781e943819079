"""SIGTERM/SIGUSR1 (sent by SLURM before preemption) recorded for the loop to act on."""

from __future__ import annotations

import signal


class ExitSignal:
    """Records that SIGTERM/SIGUSR1 arrived; the loop saves and exits at the iteration's end."""

    def __init__(self):
        self.received = False

    def _handler(self, signum, frame):
        self.received = True

    @classmethod
    def install(cls, signums) -> "ExitSignal":
        sig = cls()
        for s in signums:
            signal.signal(s, sig._handler)
        return sig
