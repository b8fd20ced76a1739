"""Wrappers put on vLLM's instances (never its classes), and taken off again: what wraps.py's block-pool
wrappers and connector.py's KV connector wrappers both do.

An instance's own attributes are read here with `getattr`, never through `instance.__dict__`. CPython
(3.11, 3.12) keeps an instance's attributes as inline values beside the object, laid out by keys its
class shares, and specializes each attribute read of vLLM's code on that layout
(LOAD_ATTR_INSTANCE_VALUE). Asking for `__dict__` turns those values into a dict for good, and every
read of `self.coordinator`, `self.block_pool` and the like in vLLM's KV cache manager and block pool
then goes through a dict lookup: at 1,024 running with two KV-cache groups and drafts, 4 million
instructions a step more on the engine's thread, as many as the rest of the capture's work there
(callgrind, vllm-capture-cost's driver, vLLM 0.32). Setting and deleting an attribute keep the
inline values."""
from __future__ import annotations


class InstanceWraps:
    """The methods this capture replaced on vLLM's instances, each with what it replaced."""

    def __init__(self) -> None:
        self.put: list[tuple[object, str, object, object]] = []   # (owner, name, wrapper, what it replaced)

    def __call__(self, owner, name: str, wrapper) -> None:
        """Put `wrapper` on `owner` (an instance) as `name`."""
        self.put.append((owner, name, wrapper, own_attribute(owner, name)))
        setattr(owner, name, wrapper)

    def remove(self) -> None:
        """Take the wrappers off: each instance has what it had before them again (its class's method).
        One that something else has wrapped since stays under that."""
        for owner, name, wrapper, before in reversed(self.put):
            if own_attribute(owner, name) is not wrapper:
                continue
            if before is None:
                delattr(owner, name)
            else:
                setattr(owner, name, before)
        self.put = []


def own_attribute(owner, name: str):
    """What the instance `owner` holds as `name` of its own (another wrapper put on it), or None where
    `name` is its class's method, bound to it; read without `owner.__dict__` (see above)."""
    value = getattr(owner, name, None)
    if getattr(value, "__self__", None) is owner and getattr(value, "__func__", None) is getattr(type(owner), name, None):
        return None
    return value
