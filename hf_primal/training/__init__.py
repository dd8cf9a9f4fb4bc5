"""Training primal models: `loss` (ksvd_loss), `trainer` (PrimalTrainer: the KSVD term, teacher and unlabeled
distillation), `teacher_loss` (the student-teacher loss terms), `distill` (the distillation loop of conversion),
`lora` (PEFT targets), `calibration` (the batches conversion and distillation read, and the held-out rule)."""
