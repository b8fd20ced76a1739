"""Wrappers put on vLLM's instances (never its classes), and taken off again: what wraps.py's block-pool
wrappers and connector.py's KV connector wrappers both do."""
from __future__ import annotations


class InstanceWraps:
    """The methods this capture replaced on vLLM's instances, each with what it replaced."""

    def __init__(self) -> None:
        self.put: list[tuple[object, str, object, object]] = []   # (owner, name, wrapper, what it replaced)

    def __call__(self, owner, name: str, wrapper) -> None:
        """Put `wrapper` on `owner` (an instance) as `name`."""
        self.put.append((owner, name, wrapper, owner.__dict__.get(name)))
        setattr(owner, name, wrapper)

    def remove(self) -> None:
        """Take the wrappers off: each instance has what it had before them again (its class's method).
        One that something else has wrapped since stays under that."""
        for owner, name, wrapper, before in reversed(self.put):
            if owner.__dict__.get(name) is not wrapper:
                continue
            if before is None:
                delattr(owner, name)
            else:
                setattr(owner, name, before)
        self.put = []
