"""Real checkpoint directories load unchanged: what transformers' save_pretrained writes today
(chat_template.jinja, named templates, generation_config.json stop lists, both RoPE config layouts),
and malformed files fail with errors that name them."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specdec.bench.workloads import WorkloadError, load_prompts, resolve_chat
from specdec.models.llama import LlamaModel
from specdec.models.families import ModelConfig
from specdec.models.loading import CheckpointError, load_safetensors
from specdec.models.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
SPECIALS = ["<unk>", "<s>", "</s>", "<|eot_id|>", "<|start|>"]  # ids 0..4
# A Llama-3-style template: BOS, role headers, <|eot_id|> after each turn.
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|start|>{{ m['role'] }}\n{{ m['content'] }}<|eot_id|>"
            "{% endfor %}{% if add_generation_prompt %}<|start|>assistant\n{% endif %}")
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello to the world."}]


def tiny_tokenizer():
    """A byte-level BPE trained here (offline) on a few sentences, wrapped for save_pretrained."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = RawTokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world, say hello to the world", "be brief and count to three"] * 20, trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                unk_token="<unk>")


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """One random Llama (Llama-3 RoPE scaling, untied) + tokenizer written by save_pretrained
    (config.json with rope_parameters), and a copy whose config.json uses the classic rope_theta +
    rope_scaling layout of published Llama-3.1 checkpoints. config.json stops on </s> only;
    generation_config.json, as for Llama-3.1, on </s> and <|eot_id|>."""
    tok = tiny_tokenizer()
    tok.chat_template = TEMPLATE
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}
    cfg = transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, rope_parameters={"rope_theta": 500000.0, **scaling})
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # peaked logits: greedy ties cannot flip between implementations
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.copy_(torch.randn(p.shape) / (p.shape[-1] ** 0.5 if "embed" not in name else 1.0))
        # Make <|eot_id|> (3: a stop id in generation_config.json only) win where the 8th greedy token of
        # MESSAGES would, so a run stops there only if it reads generation_config.json.
        ids = torch.tensor([tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                                    return_dict=False)])
        t = model.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)[0, -1]
        model.lm_head.weight[3] = 1.5 * model.lm_head.weight[t]
    model.generation_config = transformers.GenerationConfig(bos_token_id=1, eos_token_id=[2, 3])
    new = tmp_path_factory.mktemp("hf_rope_parameters")
    model.save_pretrained(new)
    tok.save_pretrained(new)
    classic = tmp_path_factory.mktemp("hf_classic")
    for f in new.iterdir():
        shutil.copy(f, classic / f.name)
    c = json.loads((classic / "config.json").read_text())
    c.pop("rope_parameters")
    c.update(rope_theta=500000.0, rope_scaling=dict(scaling))
    (classic / "config.json").write_text(json.dumps(c, indent=2))
    return {"rope_parameters": new, "classic": classic}, model, tok


def test_save_pretrained_layout_is_what_we_parse(hf_dirs):
    dirs, _, _ = hf_dirs
    new = dirs["rope_parameters"]
    assert (new / "chat_template.jinja").is_file()  # transformers 5 writes the template to its own file
    assert "chat_template" not in json.loads((new / "tokenizer_config.json").read_text())
    assert "rope_parameters" in json.loads((new / "config.json").read_text())
    a, b = (ModelConfig.from_dir(d) for d in (dirs["rope_parameters"], dirs["classic"]))
    assert a == b and a.rope_theta == 500000.0 and a.rope_scaling["rope_type"] == "llama3"
    assert a.eos_token_id == [2, 3]  # config.json's 2, plus generation_config.json's 3


@pytest.mark.parametrize("layout", ["rope_parameters", "classic"])
def test_tokenizer_and_logits_match_transformers(hf_dirs, layout):
    dirs, hf_model, hf_tok = hf_dirs
    path = dirs[layout]
    tok = Tokenizer(path)
    assert tok.chat_template_source == "chat_template.jinja"
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    want = hf_tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
    ids = tok.encode_chat(MESSAGES)
    assert ids == list(want) and ids[0] == 1 and ids.count(3) == 2
    ref_hf = transformers.LlamaForCausalLM.from_pretrained(path).eval()  # transformers' own reading of this layout
    ours = LlamaModel.from_pretrained(path, dtype="float32", backend="torch")
    from test_llama import full_forward

    with torch.no_grad():
        ref = ref_hf(torch.tensor([ids])).logits[0]
        orig = hf_model(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ref, orig)  # both layouts mean the same RoPE to transformers
    torch.testing.assert_close(full_forward(ours, ids), ref, atol=1e-4, rtol=1e-4)


def run_cli(*overrides, tmp_path, cwd=ROOT):
    env = dict(os.environ, WANDB_MODE="disabled", PYTHONPATH=str(ROOT))
    env.pop("TRITON_INTERPRET", None)  # the entry uses the torch references on CPU
    return subprocess.run([sys.executable, "-m", "specdec.run", *overrides, "logger=none", "device=cpu",
                           f"hydra.run.dir={tmp_path}/run"], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


def test_cli_runs_a_save_pretrained_directory_unchanged(hf_dirs, tmp_path):
    """target=hf on what save_pretrained wrote, workload.chat left at its default (auto): the
    template from chat_template.jinja is used and recorded, and every request's greedy output is
    transformers' greedy generate (which stops on generation_config.json's list)."""
    dirs, hf_model, hf_tok = hf_dirs
    f = tmp_path / "prompts.jsonl"
    f.write_text(json.dumps({"id": "a", "messages": MESSAGES}) + "\n"
                 + json.dumps({"id": "b", "prompt": "count to three"}) + "\n")
    proc = run_cli("target=hf", f"target.path={dirs['rope_parameters']}", "workload=jsonl", f"workload.path={f}",
                   "engine.max_new_tokens=40", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "run"
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["chat"] == "template" and metrics["chat_template_source"] == "chat_template.jinja"
    assert json.loads((run / "config.json").read_text())["workload"]["chat_resolved"] == "template"
    records = [json.loads(line) for line in (run / "requests.jsonl").read_text().splitlines()]
    prompts = [MESSAGES, [{"role": "user", "content": "count to three"}]]
    for rec, msgs in zip(records, prompts):
        ids = Tokenizer(dirs["rope_parameters"]).encode_chat(msgs)
        assert rec["prompt_tokens"] == len(ids)
        with torch.no_grad():
            out = hf_model.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False, pad_token_id=0)
        want = out[0, len(ids):].tolist()
        assert rec["output_ids"] == want, rec["id"]
    assert records[0]["output_ids"][-1] == 3 and records[0]["finish_reason"] != "length"  # stopped on <|eot_id|>
    assert len(records[0]["output_ids"]) <= 8


def test_chat_auto_without_template_sends_raw_prompts(hf_dirs, tmp_path):
    dirs, _, _ = hf_dirs
    d = tmp_path / "no_template"
    shutil.copytree(dirs["classic"], d)
    (d / "chat_template.jinja").unlink()
    tok = Tokenizer(d)
    assert tok.chat_template is None and tok.chat_template_source is None
    f = tmp_path / "p.jsonl"
    f.write_text('{"id": "a", "prompt": "say hello"}\n')
    wl = {"sources": [{"kind": "jsonl"}], "path": str(f), "chat": "auto"}
    assert resolve_chat(wl, tok) is False
    assert load_prompts(wl, tok)[0].prompt_ids == tok.encode("say hello")
    with pytest.raises(CheckpointError, match="no chat template"):
        load_prompts({**wl, "chat": True}, tok)
    with pytest.raises(WorkloadError, match="workload.chat='sometimes'; valid: auto"):
        resolve_chat({**wl, "chat": "sometimes"}, tok)


def test_named_templates_in_every_form(tmp_path):
    """{name: template} as transformers 5 writes it (chat_template.jinja + additional_chat_templates/),
    tokenizer_config.json's older list and dict forms, and chat_template.json: the default template
    renders like transformers, the others are reachable by name."""
    hf_tok = tiny_tokenizer()
    hf_tok.chat_template = {"default": TEMPLATE, "tool_use": "TOOLS{{ messages[0]['content'] }}"}
    hf_tok.save_pretrained(tmp_path / "v5")
    assert (tmp_path / "v5" / "additional_chat_templates" / "tool_use.jinja").is_file()
    loaded = transformers.AutoTokenizer.from_pretrained(tmp_path / "v5")
    want = loaded.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    want_tool = loaded.apply_chat_template(MESSAGES, chat_template="tool_use", tokenize=False)
    tok = Tokenizer(tmp_path / "v5")
    assert tok.apply_chat_template(MESSAGES) == want
    assert tok.apply_chat_template(MESSAGES, name="tool_use") == want_tool == "TOOLSBe brief."

    base = tmp_path / "v5"
    forms = {
        "list": {"chat_template": [{"name": "default", "template": TEMPLATE}, {"name": "tool_use", "template": "T"}]},
        "dict": {"chat_template": {"default": TEMPLATE, "tool_use": "T"}},
    }
    for name, extra in forms.items():
        d = tmp_path / name
        d.mkdir()
        shutil.copy(base / "tokenizer.json", d)
        cfg = json.loads((base / "tokenizer_config.json").read_text())
        (d / "tokenizer_config.json").write_text(json.dumps({**cfg, **extra}))
        t = Tokenizer(d)
        assert t.chat_template_source == "tokenizer_config.json" and set(t.chat_templates) == {"default", "tool_use"}
        assert t.apply_chat_template(MESSAGES) == want
    d = tmp_path / "json"
    d.mkdir()
    shutil.copy(base / "tokenizer.json", d)
    shutil.copy(base / "tokenizer_config.json", d)
    (d / "chat_template.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    t = Tokenizer(d)
    assert t.chat_template_source == "chat_template.json" and t.apply_chat_template(MESSAGES) == want
    with pytest.raises(CheckpointError, match="no chat template named 'nope'"):
        t.apply_chat_template(MESSAGES, name="nope")
    (d / "chat_template.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="chat_template.json: expected a JSON object"):
        Tokenizer(d)


# ------------------------------------------------------------------------------------------------
# Malformed files are named
# ------------------------------------------------------------------------------------------------

@pytest.fixture
def sharded_dir(tmp_path):
    from specdec.models.loading import write_safetensors

    d = tmp_path / "sharded"
    names = write_safetensors(d, {"a": torch.zeros(100), "b": torch.ones(100)}, shard_bytes=500)
    assert len(names) == 2 and (d / "model.safetensors.index.json").is_file()
    return d


@pytest.mark.parametrize("index,needle", [
    ("{not json", "is not valid JSON"),
    ("[1, 2]", 'expected a JSON object with a non-empty "weight_map"'),
    ('{"metadata": {}}', 'expected a JSON object with a non-empty "weight_map"'),
    ('{"weight_map": {"a": 3}}', 'expected a JSON object with a non-empty "weight_map"'),
    ('{"weight_map": {"a": "model-00009-of-00009.safetensors"}}', "names shard files that are not in"),
])
def test_malformed_shard_index_is_named(sharded_dir, index, needle):
    assert torch.equal(load_safetensors(sharded_dir)["b"], torch.ones(100))
    (sharded_dir / "model.safetensors.index.json").write_text(index)
    with pytest.raises(CheckpointError, match=needle) as e:
        load_safetensors(sharded_dir)
    assert "model.safetensors.index.json" in str(e.value)


@pytest.mark.parametrize("text", ["[1, 2, 3]", '"llama"', "null"])
def test_config_that_is_not_an_object_is_named(tmp_path, text):
    from specdec.models.eagle3 import Eagle3Head

    (tmp_path / "config.json").write_text(text)
    with pytest.raises(CheckpointError, match=r"config.json: expected a JSON object"):
        ModelConfig.from_dir(tmp_path)
    with pytest.raises(CheckpointError, match=r"config.json: expected a JSON object"):
        Eagle3Head.load(tmp_path)


def test_cli_names_a_bad_config_json(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text("[]")
    proc = run_cli("target=hf", f"target.path={d}", tmp_path=tmp_path)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "config.json: expected a JSON object" in proc.stderr


def test_bad_generation_config_is_named(hf_dirs, tmp_path):
    dirs, _, _ = hf_dirs
    d = tmp_path / "m"
    shutil.copytree(dirs["classic"], d)
    (d / "generation_config.json").write_text('{"eos_token_id": "x"}')
    with pytest.raises(CheckpointError, match="generation_config.json: expected a JSON object whose eos_token_id"):
        ModelConfig.from_dir(d)


def test_committed_draft_config_resolves_from_any_directory(tmp_path):
    code = ("from hydra import compose, initialize_config_dir\n"
            f"with initialize_config_dir(config_dir={str(ROOT / 'conf')!r}, version_base='1.3'):\n"
            "    cfg = compose('config', overrides=['draft=eagle3_smollm2'])\n"
            "print(cfg.draft.path)\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", "import specdec\n" + code], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    path = Path(proc.stdout.strip().splitlines()[-1])
    assert path == ROOT / "checkpoints" / "eagle3-smollm2-135m" and (path / "config.json").is_file()
