"""The hash index's slot layout, shared by every twin of its kernels (plain torch, C++, Triton)."""

from __future__ import annotations

__all__ = ["EMPTY_TAG", "NO_SLOT"]

NO_SLOT = -1  # a key's slot where it has none: absent from the index, or left out of a plan
EMPTY_TAG = 0  # the tag of an empty slot; a key whose hash's top byte is 0 gets tag 1
