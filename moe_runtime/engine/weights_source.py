"""Where the served weights came from, and whether a rebuild can read the same ones again.

A rebuilt worker group (after a dead or stalled rank) reads its weights again from their
source: model.path, or the last update_weights directory or state dict. A directory a trainer
has since overwritten (its next step saved to the same path) or pruned, or a state dict its
caller has since changed in place, would give other weights under the same weight_version:
other bits with nothing to tell them apart. So the source is stamped when it is read (each
file's size, modification time and inode; each tensor's in-place version counter) and a
rebuild whose source no longer matches its stamp is refused (WeightsChangedError). What the
stamp cannot see: a file rewritten with the same size within one tick of the file system's
clock, and a tensor changed through .data, a numpy view or its storage, or an inference
tensor (no version counter).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from moe_runtime.model.loader import INDEX_FILE

# The files a checkpoint load reads (moe_runtime/model/loader.py).
_READ_FILES = ("config.json", INDEX_FILE, "*.safetensors")


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

    @classmethod
    def for_update(cls, source: str | Path | dict) -> WeightsSource:
        """An update_weights source checked and stamped, as the ranks will read it: a
        checkpoint directory's resolved path, or a state dict of HF names to tensors holding
        values; else ValueError naming the problem."""
        checked = _checked_update_source(source)
        try:
            return cls.of(checked)  # stamped before any rank reads it
        except OSError as exc:
            raise ValueError(f"update_weights: {checked!r} cannot be read: {exc}") from exc

    def changed(self) -> str | None:
        """What differs from the stamp now (the first file or tensor by name), or None."""
        try:
            now = dict(_stamp(self.source))
        except OSError as exc:
            return f"{self.source!r} cannot be read: {exc}"
        before = dict(self.stamp)
        for name in sorted(before.keys() | now.keys()):
            if name not in now:
                return f"{name!r} in {self.name()} was removed since the weights were read"
            if name not in before:
                return f"{name!r} in {self.name()} was added since the weights were read"
            if before[name] != now[name]:
                return f"{name!r} in {self.name()} changed since the weights were read"
        return None

    def missing(self) -> str | None:
        """Why the source cannot be read now (a directory gone, or without weights), or None."""
        if not isinstance(self.source, str):
            return None
        try:
            names = [name for name, _ in _stamp(self.source)]
        except OSError as exc:
            return f"{self.source!r} cannot be read: {exc}"
        if not any(name.endswith(".safetensors") for name in names):
            return f"{self.source!r} holds no *.safetensors files now"
        return None

    def name(self) -> str:
        """The source for a message: the directory (quoted), or "the state dict"."""
        return repr(self.source) if isinstance(self.source, str) else "the state dict"


def _stamp(source: str | dict[str, torch.Tensor] | None) -> tuple:
    if source is None:
        return ()
    if isinstance(source, dict):
        return tuple((name, _tensor_version(t)) for name, t in sorted(source.items()))
    directory = Path(source)
    if not directory.is_dir():
        raise FileNotFoundError(f"no directory {source!r}")
    files = sorted({f for pattern in _READ_FILES for f in directory.glob(pattern)})
    return tuple((f.name, _file_stamp(f)) for f in files)


def _tensor_version(tensor) -> int | None:
    """Its version counter, which moves with every in-place change through the tensor (mul_,
    copy_, ...; not through .data, a numpy view or its storage); None where it keeps none (an
    inference tensor, a value that is no tensor: the load refuses those)."""
    try:
        return tensor._version
    except (AttributeError, RuntimeError):
        return None


def _file_stamp(file: Path) -> tuple[int, int, int]:
    info = os.stat(file)
    return info.st_size, info.st_mtime_ns, info.st_ino


def _checked_update_source(source: str | Path | dict) -> str | dict[str, torch.Tensor]:
    """An update_weights source as the ranks read it: a checkpoint directory's resolved path,
    or a state dict of HF names to tensors holding values; else ValueError naming the problem."""
    if isinstance(source, (str, Path)):
        try:
            is_dir = Path(source).is_dir()
        except OSError as exc:  # a name too long
            raise ValueError(f"update_weights: {str(source)!r}: {exc}") from None
        if not is_dir:
            raise ValueError(f"update_weights: {str(source)!r} is not a checkpoint directory")
        # Resolved here: a rank on another node (or in another directory) would read a
        # relative path against its own working directory.
        return str(Path(source).resolve())
    if not isinstance(source, dict):
        raise ValueError(
            "update_weights: a checkpoint directory or an HF-named state dict, got "
            f"{type(source).__name__}"
        )
    for name, value in source.items():
        if not isinstance(name, str) or not isinstance(value, torch.Tensor):
            raise ValueError(
                "update_weights: a state dict maps HF weight names (str) to tensors, "
                f"got {name!r}: {type(value).__name__}"
            )
        if value.is_meta or value.layout != torch.strided:  # no values to copy: it
            raise ValueError(  # passed the checks and failed the copy, every rank's
                f"update_weights: tensor {name} holds no values to load "
                f"({'meta' if value.is_meta else value.layout} tensor)"
            )
    return source
