"""Tokenizer and chat template of a Hugging Face checkpoint directory.

Reads ``tokenizer.json`` with the ``tokenizers`` package and renders chat templates with jinja2
(sandboxed), the way Hugging Face defines them. Templates are found where transformers writes them
(first match wins, as in transformers):

- ``chat_template.jinja`` (transformers >= 4.50 writes the default template there), plus named
  templates in ``additional_chat_templates/NAME.jinja``;
- ``chat_template.json`` (``{"chat_template": str | {name: str}}``, the processor form);
- ``tokenizer_config.json`` ``chat_template``: a string, a ``{name: template}`` dict, or the older
  ``[{"name", "template"}]`` list.

``chat_template`` is the template named ``default`` (or the only one). Special tokens come from
``tokenizer_config.json`` (``bos_token`` / ``eos_token`` as strings or AddedToken dicts), else
``special_tokens_map.json``; stop ids of the model (``generation_config.json``, which lists several
for Llama-3) are read with the model's config (:meth:`~specdec.models.families.ModelConfig.from_dir`).
"""

from __future__ import annotations

import json
from pathlib import Path

from .loading import CheckpointError, read_json_object


def _named_templates(value, source: str) -> dict[str, str]:
    """A chat_template value (str, {name: str} or [{"name", "template"}]) as {name: template}."""
    if value is None:
        return {}
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, dict) and all(isinstance(v, str) for v in value.values()):
        return dict(value)
    if isinstance(value, list) and all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                       and isinstance(t.get("template"), str) for t in value):
        return {t["name"]: t["template"] for t in value}
    raise CheckpointError(f"{source}: chat_template must be a string, a {{name: template}} object or a "
                          f"list of {{name, template}} objects, got {type(value).__name__}")


def find_chat_templates(path: Path, tokenizer_config: dict) -> tuple[dict[str, str], str | None]:
    """({name: template}, the file they came from) of a checkpoint directory."""
    jinja = path / "chat_template.jinja"
    extra_dir = path / "additional_chat_templates"
    if jinja.is_file() or extra_dir.is_dir():
        templates = {"default": jinja.read_text()} if jinja.is_file() else {}
        if extra_dir.is_dir():
            templates.update({f.stem: f.read_text() for f in sorted(extra_dir.glob("*.jinja"))})
        return templates, jinja.name if jinja.is_file() else extra_dir.name
    cj = path / "chat_template.json"
    if cj.is_file():
        return _named_templates(read_json_object(cj, "chat template").get("chat_template"), str(cj)), cj.name
    value = tokenizer_config.get("chat_template")
    return _named_templates(value, str(path / "tokenizer_config.json")), (
        "tokenizer_config.json" if value is not None else None)


class Tokenizer:
    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(path)
        tj = path / "tokenizer.json"
        if not tj.is_file():
            raise CheckpointError(f"{path} has no tokenizer.json")
        try:
            self._tok = HFTokenizer.from_file(str(tj))
        except Exception as e:  # the Rust side raises a plain Exception for a malformed file
            raise CheckpointError(f"{tj}: cannot read tokenizer: {e}") from e
        cfg = read_json_object(path / "tokenizer_config.json", "tokenizer config")
        special = read_json_object(path / "special_tokens_map.json", "special tokens")
        self.chat_templates, self.chat_template_source = find_chat_templates(path, cfg)
        if "default" in self.chat_templates:
            self.chat_template: str | None = self.chat_templates["default"]
        elif len(self.chat_templates) == 1:
            self.chat_template = next(iter(self.chat_templates.values()))
        else:
            self.chat_template = None
        self.add_bos = bool(cfg.get("add_bos_token", False))

        def token(key):
            tok = cfg.get(key, special.get(key))
            if isinstance(tok, dict):  # an AddedToken: {"content": ..., "special": ...}
                tok = tok.get("content")
            return tok if isinstance(tok, str) else None

        # Every special token a template may name ({{ bos_token }}, {{ eos_token }}, ...).
        self.special_tokens = {k: t for k in ("bos_token", "eos_token", "unk_token", "pad_token")
                               if (t := token(k)) is not None}
        self.bos_token = self.special_tokens.get("bos_token")
        self.eos_token = self.special_tokens.get("eos_token")
        self.bos_token_id = None if self.bos_token is None else self._tok.token_to_id(self.bos_token)
        self.eos_token_id = None if self.eos_token is None else self._tok.token_to_id(self.eos_token)

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

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True,
                            name: str | None = None) -> str:
        """Render the default template (or the one called ``name``) over ``messages``."""
        template = self.chat_template if name is None else self.chat_templates.get(name)
        if not template:
            if name is not None:
                raise CheckpointError(f"no chat template named {name!r}; this tokenizer has "
                                      f"{sorted(self.chat_templates) or 'none'}")
            raise CheckpointError("this tokenizer has no chat template (no chat_template.jinja, "
                                  "chat_template.json or tokenizer_config.json chat_template); use raw "
                                  "prompts (workload.chat=false or auto)")
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise CheckpointError(f"chat template ({self.chat_template_source}): {message}")

        def strftime_now(fmt):
            import datetime

            return datetime.datetime.now().strftime(fmt)

        # The environment transformers renders templates in: trim/lstrip blocks, loop controls,
        # raise_exception / strftime_now globals, tojson without ASCII escaping.
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda x, indent=None, separators=None, sort_keys=False: json.dumps(
            x, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)
        env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
        try:
            compiled = env.from_string(template)
        except jinja2.TemplateError as e:
            raise CheckpointError(f"chat template ({self.chat_template_source}) does not parse: {e}") from e
        return compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               **{"bos_token": "", "eos_token": "", **self.special_tokens})

    def encode_chat(self, messages: list[dict]) -> list[int]:
        # The template already holds any special tokens it wants: add no BOS on top.
        return self.encode(self.apply_chat_template(messages), add_bos=False)
