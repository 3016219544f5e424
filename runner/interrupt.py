"""Ctrl-C and SIGTERM (a scheduler's pre-emption) stop a run at a step boundary, with a checkpoint.

    with GracefulInterrupt() as interrupt:
        while training:
            step()
            if interrupt.requested:
                save_checkpoint()
                interrupt.stop(step)   # one line on stderr, exit code 130 / 143

The first signal only sets a flag, so the step in progress finishes and the checkpoint is
consistent. A second signal means "now": it raises SystemExit at once (finally blocks and
atomic writes still clean up; Python prints no traceback for SystemExit).
"""
from __future__ import annotations

import signal
import sys
import threading
from types import FrameType, TracebackType
from typing import Any, NoReturn

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class GracefulInterrupt:
    def __init__(self) -> None:
        self.requested: str | None = None   # "SIGTERM" / "SIGINT" once a signal arrived
        self.exit_code: int | None = None   # 128 + signal number: the shell's convention (143, 130)
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> GracefulInterrupt:
        # Python runs signal handlers in the main thread only; elsewhere the defaults stay.
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._handle) for sig in SIGNALS}
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested is not None:
            raise SystemExit(128 + signum)
        self.requested = signal.Signals(signum).name
        self.exit_code = 128 + signum

    def follow(self) -> None:
        """Another process of a data-parallel run was interrupted: stop as if SIGTERM came here too
        (torchrun forwards a scheduler's SIGTERM to every rank, not always before the same step)."""
        if self.requested is None:
            self.requested, self.exit_code = "SIGTERM", 128 + signal.SIGTERM

    def stop(self, step: int) -> NoReturn:
        """Call after the checkpoint of `step` is written: say so and exit with the signal's code."""
        print(f"mpt-run: interrupted by {self.requested} at step {step}; checkpoint saved; "
              f"rerun the same command to resume", file=sys.stderr)
        raise SystemExit(self.exit_code)
