"""PrimalTrainer's held-out closeness to its teacher (`teacher_agreement`): the evaluation metrics equal a brute-force
count over the evaluation set, they work on unlabeled inputs, and as `metric_for_best_model` with
`load_best_model_at_end` and `EarlyStoppingCallback` they stop training, restore the best step and record it in the
conversion report and the model card."""

import math

import pytest
import torch
import torch.nn.functional as F
from transformers import EarlyStoppingCallback

from hf_primal import PrimalTrainer
from hf_primal.training.teacher_agreement import top1_agreement
from tests.test_distill import _primal_cls, _teacher_cls
from tests.test_loss_trainer import _args, _cls_dataset


def _unlabeled(n=12, length=10, seed=5):
    data = _cls_dataset(n=n, length=length, seed=seed)
    return data.remove_columns(["labels"])


def test_top1_agreement_counts_examples_or_real_tokens():
    student = torch.tensor([[0.1, 0.9], [0.8, 0.2], [0.3, 0.7]])
    teacher = torch.tensor([[0.0, 1.0], [0.1, 0.9], [0.2, 0.8]])
    assert top1_agreement(student, teacher, None) == (2.0, 3.0)
    tokens_s = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]]])
    tokens_t = torch.tensor([[[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]]])
    assert top1_agreement(tokens_s, tokens_t, torch.tensor([[1, 1, 0]])) == (1.0, 2.0)  # the padded token is ignored


@torch.no_grad()
def _brute_force(student, teacher, data, temperature):
    """Agreement over examples and the mean per-batch logits KL, one example batch of 4 at a time, by hand."""
    student.eval()
    agree, kls = 0, []
    for start in range(0, len(data), 4):
        rows = data[start:start + 4]
        ids, mask = torch.tensor(rows["input_ids"]), torch.tensor(rows["attention_mask"])
        s = student(input_ids=ids, attention_mask=mask).logits.double()
        t = teacher(input_ids=ids, attention_mask=mask).logits.double()
        agree += int((s.argmax(-1) == t.argmax(-1)).sum())
        p, log_q = F.softmax(t / temperature, -1), F.log_softmax(s / temperature, -1)
        kls.append(float((p * (p.log() - log_q)).sum(-1).mean()) * temperature**2)
    return agree / len(data), sum(kls) / len(kls)


def test_evaluation_reports_agreement_and_held_out_distillation_on_unlabeled_inputs(tmp_path):
    torch.manual_seed(0)
    teacher, data = _teacher_cls(), _unlabeled()
    trainer = PrimalTrainer(model=_primal_cls(), args=_args(tmp_path, per_device_eval_batch_size=4),
                            train_dataset=_cls_dataset(n=8), eval_dataset=data, teacher=teacher,
                            distill_target="logits", distill_temperature=2.0)
    metrics = trainer.evaluate()
    agreement, kl = _brute_force(trainer.model, teacher, data, 2.0)
    assert metrics["eval_teacher_agreement"] == pytest.approx(agreement)
    assert metrics["eval_distill_loss"] == pytest.approx(kl, rel=1e-3)  # fp32 sums of a small KL
    assert 0 < kl and math.isfinite(kl)
    # Without a teacher there is nothing to agree with: no such metrics.
    plain = PrimalTrainer(model=_primal_cls(), args=_args(tmp_path / "plain"), eval_dataset=_cls_dataset(n=4))
    assert not any("teacher" in k or "distill" in k for k in plain.evaluate())


def test_early_stopping_on_agreement_restores_the_best_step_and_records_it(tmp_path):
    torch.manual_seed(0)
    teacher = _teacher_cls()
    args = _args(tmp_path, per_device_train_batch_size=4, per_device_eval_batch_size=4, max_steps=40,
                 learning_rate=3e-2, eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=2,
                 load_best_model_at_end=True, metric_for_best_model="teacher_agreement", greater_is_better=True)
    # A high learning rate on random labels pulls the student away from its teacher: agreement peaks early.
    trainer = PrimalTrainer(model=_primal_cls(), args=args, train_dataset=_cls_dataset(n=32, seed=3),
                            eval_dataset=_unlabeled(), teacher=teacher, distill_weight=0.0, distill_target="logits",
                            callbacks=[EarlyStoppingCallback(early_stopping_patience=2)])
    trainer.train()
    state = trainer.state
    history = [(h["step"], h["eval_teacher_agreement"]) for h in state.log_history if "eval_teacher_agreement" in h]
    best_step, best = max(history, key=lambda item: (item[1], -item[0]))
    assert state.global_step < 40, "early stopping never stopped"
    assert state.best_global_step == best_step and state.best_metric == pytest.approx(best)
    # The model in hand is the best step's checkpoint, and its agreement is the best one.
    assert _brute_force(trainer.model, teacher, _unlabeled(), 2.0)[0] == pytest.approx(best)
    record = trainer.model.primal_conversion_report["training"]
    assert record == {"steps_run": state.global_step, "best_step": best_step, "metric": "teacher_agreement",
                      "best_value": pytest.approx(best)}
    trainer.model.save_pretrained(tmp_path / "kept")
    card = (tmp_path / "kept" / "README.md").read_text()
    assert f"kept step {best_step} of {state.global_step}" in card and "teacher_agreement" in card
