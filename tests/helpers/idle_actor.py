"""The smallest Ray actor: says its pid, or sleeps (a busy rank). Here, not in a test module, so that
Ray's workers can import it by name."""

from __future__ import annotations

import os
import time


class Idle:
    def pid(self) -> int:
        return os.getpid()

    def sleep(self, s: float) -> None:
        time.sleep(s)
