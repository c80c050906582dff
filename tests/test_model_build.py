"""The model-building script: a tiny Qwen2 + BPE that load with the real `from_pretrained`, and a
tokenizer whose ids Hugging Face (Qwen2Tokenizer) and the raw tokenizer.json agree on."""

import json
import subprocess
import sys

from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from minirl.agents.env import TOOLS, DoorsEnv
from minirl.agents.agent import chat_tools
from minirl.agents.items import items_to_messages
from minirl.config import REPO_ROOT, load_config
from minirl.generation.chat_format import parse_reply

SAMPLE = ('<|im_start|>user\nRoom 1.<image>lamp 3 , door 9 ; gold red</image><|im_end|>\n<|im_start|>assistant\n'
          '<think>door 9</think><tool_call>{"name": "open_door", "arguments": {"code": 9}}</tool_call><|im_end|> it\'s  x\n\n')


def test_build_script_makes_a_loadable_model(tmp_path):
    out = tmp_path / "m"
    proc = subprocess.run(
        [sys.executable, "scripts/build_tiny_model.py", "--out", str(out), "--episodes", "60", "--sft-steps", "3", "--batch", "4"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.model_type == "qwen2"
    info = json.loads((out / "build_info.json").read_text())
    assert info["parameters"] == sum(p.numel() for p in model.parameters())


def test_committed_model_tokenizer_agrees_with_its_tokenizer_json():
    path = load_config().policy.model_name
    hf = AutoTokenizer.from_pretrained(path)
    raw = Tokenizer.from_file(f"{path}/tokenizer.json")
    assert type(hf).__name__ == "Qwen2Tokenizer"
    ids = hf(SAMPLE, add_special_tokens=False)["input_ids"]
    assert ids == raw.encode(SAMPLE, add_special_tokens=False).ids
    assert hf.decode(ids) == SAMPLE


def test_template_renders_a_reply_back_to_its_own_text():
    path = load_config().policy.model_name
    hf = AutoTokenizer.from_pretrained(path)
    reply = '<think>door 9</think><tool_call>{"name": "open_door", "arguments": {"code": 9}}</tool_call>'
    msg = parse_reply(reply)
    history = items_to_messages(DoorsEnv(1, 2).initial_input())
    prompt = hf.apply_chat_template(history, tools=chat_tools(TOOLS), tokenize=False, add_generation_prompt=True)
    turn = {"role": "assistant", "content": msg["content"] or "", "reasoning_content": msg["reasoning"],
            "tool_calls": msg["tool_calls"]}
    full = hf.apply_chat_template(history + [turn], tools=chat_tools(TOOLS), tokenize=False)
    assert full == prompt + reply + "<|im_end|>\n"
