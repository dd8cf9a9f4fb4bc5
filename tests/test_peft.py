"""LoRA on a primal model: trains with PrimalTrainer, adapter round trip is exact, merging keeps the outputs."""

import pytest
import torch
from datasets import Dataset
from peft import PeftModel, get_peft_model
from transformers import BertForSequenceClassification, GPT2LMHeadModel, TrainingArguments

import hf_primal
from tests.conftest import bert_config, gpt2_config

CASES = {
    "bert": (
        lambda: BertForSequenceClassification(bert_config(primal_attention={"layers": [-1], "low_rank": 4})), "SEQ_CLS"
    ),
    "gpt2": (lambda: GPT2LMHeadModel(gpt2_config(primal_attention={"layers": "all", "low_rank": 4})), "CAUSAL_LM"),
    # KEP-SVGP: the posterior's variational parameters train and save with the adapter like the primal ones.
    "bert-kep": (lambda: BertForSequenceClassification(bert_config(primal_attention={
        "layers": [-1], "low_rank": 4, "variant": "kep_svgp", "eta_kl": 1e-3})), "SEQ_CLS"),
}
CORE = {"bert": {"We", "Wr", "Lambda", "weight", "bias"}, "gpt2": {"We", "Wr", "Lambda", "weight", "bias"},
        "bert-kep": {"We", "Wr", "theta", "m_u", "tril", "log_diag", "weight", "bias"}}


def _data(arch):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 120, (16, 8), generator=g)
    labels = (ids[:, 0] > 60).long() if arch.startswith("bert") else ids
    return Dataset.from_dict({"input_ids": ids.tolist(), "labels": labels.tolist()}), ids


@pytest.mark.parametrize("arch", ["bert", "gpt2", "bert-kep"])
def test_lora_train_save_load_merge(tmp_path, arch):
    make, task = CASES[arch]
    torch.manual_seed(0)
    base = make()
    base.save_pretrained(tmp_path / "base")
    model = get_peft_model(base, hf_primal.lora_config(base, task_type=task))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert any("lora_A" in n for n in trainable)
    assert {n.rsplit(".", 1)[-1] for n in trainable if ".primal." in n} >= CORE[arch]
    assert not any(".query.base_layer" in n or ".c_attn.base_layer" in n for n in trainable)

    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    data, ids = _data(arch)
    args = TrainingArguments(str(tmp_path / "run"), per_device_train_batch_size=8, max_steps=4, learning_rate=5e-2,
                             logging_steps=1, report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True)
    trainer = hf_primal.PrimalTrainer(model=model, args=args, train_dataset=data)
    trainer.train()
    assert any("ksvd_loss" in h for h in trainer.state.log_history)
    assert any("kl_loss" in h for h in trainer.state.log_history) == (arch == "bert-kep")
    changed = {n for n, p in model.named_parameters() if p.requires_grad and not torch.equal(before[n], p)}
    assert any("lora_B" in n for n in changed) and any(n.endswith("primal.modules_to_save.default.We") for n in changed)

    model.eval()
    with torch.no_grad():
        adapter_logits = model(input_ids=ids).logits
    model.save_pretrained(tmp_path / "adapter")

    fresh = type(base).from_pretrained(tmp_path / "base")
    reloaded = PeftModel.from_pretrained(fresh, tmp_path / "adapter").eval()
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=ids).logits, adapter_logits)

    merged = reloaded.merge_and_unload().eval()
    assert len(hf_primal.primal_layers(merged)) == len(hf_primal.primal_layers(base))
    with torch.no_grad():
        merged_logits = merged(input_ids=ids).logits
    assert (merged_logits - adapter_logits).abs().max() <= 1e-5
    merged.save_pretrained(tmp_path / "merged")
    again = type(base).from_pretrained(tmp_path / "merged").eval()
    with torch.no_grad():
        assert (again(input_ids=ids).logits - adapter_logits).abs().max() <= 1e-5


def test_lora_config_refuses_model_without_primal_layers():
    with pytest.raises(ValueError, match="no primal attention layer"):
        hf_primal.lora_config(BertForSequenceClassification(bert_config()))
