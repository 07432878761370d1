"""Console progress: tqdm bars for long work and timestamped notes, on the logging rank only."""

from __future__ import annotations

import sys
import time


class _NoBar:
    def update(self, n: int = 1, **postfix: float) -> None:
        pass

    def close(self) -> None:
        pass


class _Bar:
    def __init__(self, desc: str, total: int):
        from tqdm import tqdm

        self._bar = tqdm(total=total, desc=desc, file=sys.stdout, dynamic_ncols=True, leave=True)

    def update(self, n: int = 1, **postfix: float) -> None:
        if postfix:
            self._bar.set_postfix({k: f"{v:.3g}" for k, v in postfix.items()}, refresh=False)
        self._bar.update(n)

    def close(self) -> None:
        self._bar.close()


class Progress:
    def __init__(self, enabled: bool):
        self.enabled = enabled
        self._t0 = time.monotonic()

    def bar(self, desc: str, total: int):
        return _Bar(desc, total) if self.enabled else _NoBar()

    def note(self, message: str) -> None:
        if self.enabled:
            from tqdm import tqdm

            tqdm.write(f"[{time.monotonic() - self._t0:7.1f}s] {message}", file=sys.stdout)
