"""torch.compile: primal BERT and GPT-2 trace without graph breaks and match eager (values and gradients)."""

import pytest
import torch
import torch._dynamo as dynamo
import torch.nn.functional as F
from transformers import BertForSequenceClassification, GPT2LMHeadModel

from hf_primal import ksvd_loss
from tests.conftest import bert_config, gpt2_config


def _bert():
    return BertForSequenceClassification(bert_config(primal_attention={"layers": [-1], "low_rank": 4, "rank_multi": 2}))


def _gpt2():
    return GPT2LMHeadModel(gpt2_config(primal_attention={"layers": "all", "low_rank": 4}))


def _inputs(arch):
    ids = torch.randint(1, 120, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 6:] = 0 if arch == "bert" else 1
    if arch == "gpt2":
        mask[1, :3] = 0  # left padding, as batched generation has it
    return ids, mask


def _loss_fn(model, arch):
    def step(ids, mask):
        if arch == "bert":
            out = model(input_ids=ids, attention_mask=mask, labels=torch.tensor([0, 1]))
            task = out.loss
        else:
            # Our own LM loss: the stock `labels=` path of GPT-2 has a graph break of its own in transformers.
            out = model(input_ids=ids, attention_mask=mask, use_cache=False)
            task = F.cross_entropy(out.logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        return task + 0.1 * ksvd_loss(model), out.logits

    return step


@pytest.mark.parametrize("arch", ["bert", "gpt2"])
def test_training_step_has_no_graph_breaks_and_matches_eager(arch):
    model = (_bert if arch == "bert" else _gpt2)().train()
    ids, mask = _inputs(arch)
    step = _loss_fn(model, arch)

    explanation = dynamo.explain(step)(ids, mask)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1

    loss, logits = step(ids, mask)
    loss.backward()
    eager_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert any(".primal.We" in n for n in eager_grads)
    model.zero_grad(set_to_none=True)

    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    # aot_eager traces the hand-written backward too; fullgraph=True would raise on any break.
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    c_loss, c_logits = compiled(ids, mask)
    c_loss.backward()
    assert (c_loss - loss).abs().item() <= 1e-5
    assert (c_logits - logits).abs().max().item() <= 1e-5
    for name, grad in eager_grads.items():
        got = dict(model.named_parameters())[name].grad
        assert got is not None and (got - grad).abs().max().item() <= 1e-5, name

    counted = torch.compile(step, backend=counting_backend)
    with torch.no_grad():
        c_loss2, _ = counted(ids, mask)
    assert len(graphs) == 1 and (c_loss2 - loss).abs().item() <= 1e-5
