"""Mid-run checkpoints of a benchmark's training run, so that a run killed between two epochs (a CPU session that
ends, a machine that is taken back) resumes where it stopped and finishes with the row it would have written
uninterrupted: the weights, the optimizer and schedule, the data order and every random generator are saved.

A checkpoint is named by its run and a digest of the run's settings, and records the settings themselves: runs that
differ in any setting never share a file, even side by side, and a file is resumed only by a run with the same
settings. It is replaced atomically, so a kill during a save leaves the previous checkpoint whole.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any, Optional

import torch

DIRECTORY = "checkpoints"


def path_for(out_dir: str | Path, run: str, settings: dict[str, Any]) -> Path:
    """Where the checkpoint of `run` (a name such as "primal-n2048-seed0") with `settings` lives under `out_dir`."""
    digest = hashlib.sha1(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:12]
    return Path(out_dir) / DIRECTORY / f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', run)}-{digest}.pt"


def save(path: Path, settings: dict[str, Any], state: dict[str, Any]) -> None:
    """Write `state` (tensors, state dicts, generator states, plain values) with the run's `settings`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    torch.save({"settings": settings, "state": state}, partial)
    os.replace(partial, path)


def load(path: Path, settings: dict[str, Any]) -> Optional[dict[str, Any]]:
    """The saved state of a run with exactly these `settings`, or None (no checkpoint, or another run's)."""
    if not path.exists():
        return None
    saved = torch.load(path, map_location="cpu", weights_only=False)
    if saved.get("settings") != settings:
        return None
    return saved["state"]


def remove(path: Path) -> None:
    """Delete a finished run's checkpoint (and the directory once it is empty)."""
    path.unlink(missing_ok=True)
    try:
        path.parent.rmdir()
    except OSError:
        pass
