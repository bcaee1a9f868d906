"""Start-up progress: what an engine is doing while it is not yet serving.

On a fresh GPU an engine spends minutes loading weights, compiling kernels (flashinfer's
FMHA-v2 alone takes minutes on first use) and capturing CUDA graphs. Each phase is logged on
the `slidespec.startup` logger at INFO with counts and elapsed time, so that `slidespec serve`
(and any log reader) shows where start-up is; the replica reports ready only after the last.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

logger = logging.getLogger("slidespec.startup")


@dataclass
class StartupProgress:
    """Phases and steps of one engine's start-up, logged as they happen and kept for reports."""

    role: str = "engine"
    started: float = field(default_factory=time.perf_counter)
    phases: list[tuple[str, float]] = field(default_factory=list)  # (phase, seconds)

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    @contextlib.contextmanager
    def phase(self, name: str, detail: str = "") -> Iterator[None]:
        """Log `name` when it starts and ends, with its own and the total elapsed time."""
        logger.info("%s start-up: %s%s ...", self.role, name, f" ({detail})" if detail else "")
        start = time.perf_counter()
        yield
        seconds = time.perf_counter() - start
        self.phases.append((name, seconds))
        logger.info("%s start-up: %s done in %.1f s (%.1f s since start)", self.role, name, seconds, self.elapsed())

    def step(self, name: str, done: int, total: int, what: str = "") -> None:
        """One step of a counted phase: `name done of total` and what the step was."""
        logger.info(
            "%s start-up: %s %d of %d%s (%.1f s since start)",
            self.role,
            name,
            done,
            total,
            f": {what}" if what else "",
            self.elapsed(),
        )

    def ready(self) -> None:
        logger.info("%s start-up: ready in %.1f s", self.role, self.elapsed())


def show_progress_logs(level: int = logging.INFO) -> None:
    """Let the start-up logger's INFO lines reach this process's stderr (a Ray actor's root
    logger stays at WARNING; its stderr goes to the driver's terminal when it streams logs)."""
    if any(getattr(h, "slidespec_startup", False) for h in logger.handlers):
        return
    handler = logging.StreamHandler()
    handler.slidespec_startup = True
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False
