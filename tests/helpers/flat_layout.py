"""The outputs `tests/test_saved_folders.py` compares, computed the same way with or without hf_primal imported
(this module imports only torch, so a child process that blocks hf_primal can run it)."""

from pathlib import Path

import torch

FOLDERS = Path(__file__).resolve().parents[1] / "fixtures" / "flat_layout_folders"


def reference() -> dict:
    return torch.load(FOLDERS / "reference_outputs.pt")


def outputs(bert, gpt2) -> dict:
    ref = reference()
    with torch.no_grad():
        hidden = bert(input_ids=ref["bert_input_ids"], attention_mask=ref["bert_attention_mask"]).last_hidden_state
        logits = gpt2(ref["gpt2_input_ids"]).logits
        greedy = gpt2.generate(ref["gpt2_input_ids"], max_new_tokens=6, do_sample=False, pad_token_id=0)
    return {"bert_last_hidden_state": hidden, "gpt2_logits": logits, "gpt2_greedy": greedy}
