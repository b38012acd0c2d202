"""Copy-on-write undo of one step's state changes (used for non-finite gradients:
hipress/torch/nonfinite.py): compressor states (:class:`hipress.sync.StateStore`), momentum
correction's velocities and COVAP's residuals log what they are about to change."""
from __future__ import annotations

from typing import Callable, Dict, Hashable, List, Optional, Sequence

import torch


class UndoLog:
    """Copy-on-write copies of tensors, per key, taken the first time a key is touched in a
    step: ``undo(restore)`` hands each back, ``commit()`` forgets them. The copies go into
    buffers kept from step to step (allocating fresh ones costs ~4x a copy). Disabled
    (every call a no-op) until ``enabled`` is set.

    Thread-safety: keys are touched from the training thread and engine threads; each key
    from one site per step, and commit/undo run when nothing is in flight."""

    __slots__ = ("enabled", "_saved", "_spare")

    def __init__(self):
        self.enabled = False
        self._saved: Dict[Hashable, object] = {}
        self._spare: Dict[Hashable, List[torch.Tensor]] = {}

    def touch(self, key: Hashable, tensors: Sequence[torch.Tensor]) -> None:
        """Copies ``tensors`` (about to change) unless ``key`` was touched this step."""
        if not self.enabled or key in self._saved:
            return
        spare = self._spare[key] = self._spare_like(key, tensors)
        for s, t in zip(spare, tensors):
            s.copy_(t)
        self._saved[key] = spare

    def replace(self, key: Hashable, tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """Where to write the new values of ``tensors``, for a caller that computes them out of
        place: ``tensors`` themselves (update them in place) unless a copy must be kept this step;
        then spare buffers, and ``tensors``, left as they were, are the copy (and, once committed,
        the spare buffers of the next step). That saves :meth:`touch`'s copy: the caller stores the
        buffers returned as its state."""
        if not self.enabled or key in self._saved:
            return list(tensors)
        spare = self._spare_like(key, tensors)
        self._saved[key] = self._spare[key] = list(tensors)
        return spare

    def _spare_like(self, key: Hashable, tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """The buffers kept for ``key`` if they match ``tensors`` in number, shapes and dtypes, else new ones."""
        spare = self._spare.get(key)
        if spare is None or len(spare) != len(tensors) or any(
                s.shape != t.shape or s.dtype != t.dtype for s, t in zip(spare, tensors)):
            spare = [torch.empty_like(t) for t in tensors]
        return spare

    def created(self, key: Hashable, info=None) -> None:
        """``key`` did not exist before this step (``info``: what ``undo`` needs to drop it)."""
        if self.enabled and key not in self._saved:
            self._saved[key] = _Created(info)

    def forget(self, keys) -> None:
        """Drops what is kept for ``keys`` (their states no longer exist: StateStore.discard)."""
        for k in keys:
            self._saved.pop(k, None)
            self._spare.pop(k, None)

    def nbytes(self) -> int:
        """Bytes held by the copies' buffers (kept from step to step)."""
        return sum(t.numel() * t.element_size() for ts in self._spare.values() for t in ts)

    def commit(self) -> None:
        self._saved.clear()

    def undo(self, restore: Callable[[Hashable, Optional[List[torch.Tensor]], object], None]) -> None:
        """restore(key, copies, None) for a touched key, restore(key, None, info) for a created one."""
        saved, self._saved = self._saved, {}
        for key, v in saved.items():
            if isinstance(v, _Created):
                restore(key, None, v.info)
            else:
                restore(key, v, None)


class _Created:
    __slots__ = ("info",)

    def __init__(self, info):
        self.info = info
