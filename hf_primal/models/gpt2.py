"""GPT-2: causal primal attention with a constant-size generation cache; the fused ``c_attn`` keeps its value third."""

import torch
from transformers.models.gpt2 import modeling_gpt2
from transformers.pytorch_utils import Conv1D

from ..modeling.architecture import Layout
from ..modeling.layers import pop_cache, run_primal, split_heads
from ..modeling.shareable import define_architecture


class PrimalGPT2Attention(modeling_gpt2.GPT2Attention):
    """GPT-2 self-attention computed by causal Primal-Attention with a constant-size cache.

    The fused ``c_attn`` keeps its value third so that ordinary checkpoints and LoRA on ``c_attn`` load
    unchanged; the stock Conv1D path multiplies only the q/k two thirds.
    """

    _is_primal_attention = True

    def forward(self, hidden_states, cache=None, attention_mask=None, encoder_hidden_states=None,
                encoder_attention_mask=None, output_attentions=False, **kwargs):
        cache = pop_cache(cache, kwargs)
        if encoder_hidden_states is not None:
            raise ValueError("PrimalGPT2Attention is a self-attention layer; cross-attention stays canonical.")
        width = 2 * self.split_size
        if type(self.c_attn) is Conv1D:
            flat = hidden_states.reshape(-1, hidden_states.shape[-1])
            qk = torch.addmm(self.c_attn.bias[:width], flat, self.c_attn.weight[:, :width])
            qk = qk.view(*hidden_states.shape[:-1], width)
        else:  # wrapped (e.g. LoRA): call the module so the wrapper takes part
            qk = self.c_attn(hidden_states)[..., :width]
        q, k = split_heads(*qk.split(self.split_size, dim=-1), self.head_dim)
        out, attention = run_primal(
            self, q, k, hidden_states, attention_mask, cache, output_attentions=output_attentions, **kwargs
        )
        return self.resid_dropout(self.c_proj(out)), attention


ARCHITECTURE = define_architecture(
    globals(), modeling_gpt2.GPT2PreTrainedModel, modeling_gpt2.GPT2Attention,
    # value_attr None: the value third of c_attn stays (see PrimalGPT2Attention).
    Layout(blocks="h", attention="attn", heads_attr="num_heads", head_dim_attr="head_dim", qk_names=("c_attn",),
           out_name="c_proj", value_attr=None),
    primal_class=PrimalGPT2Attention, max_tokens=lambda config: config.n_positions, causal=lambda config: True,
    lora_fan_in_fan_out=True,  # Conv1D stores its weight transposed
    causal_lm_heads=("GPT2LMHeadModel",),
)

# PrimalGPT2Config and the shareable twin of every gpt2 model class
# of the installed transformers are made by define_architecture (shareable.shareable_classes);
# tests/test_architectures.py checks this list against them.
__all__ = [
    "ARCHITECTURE",
    "PrimalGPT2Attention",
    "PrimalGPT2Config",
    "PrimalGPT2DoubleHeadsModel",
    "PrimalGPT2ForQuestionAnswering",
    "PrimalGPT2ForSequenceClassification",
    "PrimalGPT2ForTokenClassification",
    "PrimalGPT2LMHeadModel",
    "PrimalGPT2Model",
]
