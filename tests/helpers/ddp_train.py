"""Train a tiny primal BERT with PrimalTrainer; run alone or under `accelerate launch` (see test_distributed.py).

With HF_PRIMAL_TEST_CPU_FSDP=1 (set by the FSDP test next to `accelerate launch --use_fsdp --fsdp_version 2`), the
one check that keeps accelerate from using FSDP on CPU processes is lifted: accelerate 1.x enables FSDP only for
accelerator device types and silently falls back to DDP (MULTI_CPU) on CPUs, while torch's FSDP2 itself shards
over gloo on CPU. Everything else (plugin from the launcher's flags, fully_shard wrapping, Trainer loop) is
accelerate's and transformers' own code.
"""

import json
import os
import sys

import torch
from datasets import Dataset
from transformers import BertConfig, BertForSequenceClassification, TrainingArguments

import hf_primal


def _allow_fsdp_on_cpu() -> None:
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    original = AcceleratorState.__init__

    def __init__(self, *args, fsdp_plugin=None, **kwargs):
        original(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.fsdp_plugin = fsdp_plugin
            self.distributed_type = PartialState._shared_state["distributed_type"] = DistributedType.FSDP

    AcceleratorState.__init__ = __init__


def main(out_dir: str, per_device_batch: int, eta: float, find_unused: str = "default") -> None:
    torch.manual_seed(0)
    config = BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                        vocab_size=120, max_position_embeddings=64, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0,
                        primal_attention={"layers": "all", "low_rank": 4, "rank_multi": 2, "eta": eta})
    model = BertForSequenceClassification(config)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 120, (32, 10), generator=g)
    mask = torch.ones(32, 10, dtype=torch.long)
    for i in range(32):
        mask[i, 10 - (i % 4):] = 0
    data = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": mask.tolist(),
                              "labels": (ids[:, 0] > 60).long().tolist()})
    args = TrainingArguments(output_dir=out_dir, per_device_train_batch_size=per_device_batch, max_steps=6,
                             learning_rate=1e-2, lr_scheduler_type="constant", logging_steps=1, report_to=[],
                             save_strategy="no", seed=0, data_seed=0, use_cpu=True, disable_tqdm=True,
                             ddp_backend="gloo" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None,
                             ddp_find_unused_parameters=None if find_unused == "default" else find_unused == "true")
    trainer = hf_primal.PrimalTrainer(model=model, args=args, train_dataset=data)
    trainer.train()
    # Every rank runs the final forward: FSDP gathers each layer's shards from all ranks.
    model = trainer.model
    model.eval()
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, labels=(ids[:, 0] > 60).long())
        final_ksvd = float(hf_primal.ksvd_loss(model))
    if trainer.is_world_process_zero():
        logs = [h for h in trainer.state.log_history if "ksvd_loss" in h]
        json.dump({"final_loss": float(out.loss), "final_ksvd": final_ksvd, "world": trainer.args.world_size,
                   "logs": logs, "distributed_type": str(trainer.accelerator.distributed_type),
                   "fsdp_version": getattr(getattr(trainer.accelerator.state, "fsdp_plugin", None), "fsdp_version",
                                           None),
                   "sharded": type(model).__name__.startswith("FSDP")}, open(f"{out_dir}/result.json", "w"))


if __name__ == "__main__":
    if os.environ.get("HF_PRIMAL_TEST_CPU_FSDP") == "1":
        _allow_fsdp_on_cpu()
    main(*sys.argv[1:2], int(sys.argv[2]), float(sys.argv[3]), *sys.argv[4:5])
