"""Training primal models: `loss` (ksvd_loss), `trainer` (PrimalTrainer: the KSVD term, teacher and unlabeled
distillation), `distill` (student-teacher loss terms and the distillation loop of conversion), `lora` (PEFT
targets), `calibration` (the batches conversion and distillation read, and the held-out rule)."""
