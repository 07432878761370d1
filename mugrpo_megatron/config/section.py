"""What every config section shares: its key in the YAML file and the checks of its values."""

from __future__ import annotations

from typing import ClassVar


class Section:
    """Shared validation helpers; ``_name`` is the section's key in the YAML file."""

    _name: ClassVar[str] = ""

    def _fail(self, key: str, why: str) -> None:
        raise ValueError(f"{self._name}.{key}: {why}, got {getattr(self, key)!r}")

    def _positive(self, *keys: str) -> None:
        for key in keys:
            if not getattr(self, key) > 0:
                self._fail(key, "must be > 0")

    def _non_negative(self, *keys: str) -> None:
        for key in keys:
            if getattr(self, key) < 0:
                self._fail(key, "must be >= 0")
