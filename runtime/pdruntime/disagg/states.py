"""Transfer states of one PD request, as one enum with forward-only transitions.

    Bootstrapping -> WaitingForInput -> Transferring -> Success
          \\               \\                \\
           +---------------+----------------+--> Failed   (from any non-terminal state)

Prefill: Bootstrapping = registered, waiting for its decode peer to attach;
WaitingForInput = peer attached, KV being computed; Transferring = KV ready, being sent
and not yet confirmed; Success = decode confirmed receipt (pages freed).
Decode: Bootstrapping = pages reserved, connecting; WaitingForInput = attached, waiting
for the prefill's KV; Transferring = KV arriving; Success = KV verified and in the batch.
"""

from __future__ import annotations

import enum


class TransferState(enum.IntEnum):
    BOOTSTRAPPING = 0
    WAITING_FOR_INPUT = 1
    TRANSFERRING = 2
    SUCCESS = 3
    FAILED = 4

    @property
    def terminal(self) -> bool:
        return self in (TransferState.SUCCESS, TransferState.FAILED)

    @property
    def label(self) -> str:
        return _LABELS[self]


_LABELS = {
    TransferState.BOOTSTRAPPING: "Bootstrapping",
    TransferState.WAITING_FOR_INPUT: "WaitingForInput",
    TransferState.TRANSFERRING: "Transferring",
    TransferState.SUCCESS: "Success",
    TransferState.FAILED: "Failed",
}


class IllegalTransition(RuntimeError):
    """A transition that would move a transfer backwards or out of a terminal state."""


def can_transition(src: TransferState, dst: TransferState) -> bool:
    """Forward-only; Failed is reachable from every non-terminal state; terminal states are final."""
    if src.terminal:
        return False
    if dst is TransferState.FAILED:
        return True
    return dst > src and dst is not TransferState.FAILED


class TransferStatus:
    """The state of one transfer plus the clock time it entered each state (seconds, watchdog clock)."""

    __slots__ = ("state", "entered", "reason")

    def __init__(self, now: float) -> None:
        self.state = TransferState.BOOTSTRAPPING
        self.entered: dict[TransferState, float] = {TransferState.BOOTSTRAPPING: now}
        self.reason: str | None = None

    def advance(self, dst: TransferState, now: float, reason: str | None = None) -> None:
        if not can_transition(self.state, dst):
            raise IllegalTransition(f"transfer state {self.state.label} -> {dst.label} is not allowed")
        self.state = dst
        self.entered[dst] = now
        if reason is not None:
            self.reason = reason

    def fail(self, now: float, reason: str) -> bool:
        """Move to Failed; False (and no change) if already terminal."""
        if self.state.terminal:
            return False
        self.advance(TransferState.FAILED, now, reason)
        return True

    def since(self) -> float:
        return self.entered[self.state]
