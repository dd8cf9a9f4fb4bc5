"""Train a tiny primal BERT with PrimalTrainer; run alone or under `accelerate launch` (see test_distributed.py)."""

import json
import os
import sys

import torch
from datasets import Dataset
from transformers import BertConfig, BertForSequenceClassification, TrainingArguments

import hf_primal


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
    if trainer.is_world_process_zero():
        model.eval()
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask, labels=(ids[:, 0] > 60).long())
            final_ksvd = float(hf_primal.ksvd_loss(model))
        logs = [h for h in trainer.state.log_history if "ksvd_loss" in h]
        json.dump({"final_loss": float(out.loss), "final_ksvd": final_ksvd, "world": trainer.args.world_size,
                   "logs": logs}, open(f"{out_dir}/result.json", "w"))


if __name__ == "__main__":
    main(*sys.argv[1:2], int(sys.argv[2]), float(sys.argv[3]), *sys.argv[4:5])
