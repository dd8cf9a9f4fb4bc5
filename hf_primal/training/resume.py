"""What `PrimalTrainer` adds to a Trainer checkpoint, so that a run resumed from it ends where the uninterrupted run
ends: how many batches of ``distill_dataset`` were drawn (its loader is reshuffled from ``args.seed`` each pass, so
drawing them again from the start replays the same order) and the running sums behind the logged KSVD, task and
distillation losses. Transformers saves and restores everything else (weights, optimizer, scheduler, RNG states,
the training data's position).

The running sums are per process (each process sums the losses of its own shard until the next log gathers them),
so under ``accelerate launch`` every process writes and reads its own file, as transformers does with
``rng_state_{i}.pth``.
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional, Union

from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

STATE_FILE = "primal_trainer_state.json"


def state_file(process_index: int, world_size: int) -> str:
    """`STATE_FILE` in a single process; ``primal_trainer_state_{i}.json`` for process i of several."""
    return STATE_FILE if world_size <= 1 else STATE_FILE.replace(".json", f"_{process_index}.json")


class PrimalStateCallback(TrainerCallback):
    """Writes this process's `state_file` into every checkpoint folder the trainer saves."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        filename = state_file(args.process_index, args.world_size)
        if os.path.isdir(folder):
            data = {"distill_batches": self.trainer._distill_consumed, **self.trainer._loss_sums.state_dict()}
            with open(os.path.join(folder, filename), "w", encoding="utf-8") as handle:
                json.dump(data, handle, indent=2)
        return control


def checkpoint_folder(resume_from_checkpoint: Union[str, bool, None], output_dir: str) -> Optional[str]:
    """The folder ``Trainer.train(resume_from_checkpoint=...)`` resumes from: the path given, the last checkpoint
    of `output_dir` for True, or None."""
    if resume_from_checkpoint is True:
        return get_last_checkpoint(output_dir)
    if isinstance(resume_from_checkpoint, (str, os.PathLike)):
        return str(resume_from_checkpoint)
    return None


def restore_state(trainer: Any, folder: Optional[str]) -> None:
    """Put back what `PrimalStateCallback` saved in `folder` for this process (nothing when the folder has no state
    file, e.g. a checkpoint written by a plain Trainer: the distillation batches then start from the beginning)."""
    filename = state_file(trainer.args.process_index, trainer.args.world_size)
    path = None if folder is None else os.path.join(folder, filename)
    if path is None or not os.path.isfile(path):
        return
    with open(path, encoding="utf-8") as handle:
        data = json.load(handle)
    trainer._distill_skip = int(data["distill_batches"])
    trainer._loss_sums.load_state_dict(data)
