"""One PrimalTrainer run for tests/test_resume.py: `python resume_child.py MODE PHASE OUT`.

PHASE "full" trains to the end; "killed" SIGKILLs its own process right after checkpoint-3 is written (no clean-up
of any kind runs); "resume" resumes from the last checkpoint in OUT and trains to the end. "full" and "resume" save
the final parameters and the logged losses to OUT/final.pt.

Under ``accelerate launch`` (mode "ddp": 2 gloo processes) every process kills itself once all of them have written
checkpoint-3 (the launcher then stops), and process zero writes final.pt.
"""

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from transformers import BertForSequenceClassification, TrainerCallback  # noqa: E402

from hf_primal import PrimalTrainer  # noqa: E402
from tests.conftest import bert_config  # noqa: E402
from tests.test_loss_trainer import _args, _cls_dataset  # noqa: E402

MODES = {  # teacher target (None: no teacher), gradient accumulation, epochs (None: max_steps=6), logging steps
    "plain": (None, 1, None, 1),
    "logits": ("logits", 1, None, 1),
    "hidden": ("hidden", 1, None, 1),
    "accumulation": ("logits", 2, None, 1),
    "epochs": ("logits", 1, 2, 1),
    # Logs every 2 steps, so step 3's losses are still summed per process when checkpoint-3 is written.
    "ddp": ("logits", 1, None, 2),
}


class KillAfterCheckpoint(TrainerCallback):
    def on_save(self, args, state, control, **kwargs):
        if state.global_step == 3:
            if torch.distributed.is_initialized():
                torch.distributed.barrier()  # every process has written its part of the checkpoint
            os.kill(os.getpid(), signal.SIGKILL)


def main(mode: str, phase: str, out: str) -> None:
    target, accumulation, epochs, logging_steps = MODES[mode]
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    torch.manual_seed(0)
    model = BertForSequenceClassification(bert_config(primal_attention={"layers": [-1], "low_rank": 4, "eta": 0.5}))
    extra = {}
    if target is not None:
        torch.manual_seed(1)
        unlabeled = _cls_dataset(n=10, seed=5).remove_columns("labels")  # 3 batches a pass: several passes
        extra = dict(teacher=BertForSequenceClassification(bert_config()).eval(), distill_target=target,
                     distill_dataset=unlabeled)
    steps = dict(num_train_epochs=epochs) if epochs else dict(max_steps=6)
    args = _args(out, per_device_train_batch_size=2, gradient_accumulation_steps=accumulation, save_strategy="steps",
                 save_steps=3, logging_steps=logging_steps, ddp_backend="gloo" if distributed else None, **steps)
    trainer = PrimalTrainer(model=model, args=args, train_dataset=_cls_dataset(n=12), **extra)
    if phase == "killed":
        trainer.add_callback(KillAfterCheckpoint())
    trainer.train(resume_from_checkpoint=True if phase == "resume" else None)
    losses = [(h["step"], h["loss"], h.get("distill_loss"), h["ksvd_loss"], h["task_loss"])
              for h in trainer.state.log_history if "loss" in h]
    if trainer.args.process_index == 0:
        torch.save({"params": {k: v.detach().clone() for k, v in model.state_dict().items()}, "losses": losses,
                    "world_size": trainer.args.world_size}, os.path.join(out, "final.pt"))
    if distributed:
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
