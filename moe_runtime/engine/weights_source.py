"""Where the served weights came from, and whether a rebuild can read the same ones again.

A rebuilt worker group (after a dead or stalled rank) reads its weights again from their
source: model.path, or the last update_weights directory or state dict. A directory a trainer
has since overwritten (its next step saved to the same path) or pruned, or a state dict its
caller has since changed in place, would give other weights under the same weight_version:
other bits with nothing to tell them apart. So the source is stamped when it is read (each
file's size, modification time and inode; each tensor's in-place version counter) and a
rebuild whose source no longer matches its stamp is refused (WeightsChangedError).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

# The files a checkpoint load reads (moe_runtime/model/loader.py).
_READ_FILES = ("config.json", "*.safetensors")


class WeightsChangedError(RuntimeError):
    """The served weights' source changed since they were read: a rebuild cannot restore them."""


@dataclass(frozen=True)
class WeightsSource:
    """source: a checkpoint directory, an HF-named state dict (a copy of the mapping, the same
    tensors), or None (random weights from model.seed: nothing to change); stamp: how it stood
    when read."""

    source: str | dict[str, torch.Tensor] | None
    stamp: tuple

    @classmethod
    def of(cls, source: str | dict[str, torch.Tensor] | None) -> WeightsSource:
        """Stamp source now, before it is read."""
        if isinstance(source, dict):
            source = dict(source)  # entries the caller later replaces are not ours
        return cls(source, _stamp(source))

    def changed(self) -> str | None:
        """What differs from the stamp now (the first difference), or None."""
        try:
            now = _stamp(self.source)
        except OSError as exc:
            return f"{self.source!r} cannot be read: {exc}"
        for before, after in zip(self.stamp, now, strict=False):
            if before != after:
                return f"{before[0]!r} in {self._name()} changed since the weights were read"
        if len(now) != len(self.stamp):
            names = {entry[0] for entry in self.stamp} ^ {entry[0] for entry in now}
            return f"{sorted(names)[0]!r} in {self._name()} was added or removed since"
        return None

    def _name(self) -> str:
        return repr(self.source) if isinstance(self.source, str) else "the state dict"


def _stamp(source: str | dict[str, torch.Tensor] | None) -> tuple:
    if source is None:
        return ()
    if isinstance(source, dict):
        # A tensor's version counter moves with every in-place change (mul_, copy_, ...).
        return tuple((name, getattr(t, "_version", None)) for name, t in sorted(source.items()))
    directory = Path(source)
    if not directory.is_dir():
        raise FileNotFoundError(f"no directory {source!r}")
    files = sorted({f for pattern in _READ_FILES for f in directory.glob(pattern)})
    return tuple((f.name, *_file_stamp(f)) for f in files)


def _file_stamp(file: Path) -> tuple[int, int, int]:
    info = os.stat(file)
    return info.st_size, info.st_mtime_ns, info.st_ino
