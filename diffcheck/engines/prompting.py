"""The prompts as token ids, built the same way for every engine.

Every engine sends token ids, never text: the chat template is applied here,
client-side, with the model's own tokenizer, so that vLLM offline, a served vLLM
(``/v1/completions`` with token-id prompts) and transformers see the same ids.
"""

from __future__ import annotations

from pathlib import Path


def prompt_token_ids(tokenizer, prompts) -> list[list[int]]:
    """One list of ids per prompt: the chat template (with generation prompt) for chat prompts, else encode()."""
    ids = []
    for p in prompts:
        if getattr(p, "chat", True):
            messages = ([{"role": "system", "content": p.system}] if getattr(p, "system", None) else []) + [
                {"role": "user", "content": p.text}
            ]
            out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            if isinstance(out, dict) or hasattr(out, "input_ids"):
                out = out["input_ids"]
            ids.append([int(t) for t in out])
        else:
            ids.append([int(t) for t in tokenizer.encode(p.text)])
    return ids


def load_tokenizer(model_path: str | Path):
    """The model folder's tokenizer through transformers (what vLLM loads for the same folder)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_path))
