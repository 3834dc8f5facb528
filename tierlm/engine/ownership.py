"""Makes sure two engines never drive the same model object."""

from __future__ import annotations

import threading

_owners: dict[int, str] = {}
_lock = threading.Lock()


class ModelAlreadyOwned(RuntimeError):
    pass


def claim(model: object, owner: str) -> None:
    with _lock:
        holder = _owners.get(id(model))
        if holder is not None and holder != owner:
            raise ModelAlreadyOwned(f"model is already driven by engine {holder!r}")
        _owners[id(model)] = owner


def release(model: object, owner: str) -> None:
    with _lock:
        if _owners.get(id(model)) == owner:
            del _owners[id(model)]


def owner_of(model: object) -> str | None:
    with _lock:
        return _owners.get(id(model))
