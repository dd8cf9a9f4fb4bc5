"""Distillation from the original model: convert(method="distill"), the loss terms, and PrimalTrainer(teacher=...)."""

import copy
import math
import os

import pytest
import torch
import torch.nn.functional as F
from transformers import BertForSequenceClassification, BertModel

from hf_primal import PrimalAttentionConfig, PrimalTrainer, convert, primal_layers
from hf_primal.training.distill import distill, frozen_copy
from hf_primal.training.teacher_loss import hidden_state_loss, logits_kl_loss, masked_mean_pool
from hf_primal.training.trainer import PRIMAL_LR_MULTIPLIER
from tests.conftest import bert_config
from tests.test_loss_trainer import _args, _cls_dataset, _first_step_grads


def _text_batches(n, seed, batch=8, length=14):
    # Token sequences with structure the teacher turns into context-dependent states: a tiny random BERT is a fine
    # teacher for checking that the student learns to imitate it.
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(1, 120, (batch, length), generator=g)
        mask = torch.ones(batch, length, dtype=torch.long)
        cut = torch.randint(6, length + 1, (batch,), generator=g)
        mask[torch.arange(length)[None] >= cut[:, None]] = 0
        out.append({"input_ids": ids, "attention_mask": mask})
    return out


@torch.no_grad()
def _gap(student, teacher, batches):
    """Mean token-level relative error and mean pooled cosine, student vs teacher, over `batches`."""
    student.eval()
    errs, cos = [], []
    for b in batches:
        s, t = student(**b).last_hidden_state, teacher(**b).last_hidden_state
        errs.append(float(hidden_state_loss(s, t, b["attention_mask"], pooled_weight=0.0)))
        mask = b["attention_mask"]
        cos.append(F.cosine_similarity(masked_mean_pool(s, mask), masked_mean_pool(t, mask)).mean())
    return sum(errs) / len(errs), float(torch.stack(cos).mean())


def test_loss_terms_against_direct_formulas():
    torch.manual_seed(0)
    s, t = torch.randn(3, 5, 8), torch.randn(3, 5, 8)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 1, 1, 1, 0]])
    rows = [(b, n) for b in range(3) for n in range(5) if mask[b, n]]
    token = sum(float(((s[b, n] - t[b, n]) ** 2).sum() / (t[b, n] ** 2).sum()) for b, n in rows) / len(rows)
    pooled = [F.cosine_similarity(s[b][mask[b].bool()].mean(0), t[b][mask[b].bool()].mean(0), dim=0) for b in range(3)]
    expected = token + 0.5 * sum(1 - float(c) for c in pooled) / 3
    assert float(hidden_state_loss(s, t, mask, pooled_weight=0.5)) == pytest.approx(expected, rel=1e-5)
    assert float(hidden_state_loss(t, t, mask)) == pytest.approx(0.0, abs=1e-6)

    ls, lt = torch.randn(4, 3), torch.randn(4, 3)
    p, q = torch.softmax(lt / 2, -1), torch.softmax(ls / 2, -1)
    expected_kl = float((p * (p.log() - q.log())).sum(-1).mean()) * 4
    assert float(logits_kl_loss(ls, lt, 2.0)) == pytest.approx(expected_kl, rel=1e-5)


def test_distillation_lowers_error_on_unseen_data():
    torch.manual_seed(0)
    teacher = BertModel(bert_config(num_hidden_layers=3)).eval()
    student = convert(copy.deepcopy(teacher), {"layers": [-1], "low_rank": 4, "rank_multi": 2}, progress=False)
    unseen = _text_batches(6, seed=99)  # neither trained on nor used to choose the kept step
    err_before, cos_before = _gap(student, teacher, unseen)
    result = distill(student, frozen_copy(teacher), _text_batches(20, seed=1), steps=150, learning_rate=1e-3,
                     primal_learning_rate=1e-2, progress=False)
    err_after, cos_after = _gap(student, teacher, unseen)
    assert err_after <= 0.5 * err_before, (err_before, err_after)  # stated margin: the error at least halves
    assert cos_after > cos_before
    assert result.loss_after < result.loss_before and 0 < result.best_step <= 150
    assert result.curve[0]["step"] == 0 and result.curve[-1]["step"] == 150
    assert all(not p.requires_grad for p in frozen_copy(teacher).parameters())


def test_convert_distill_report_and_teacher_left_untouched():
    torch.manual_seed(0)
    # initializer_range 0.2: with the default 0.02 a tiny random BERT's last attention layer barely changes its
    # output, and convert's default loss (embedding term weighted 10x) would have almost nothing to recover.
    model = BertModel(bert_config(num_hidden_layers=3, initializer_range=0.2))
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    teacher_ref = copy.deepcopy(model).eval()
    unseen = _text_batches(4, seed=77)
    convert(model, {"layers": [-1], "low_rank": 4, "rank_multi": 2}, calibration_data=_text_batches(15, seed=3),
            method="distill", steps=80, learning_rate=1e-3, primal_learning_rate=1e-2, progress=False)
    report = model.primal_conversion_report
    assert report["method"] == "distill" and report["verdict"].startswith("distillation lowered")
    d = report["distillation"]
    assert d["loss_after"] < d["loss_before"] and d["cosine_after"] > d["cosine_before"]
    assert len(primal_layers(model)) == 1 and model.config.model_type == "primal_bert"
    # The teacher was a copy: the reference model with the original weights still matches `original`.
    assert all(torch.equal(teacher_ref.state_dict()[n], v) for n, v in original.items())
    err, _ = _gap(model, teacher_ref, unseen)
    plain = convert(copy.deepcopy(teacher_ref), {"layers": [-1], "low_rank": 4, "rank_multi": 2}, progress=False)
    err_plain, _ = _gap(plain, teacher_ref, unseen)
    assert err < 0.7 * err_plain, (err_plain, err)


def test_no_meaningful_improvement_is_reported():
    torch.manual_seed(0)
    model = BertModel(bert_config(num_hidden_layers=2))
    with pytest.warns(UserWarning, match="no meaningful improvement"):
        convert(model, {"layers": [-1], "low_rank": 4, "rank_multi": 2}, calibration_data=_text_batches(5, seed=3),
                method="distill", steps=2, learning_rate=1e-9, primal_learning_rate=1e-9, progress=False)
    assert model.primal_conversion_report["verdict"].startswith("no meaningful improvement")
    assert "more steps" in model.primal_conversion_report["verdict"]


def test_convert_distill_bad_inputs():
    model = BertModel(bert_config())
    with pytest.raises(ValueError, match="method='magic'"):
        convert(model, {"layers": [-1]}, calibration_data=_text_batches(3, 0), method="magic", progress=False)
    with pytest.raises(ValueError, match="at least 2"):
        convert(BertModel(bert_config()), {"layers": [-1], "low_rank": 4}, calibration_data=_text_batches(1, 0),
                method="distill", progress=False)
    student = convert(BertModel(bert_config()), {"layers": [-1], "low_rank": 4}, progress=False)
    for kw, match in (({"temperature": -1.0}, "temperature=-1.0"), ({"learning_rate": 0.0}, "learning_rate=0.0"),
                      ({"pooled_weight": -0.5}, "pooled_weight=-0.5"), ({"target": "attention"}, "target='attention'")):
        with pytest.raises(ValueError, match=match):
            distill(student, BertModel(bert_config()), _text_batches(3, 0), steps=1, progress=False, **kw)
    with pytest.raises(ValueError, match="hidden_size=48"):
        distill(student, BertModel(bert_config(hidden_size=48)), _text_batches(3, 0), steps=1, progress=False)
    with pytest.raises(ValueError, match="vocab_size=200"):
        distill(student, BertModel(bert_config(vocab_size=200)), _text_batches(3, 0), steps=1, progress=False)


# ------------------------------------------------------------------ PrimalTrainer(teacher=...)
def _primal_cls(**kw):
    return BertForSequenceClassification(
        bert_config(primal_attention={"layers": "all", "low_rank": 4, "eta": 0.5}, **kw)
    )


def _teacher_cls():
    torch.manual_seed(123)
    return BertForSequenceClassification(bert_config()).eval()


def test_trainer_logs_distill_loss_and_keeps_teacher_out_of_checkpoints(tmp_path):
    torch.manual_seed(0)
    teacher = _teacher_cls()
    before = {n: p.detach().clone() for n, p in teacher.named_parameters()}
    trainer = PrimalTrainer(model=_primal_cls(), args=_args(tmp_path, per_device_train_batch_size=4, max_steps=4,
                                                            logging_steps=2, save_strategy="steps", save_steps=4),
                            train_dataset=_cls_dataset(n=16), teacher=teacher, distill_weight=0.7,
                            distill_temperature=3.0)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "distill_loss" in h]
    assert len(logs) == 2 and all(h["distill_loss"] > 0 and math.isfinite(h["distill_loss"]) for h in logs)
    for h in logs:  # loss = task + eta * ksvd + weight * distill
        assert h["loss"] == pytest.approx(h["task_loss"] + 0.5 * h["ksvd_loss"] + 0.7 * h["distill_loss"], rel=1e-3)
    assert all(p.grad is None for p in teacher.parameters())
    assert all(torch.equal(p, before[n]) for n, p in teacher.named_parameters())
    checkpoint = tmp_path / "checkpoint-4"
    from safetensors.torch import load_file

    saved = load_file(str(checkpoint / "model.safetensors"))
    assert set(saved) == set(trainer.model.state_dict())  # the student's tensors, nothing of the teacher
    assert not any("teacher" in name for name in os.listdir(checkpoint))


def test_a_student_copied_from_a_teacher_after_distilling_from_it_still_trains_its_whole_network(tmp_path):
    # The usual conversion loop: student = deepcopy(teacher) + primal layers, distil, repeat with other settings.
    # The teacher must come out of each run as it went in, or every later copy trains only its new primal weights.
    from hf_primal.tools.selection import swap_to_primal

    teacher = _teacher_cls()
    frozen_by_caller = teacher.bert.embeddings.word_embeddings.weight
    frozen_by_caller.requires_grad_(False)  # the caller's own choice stays as it is too
    spec = PrimalAttentionConfig(layers=[-1], low_rank=4, rank_multi=2)
    for run in range(2):
        student = copy.deepcopy(teacher)
        swap_to_primal(student, spec)
        before = {n: p.detach().clone() for n, p in student.named_parameters()}
        PrimalTrainer(model=student.train(), args=_args(tmp_path / str(run), per_device_train_batch_size=4,
                                                        max_steps=2),
                      train_dataset=_cls_dataset(n=8), teacher=teacher).train()
        moved = {n for n, p in student.named_parameters() if not torch.equal(p, before[n])}
        assert "classifier.weight" in moved and "bert.encoder.layer.0.attention.self.query.weight" in moved, run
        assert "bert.embeddings.word_embeddings.weight" not in moved
    distill(copy.deepcopy(student), teacher, _text_batches(3, seed=1), steps=2, progress=False)
    frozen = [n for n, p in teacher.named_parameters() if not p.requires_grad]
    assert frozen == ["bert.embeddings.word_embeddings.weight"]


def test_trainer_distill_gradient_accumulation_matches_full_batch(tmp_path):
    data = _cls_dataset()

    def grads(sub, bs, ga):
        torch.manual_seed(0)
        model = _primal_cls()
        from tests.test_loss_trainer import _GradCapture

        capture = _GradCapture()
        trainer = PrimalTrainer(model=model, args=_args(tmp_path / sub, per_device_train_batch_size=bs,
                                                        gradient_accumulation_steps=ga, max_steps=1),
                                train_dataset=data, callbacks=[capture], teacher=_teacher_cls(), distill_weight=2.0)
        trainer.train()
        return capture.grads

    full, accumulated = grads("a", 8, 1), grads("b", 4, 2)
    without = _first_step_grads(tmp_path / "c", _primal_cls, data, bs=8, ga=1, **{})
    assert full.keys() == accumulated.keys()
    for name in full:
        assert torch.allclose(full[name], accumulated[name], atol=1e-5, rtol=1e-4), name
    # The KD term really contributes: the classifier's gradient differs from training without a teacher.
    head = "classifier.weight"
    assert not torch.allclose(full[head], without[head], atol=1e-4)


def test_trainer_hidden_state_distillation_for_base_models(tmp_path):
    torch.manual_seed(0)
    student = BertModel(bert_config(primal_attention={"layers": [-1], "low_rank": 4}))
    teacher = BertModel(bert_config()).eval()
    trainer = PrimalTrainer(model=student, args=_args(tmp_path), teacher=teacher)
    assert trainer.distill_target == "hidden"
    batch = _text_batches(1, 5)[0]
    out = student(**batch)
    term = trainer._distill_term(student, batch, out)
    with torch.no_grad():
        expected = hidden_state_loss(out.last_hidden_state, teacher(**batch).last_hidden_state, batch["attention_mask"])
    assert float(term) == pytest.approx(float(expected), rel=1e-6)


def test_trainer_distill_bad_inputs(tmp_path):
    args = _args(tmp_path)
    for kw, match in (
        ({"teacher": _teacher_cls(), "distill_weight": -1.0}, "distill_weight=-1.0"),
        ({"teacher": _teacher_cls(), "distill_temperature": 0.0}, "distill_temperature=0.0"),
        ({"distill_weight": 1.0}, "needs a teacher"),
        ({"teacher": BertForSequenceClassification(bert_config(vocab_size=99))}, "vocab_size=99"),
        ({"primal_learning_rate": -1e-3}, "primal_learning_rate=-0.001"),
    ):
        with pytest.raises(ValueError, match=match):
            PrimalTrainer(model=_primal_cls(), args=args, **kw)
    base = BertModel(bert_config(primal_attention={"layers": [-1], "low_rank": 4}))
    with pytest.raises(ValueError, match="hidden_size=48"):
        PrimalTrainer(model=base, args=args, teacher=BertModel(bert_config(hidden_size=48)))


def test_primal_parameters_get_their_own_learning_rate(tmp_path):
    model = _primal_cls()
    default = PrimalTrainer(model=model, args=_args(tmp_path, learning_rate=2e-4))
    explicit = PrimalTrainer(model=_primal_cls(), args=_args(tmp_path, learning_rate=2e-4), primal_learning_rate=5e-3)
    for trainer, lr in ((default, PRIMAL_LR_MULTIPLIER * 2e-4), (explicit, 5e-3)):
        optimizer = trainer.create_optimizer()
        names = {id(p): n for n, p in trainer.model.named_parameters()}
        primal = {n for n in names.values() if ".primal." in n}
        groups = [({names[id(p)] for p in g["params"]}, g["lr"], g["weight_decay"]) for g in optimizer.param_groups]
        assert [g for g in groups if g[0] == primal] == [(primal, lr, 0.0)]  # one group, exactly the primal tensors
        assert all(g_lr == 2e-4 for names_, g_lr, _ in groups if names_ != primal)
        assert set().union(*(g[0] for g in groups)) == set(names.values())


def test_trainer_distill_dataset_adds_the_unlabeled_batch_terms(tmp_path):
    """One step with distill_dataset: the gradient of task + eta*KSVD + w*KD on the labelled batch plus w*KD +
    eta*KSVD on one unlabeled batch, computed here by hand."""
    from hf_primal import ksvd_loss
    from tests.test_loss_trainer import _GradCapture

    labelled, unlabeled = _cls_dataset(n=8, seed=0), _cls_dataset(n=8, seed=9).remove_columns(["labels"])
    weight, temperature = 0.7, 2.0
    torch.manual_seed(0)
    model = _primal_cls()
    reference = copy.deepcopy(model)
    teacher = _teacher_cls()
    capture = _GradCapture()
    args = _args(tmp_path, per_device_train_batch_size=8, max_steps=1, logging_steps=1)
    trainer = PrimalTrainer(model=model, args=args,
                            train_dataset=labelled, callbacks=[capture], teacher=teacher, distill_weight=weight,
                            distill_temperature=temperature, distill_target="logits", distill_dataset=unlabeled)
    trainer.train()

    def kd(student_logits, teacher_logits):
        p = F.softmax(teacher_logits / temperature, -1)
        return (p * (p.log() - F.log_softmax(student_logits / temperature, -1))).sum(-1).mean() * temperature ** 2

    reference.train()
    total = 0.0
    for data, labels in ((labelled, True), (unlabeled, False)):
        inputs = {k: torch.tensor(data[k]) for k in ("input_ids", "attention_mask")}
        out = reference(**inputs, **({"labels": torch.tensor(data["labels"])} if labels else {}))
        with torch.no_grad():
            target = teacher(**inputs).logits
        total = total + (out.loss if labels else 0.0) + 0.5 * ksvd_loss(reference) + weight * kd(out.logits, target)
    total.backward()
    expected = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    assert expected.keys() == capture.grads.keys()
    for name, grad in expected.items():
        torch.testing.assert_close(capture.grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    logged = [h for h in trainer.state.log_history if "distill_loss" in h]
    assert logged and logged[0]["distill_loss"] > 0


def test_trainer_distill_dataset_needs_a_teacher_and_model_inputs(tmp_path):
    with pytest.raises(ValueError, match="distill_dataset=... needs a teacher"):
        PrimalTrainer(model=_primal_cls(), args=_args(tmp_path), distill_dataset=_cls_dataset())
    from datasets import Dataset

    trainer = PrimalTrainer(model=_primal_cls(), args=_args(tmp_path, max_steps=1, per_device_train_batch_size=4),
                            train_dataset=_cls_dataset(), teacher=_teacher_cls(),
                            distill_dataset=Dataset.from_dict({"text": ["a", "b"]}))
    with pytest.raises(ValueError, match=r"distill_dataset has columns \['text'\]"):
        trainer.train()


def test_convert_reports_heldout_neighbour_overlap_equal_to_a_brute_force_count():
    from tests.test_embedding_metrics import _brute_overlap

    torch.manual_seed(0)
    model = BertModel(bert_config(num_hidden_layers=3, initializer_range=0.2))
    original = copy.deepcopy(model).eval()
    batches = _text_batches(15, seed=3)
    convert(model, {"layers": [-1], "low_rank": 4, "rank_multi": 2}, calibration_data=batches, method="distill",
            steps=20, learning_rate=1e-3, progress=False)
    overlap = model.primal_conversion_report["distillation"]["neighbour_overlap"]
    held = [batches[i] for i in (4, 9, 14)]  # every fifth batch, counting from the last

    def pooled(m):
        m.eval()
        with torch.no_grad():
            rows = []
            for b in held:
                h = m(**b).last_hidden_state
                for i in range(h.shape[0]):
                    valid = b["attention_mask"][i].bool()
                    rows.append(h[i][valid].mean(0).tolist())
        return rows

    student, teacher = pooled(model), pooled(original)
    half = len(student) // 2
    assert overlap["k"] == 10 and overlap["index"] == half == 12 and overlap["queries"] == 12
    expected = _brute_overlap(teacher[:half], teacher[half:], student[:half], student[half:], 10)
    assert overlap["overlap"] == pytest.approx(expected, abs=1e-6)
    assert 0 < expected < 1
