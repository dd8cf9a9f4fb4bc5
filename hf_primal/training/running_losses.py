"""`LossSums`: the per-process running sums behind the terms `PrimalTrainer` logs (``ksvd_loss``, ``task_loss``,
``distill_loss``, ``kl_loss``) between two logging steps, and their checkpointed form (resume.py)."""

from __future__ import annotations

from typing import Any

import torch

TERMS = ("ksvd", "task", "distill", "kl")


def _accumulate(total: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """`total` + `value`, kept on the loss's device: copying to the host every micro-batch would stall an
    accelerator once per step. Float64 where the device has it (MPS has none)."""
    wide = torch.float32 if value.device.type == "mps" else torch.float64
    return total.to(value.device, wide) + value.detach().to(wide)


class LossSums:
    """Sums of each logged term over the micro-batches since the last log, on this process."""

    def __init__(self) -> None:
        self.sums = {name: torch.zeros((), dtype=torch.float64) for name in TERMS}
        self.micro_batches = 0

    def add(self, name: str, value: torch.Tensor) -> None:
        self.sums[name] = _accumulate(self.sums[name], value)

    def means(self, accumulation_steps: int, device: Any) -> torch.Tensor:
        """(4,) fp32 on `device`: each term per micro-batch, the task loss per optimizer step (Trainer's "loss")."""
        counts = {name: self.micro_batches for name in TERMS}
        counts["task"] = self.micro_batches / accumulation_steps
        return torch.stack([(self.sums[name] / counts[name]).to(device, torch.float32) for name in TERMS])

    def reset(self) -> None:
        for total in self.sums.values():
            total.zero_()
        self.micro_batches = 0

    def state_dict(self) -> dict[str, float]:
        return {"micro_batches": self.micro_batches, **{f"{name}_sum": float(self.sums[name]) for name in TERMS}}

    def load_state_dict(self, data: dict[str, Any]) -> None:
        self.micro_batches = int(data["micro_batches"])
        for name in TERMS:
            # Checkpoints of hf_primal 0.1 name the sums "_ksvd_sum" etc. and have no KL.
            value = data.get(f"{name}_sum", data.get(f"_{name}_sum", 0.0))
            self.sums[name] = torch.tensor(float(value), dtype=torch.float64)
