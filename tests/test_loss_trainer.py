"""KSVD loss against the spec, and PrimalTrainer under accumulation, bf16, checkpointing and resuming."""

import math

import pytest
import torch
from datasets import Dataset
from transformers import (
    BertForSequenceClassification,
    BertModel,
    GPT2LMHeadModel,
    TrainerCallback,
    TrainingArguments,
)

from hf_primal import PrimalTrainer, ksvd_loss
from tests.conftest import bert_config, gpt2_config
from tests.reference import reference_causal, reference_gammas, reference_layer_J, reference_noncausal


def _split(t, heads):
    B, N, C = t.shape
    return t.view(B, N, heads, C // heads).transpose(1, 2)


def _capture_inputs(model, modules):
    store, handles = {}, []
    for i, m in enumerate(modules):
        handles.append(m.register_forward_hook(
            lambda mod, a, kw, out, i=i: store.__setitem__(i, a[0] if a else kw["hidden_states"]), with_kwargs=True
        ))
    return store, handles


def _expected_loss(per_layer, reduction):
    if reduction == "batch":
        return sum(j_batch ** 2 for _, j_batch in per_layer) / len(per_layer)
    n_seq = len(per_layer[0][0])
    per_seq = [sum(layer[0][b] ** 2 for layer in per_layer) / len(per_layer) for b in range(n_seq)]
    return sum(per_seq) / n_seq


@pytest.mark.parametrize("reduction", ["sequence", "batch"])
def test_ksvd_loss_matches_spec_encoder_with_padding(reduction):
    model = BertModel(bert_config(primal_attention={"layers": "all", "low_rank": 4, "rank_multi": 2})).eval()
    modules = [layer.attention.self for layer in model.encoder.layer]
    store, handles = _capture_inputs(model, modules)
    ids = torch.randint(1, 120, (3, 11))
    mask = torch.ones(3, 11, dtype=torch.long)
    mask[0, 7:] = 0
    mask[2, :4] = 0
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    for h in handles:
        h.remove()
    per_layer = []
    for i, m in enumerate(modules):
        x = store[i]
        core = m.primal
        _, e, r = reference_noncausal(x, _split(m.query(x), 4), _split(m.key(x), 4), mask.bool(), core.We, core.Wr,
                                      core.head_map.weight, core.head_map.bias, rule=core.sampling)
        per_layer.append(reference_layer_J(e, r, mask.bool(), core.Lambda, core.We, core.Wr))
    expected = _expected_loss(per_layer, reduction)
    got = float(ksvd_loss(model, reduction))
    assert abs(got - expected) <= 1e-6 * abs(expected)


@pytest.mark.parametrize("reduction", ["sequence", "batch"])
def test_ksvd_loss_matches_spec_causal_with_left_padding(reduction):
    model = GPT2LMHeadModel(gpt2_config(primal_attention={"layers": "all", "low_rank": 4})).eval()
    modules = [b.attn for b in model.transformer.h]
    store, handles = _capture_inputs(model, modules)
    ids = torch.randint(1, 120, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :3] = 0
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, use_cache=False)
    for h in handles:
        h.remove()
    per_layer = []
    for i, m in enumerate(modules):
        x = store[i]
        qkv = x @ m.c_attn.weight + m.c_attn.bias
        core = m.primal
        _, e, r = reference_causal(_split(qkv[..., :32], 4), _split(qkv[..., 32:64], 4), mask.bool(), core.We, core.Wr,
                                   core.head_map.weight, core.head_map.bias, gammas=reference_gammas(4))
        per_layer.append(reference_layer_J(e, r, mask.bool(), core.Lambda, core.We, core.Wr))
    expected = _expected_loss(per_layer, reduction)
    got = float(ksvd_loss(model, reduction))
    assert abs(got - expected) <= 1e-6 * abs(expected)


def test_ksvd_loss_does_not_depend_on_padding():
    model = BertModel(bert_config(primal_attention={"layers": "all", "low_rank": 4, "rank_multi": 2})).eval()
    ids = torch.randint(1, 120, (2, 8))
    with torch.no_grad():
        model(input_ids=ids)
        plain = [float(ksvd_loss(model, r)) for r in ("sequence", "batch")]
        padded = torch.cat([ids, torch.randint(1, 120, (2, 5))], dim=1)
        mask = torch.ones(2, 13, dtype=torch.long)
        mask[:, 8:] = 0
        model(input_ids=padded, attention_mask=mask)
        with_pad = [float(ksvd_loss(model, r)) for r in ("sequence", "batch")]
    assert plain == pytest.approx(with_pad, rel=1e-6)


def test_ksvd_loss_errors():
    with pytest.raises(ValueError, match="no primal attention layer"):
        ksvd_loss(BertModel(bert_config()))
    with pytest.raises(ValueError, match="no forward pass"):
        ksvd_loss(BertModel(bert_config(primal_attention={"layers": [-1], "low_rank": 3})))
    model = BertModel(bert_config(primal_attention={"layers": [-1], "low_rank": 3}))
    model(input_ids=torch.randint(1, 120, (1, 4)))
    with pytest.raises(ValueError, match="reduction='mean' is not allowed"):
        ksvd_loss(model, "mean")


def test_lambda_gets_gradient_only_through_ksvd():
    model = BertModel(bert_config(primal_attention={"layers": [-1], "low_rank": 3}))
    core = model.encoder.layer[1].attention.self.primal
    ids = torch.randint(1, 120, (2, 5))
    # A task loss alone: Lambda is in the graph (so distributed training sees it used) but gets exactly zero,
    # while the projections it would regularise do get a gradient.
    model(input_ids=ids).last_hidden_state.square().sum().backward()
    assert core.Lambda.grad is not None and torch.equal(core.Lambda.grad, torch.zeros_like(core.Lambda))
    assert core.We.grad.abs().sum() > 0
    model.zero_grad(set_to_none=True)
    model(input_ids=ids)
    ksvd_loss(model).backward()
    assert core.Lambda.grad is not None and core.Lambda.grad.abs().sum() > 0


# ------------------------------------------------------------------ trainer
def _cls_dataset(n=8, length=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 120, (n, length), generator=g)
    mask = torch.ones(n, length, dtype=torch.long)
    for i in range(n):
        mask[i, length - (i % 4):] = 0
    labels = (ids[:, 0] > 60).long()
    return Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": mask.tolist(), "labels": labels.tolist()})


def _lm_dataset(n=8, length=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 120, (n, length), generator=g)
    mask = torch.ones(n, length, dtype=torch.long)
    for i in range(n):
        mask[i, length - (i % 3):] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": mask.tolist(), "labels": labels.tolist()})


class _GradCapture(TrainerCallback):
    def __init__(self):
        self.grads = None
        self.checkpointing = None

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if self.grads is None:
            self.checkpointing = bool(
                getattr(model, "is_activation_checkpointing", False)
                or getattr(model, "is_gradient_checkpointing", False)
            )
            self.grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), report_to=[], use_cpu=True, save_strategy="no", max_grad_norm=0.0,
                learning_rate=1e-3, seed=0, data_seed=0, disable_tqdm=True, dataloader_num_workers=0)
    base.update(kw)
    return TrainingArguments(**base)


def _first_step_grads(tmp_path, make_model, dataset, bs, ga, **kw):
    torch.manual_seed(0)
    model = make_model()
    capture = _GradCapture()
    trainer = PrimalTrainer(model=model, args=_args(tmp_path, per_device_train_batch_size=bs,
                                                    gradient_accumulation_steps=ga, max_steps=1, **kw),
                            train_dataset=dataset, callbacks=[capture])
    trainer.train()
    capture.grads["__checkpointing__"] = torch.tensor(float(capture.checkpointing))
    return capture.grads


@pytest.mark.parametrize("head", ["seq_cls", "causal_lm"])
def test_gradient_accumulation_matches_full_batch(tmp_path, head):
    if head == "seq_cls":
        make = lambda: BertForSequenceClassification(
            bert_config(primal_attention={"layers": "all", "low_rank": 4, "eta": 0.5})
        )
        data = _cls_dataset()
    else:
        make = lambda: GPT2LMHeadModel(gpt2_config(primal_attention={"layers": "all", "low_rank": 4, "eta": 0.5}))
        data = _lm_dataset()
    full = _first_step_grads(tmp_path / "a", make, data, bs=8, ga=1)
    accumulated = _first_step_grads(tmp_path / "b", make, data, bs=4, ga=2)
    assert full.keys() == accumulated.keys()
    lam = [n for n in full if n.endswith("Lambda")]
    assert lam and all(full[n].abs().sum() > 0 for n in lam)  # the KSVD term is part of both
    for name in full:
        assert torch.allclose(full[name], accumulated[name], atol=1e-5, rtol=1e-4), name


def _train_tiny(tmp_path, eta, steps=60):
    torch.manual_seed(0)
    model = BertForSequenceClassification(bert_config(primal_attention={"layers": "all", "low_rank": 4, "eta": eta}))
    trainer = PrimalTrainer(model=model, args=_args(tmp_path, per_device_train_batch_size=8, max_steps=steps,
                                                    logging_steps=5, learning_rate=1e-2),
                            train_dataset=_cls_dataset(n=32))
    trainer.train()
    return [h for h in trainer.state.log_history if "ksvd_loss" in h]


def test_ksvd_loss_falls_tenfold_with_eta_and_not_without(tmp_path):
    with_eta = _train_tiny(tmp_path / "eta", 0.1)
    without = _train_tiny(tmp_path / "zero", 0.0)
    assert all("task_loss" in h and math.isfinite(h["task_loss"]) for h in with_eta)
    first_eta, last_eta = with_eta[0]["ksvd_loss"], with_eta[-1]["ksvd_loss"]
    first_0, last_0 = without[0]["ksvd_loss"], without[-1]["ksvd_loss"]
    assert first_eta / last_eta >= 10, (first_eta, last_eta)
    assert first_0 / last_0 < 10, (first_0, last_0)
    # loss = task + eta * ksvd at every logging step
    for h in with_eta:
        assert h["loss"] == pytest.approx(h["task_loss"] + 0.1 * h["ksvd_loss"], rel=1e-3, abs=1e-5)


def test_eval_reports_ksvd_loss(tmp_path):
    # The expected value is computed independently of hf_primal's loss code: the loop-by-loop reference of the
    # method (tests/reference.py) on the inputs the evaluation loop actually fed to the primal layer, batch by batch.
    model = BertForSequenceClassification(bert_config(primal_attention={"layers": [-1], "low_rank": 4}))
    module = model.bert.encoder.layer[-1].attention.self
    seen = []
    handle = module.register_forward_hook(
        lambda mod, a, kw, out: seen.append((a[0] if a else kw["hidden_states"]).detach().clone()), with_kwargs=True)
    trainer = PrimalTrainer(
        model=model, args=_args(tmp_path, per_device_eval_batch_size=4), eval_dataset=_cls_dataset()
    )
    metrics = trainer.evaluate()
    handle.remove()
    assert len(seen) == 2  # 8 rows, batches of 4
    masks = torch.tensor(_cls_dataset()["attention_mask"]).bool()
    core = module.primal
    expected = []
    for i, x in enumerate(seen):
        mask = masks[4 * i:4 * i + 4]
        with torch.no_grad():
            q, k = _split(module.query(x), 4), _split(module.key(x), 4)
        _, e, r = reference_noncausal(x, q, k, mask, core.We, core.Wr, core.head_map.weight, core.head_map.bias,
                                      rule=core.sampling)
        expected.append(_expected_loss([reference_layer_J(e, r, mask, core.Lambda, core.We, core.Wr)], "sequence"))
    assert expected[0] != pytest.approx(expected[1], rel=1e-3)  # the two batches differ: the mean is a real check
    assert metrics["eval_ksvd_loss"] == pytest.approx(sum(expected) / 2, rel=1e-5)


def test_bf16_autocast_gives_finite_losses(tmp_path):
    model = BertForSequenceClassification(bert_config(primal_attention={"layers": "all", "low_rank": 4}))
    trainer = PrimalTrainer(model=model, args=_args(tmp_path, per_device_train_batch_size=4, max_steps=3,
                                                    logging_steps=1, bf16=True), train_dataset=_cls_dataset())
    trainer.train()
    logs = [h for h in trainer.state.log_history if "ksvd_loss" in h]
    assert len(logs) == 3
    assert all(math.isfinite(h["loss"]) and math.isfinite(h["ksvd_loss"]) for h in logs)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(input_ids=torch.randint(1, 120, (2, 6)))
    assert ksvd_loss(model).dtype == torch.float32


def test_gradient_checkpointing_same_gradients(tmp_path):
    make = lambda: BertForSequenceClassification(
        bert_config(primal_attention={"layers": "all", "low_rank": 4, "eta": 0.5})
    )
    plain = _first_step_grads(tmp_path / "a", make, _cls_dataset(), bs=8, ga=1)
    ckpt = _first_step_grads(tmp_path / "b", make, _cls_dataset(), bs=8, ga=1, activation_checkpointing=True)
    assert plain.pop("__checkpointing__") == 0 and ckpt.pop("__checkpointing__") == 1
    assert plain.keys() == ckpt.keys()
    for name in plain:
        assert torch.allclose(plain[name], ckpt[name], atol=1e-5), name


def test_reentrant_checkpointing_is_refused(tmp_path):
    model = BertForSequenceClassification(bert_config(primal_attention={"layers": [-1], "low_rank": 4}))
    with pytest.raises(ValueError, match="use_reentrant"):
        PrimalTrainer(model=model, args=_args(tmp_path, activation_checkpointing=True,
                                              activation_checkpointing_kwargs={"use_reentrant": True}),
                      train_dataset=_cls_dataset())


def test_trainer_refuses_model_without_primal_layers(tmp_path):
    with pytest.raises(ValueError, match="needs a model with primal attention"):
        PrimalTrainer(model=BertForSequenceClassification(bert_config()), args=_args(tmp_path))


def test_resume_from_checkpoint_reproduces_final_parameters(tmp_path):
    def run(out, resume=None, max_steps=6):
        torch.manual_seed(0)
        model = BertForSequenceClassification(bert_config(primal_attention={"layers": "all", "low_rank": 4}))
        trainer = PrimalTrainer(model=model, args=_args(out, per_device_train_batch_size=4, max_steps=max_steps,
                                                        save_strategy="steps", save_steps=3, learning_rate=1e-2,
                                                        lr_scheduler_type="constant"),
                                train_dataset=_cls_dataset(n=16))
        trainer.train(resume_from_checkpoint=resume)
        return {n: p.detach().clone() for n, p in model.named_parameters()}

    straight = run(tmp_path / "straight")
    run(tmp_path / "interrupted", max_steps=3)  # writes checkpoint-3, then "crashes"
    resumed = run(tmp_path / "interrupted", resume=str(tmp_path / "interrupted" / "checkpoint-3"))
    for name in straight:
        assert torch.allclose(straight[name], resumed[name], atol=1e-6), name
