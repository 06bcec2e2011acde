"""Tokenizer and chat template of a Hugging Face checkpoint directory.

Reads ``tokenizer.json`` with the ``tokenizers`` package and renders the ``chat_template`` of
``tokenizer_config.json`` with jinja2 (sandboxed), the way Hugging Face chat templates are defined.
"""

from __future__ import annotations

import json
from pathlib import Path

from .loading import CheckpointError


class Tokenizer:
    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(path)
        tj = path / "tokenizer.json"
        if not tj.is_file():
            raise CheckpointError(f"{path} has no tokenizer.json")
        self._tok = HFTokenizer.from_file(str(tj))
        cfg_path = path / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.chat_template: str | None = cfg.get("chat_template")
        self.add_bos = bool(cfg.get("add_bos_token", False))

        def tok_id(key):
            tok = cfg.get(key)
            if isinstance(tok, dict):
                tok = tok.get("content")
            return None if tok is None else self._tok.token_to_id(tok)

        self.bos_token_id = tok_id("bos_token")
        self.eos_token_id = tok_id("eos_token")
        self.bos_token = cfg.get("bos_token")
        self.eos_token = cfg.get("eos_token")

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids, *, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise CheckpointError("this tokenizer has no chat_template; use raw prompts "
                                  "(workload.chat=false)")
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        template = env.from_string(self.chat_template)
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               bos_token=self.bos_token or "", eos_token=self.eos_token or "")

    def encode_chat(self, messages: list[dict]) -> list[int]:
        # The template already holds any special tokens it wants: add no BOS on top.
        return self.encode(self.apply_chat_template(messages), add_bos=False)
