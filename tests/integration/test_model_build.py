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
from minirl.config import REPO_ROOT, AgentConfig, load_config
from minirl.generation.chat_format import parse_reply
from helpers import build_module

SAMPLE = ('<|im_start|>user\nRoom 1.<image>lamp 3 , door 9 ; gold red</image><|im_end|>\n<|im_start|>assistant\n'
          '<think>door 9</think><tool_call>{"name": "open_door", "arguments": {"code": 9}}</tool_call><|im_end|> '
          'it\'s  x\n\n')


def test_build_script_makes_a_loadable_model(tmp_path):
    out = tmp_path / "m"
    proc = subprocess.run(
        [sys.executable, "scripts/build_tiny_model.py", "--out", str(out), "--episodes", "60", "--sft-steps", "3",
         "--batch", "4"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.model_type == "qwen2"
    info = json.loads((out / "build_info.json").read_text())
    assert info["parameters"] == sum(p.numel() for p in model.parameters())
    # the default build records what it did before issue 30
    assert "task" not in info["args"] and "summary_recall" not in info


def test_summarize_build_runs_its_teacher_through_the_summarizing_policy(tmp_path, capsys):
    """In-process (the imports are the cost): a loadable model whose scores are the summarizer's."""
    import pytest

    b = build_module()
    b.main(["--out", str(tmp_path), "--task", "doors_memory", "--summarize", "--episodes", "24", "--sft-steps", "2",
            "--batch", "4", "--eval-n", "3"])
    info = json.loads((tmp_path / "build_info.json").read_text())
    assert info["args"]["summarize"] and info["summary_recall_n"] > 0 and info["hidden_door_rate_n"] > 0
    assert "summaries" in capsys.readouterr().out
    assert AutoModelForCausalLM.from_pretrained(tmp_path).config.model_type == "qwen2"
    with pytest.raises(SystemExit) as exit_:
        b.main(["--out", str(tmp_path), "--summarize"])
    assert exit_.value.code == 2 and "--summarize goes with --task doors_memory" in capsys.readouterr().err


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


# replies as vLLM's hermes parser reads them: non-ASCII arguments, text after a call, one bad block among good
# ones, an unclosed last block, a block without `arguments`, string arguments, a name that is no string, ...
HERMES_CASES = [
    '<tool_call>{"name": "f", "arguments": {"q": "Zürich"}}</tool_call>',
    '<tool_call>{"name": "f", "arguments": {"q": "a"}}</tool_call>trailing text',
    '<tool_call>{bad json}</tool_call><tool_call>{"name": "f", "arguments": {"q": "a"}}</tool_call>',
    '<tool_call>{"name": "f", "arguments": {"q": "a"}}</tool_call><tool_call>[1]</tool_call>',
    'Trying. <tool_call>{"name": "f", "arguments": {"q": "a"}}</tool_call> then <tool_call>{"name": "g", '
    '"arguments": {"q": "東京"}}</tool_call> done',
    '<tool_call>{"name": "f", "arguments": {"q": "a"}}',
    '<tool_call>{"name": "f"}</tool_call>',
    '<tool_call>{"name": "f", "arguments": "x é"}</tool_call>',
    '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
    '<tool_call></tool_call>',
    'no call here',
]


def test_reply_parser_agrees_with_vllms_hermes_parser():
    """`parse_reply` gives vLLM's `Hermes2ProToolParser.extract_tool_calls` content and calls (names and
    argument strings), and a canonical reply with non-ASCII arguments renders back to its own text."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser

    hf = AutoTokenizer.from_pretrained(load_config().policy.model_name)
    hermes = Hermes2ProToolParser(hf)
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], tools=chat_tools(TOOLS))
    for text in HERMES_CASES:
        theirs = hermes.extract_tool_calls(text, req)
        ours = parse_reply(text)
        assert ((ours["content"], [(c["function"]["name"], c["function"]["arguments"]) for c in ours["tool_calls"]])
                == (theirs.content, [(c.function.name, c.function.arguments) for c in theirs.tool_calls])), text

    reply = ('<think>door 9</think><tool_call>{"name": "open_door", "arguments": {"code": 9, "note": "Zürich 東京"}}'
             '</tool_call>')
    msg = parse_reply(reply)
    history = items_to_messages(DoorsEnv(1, 2).initial_input())
    prompt = hf.apply_chat_template(history, tools=chat_tools(TOOLS), tokenize=False, add_generation_prompt=True)
    turn = {"role": "assistant", "content": msg["content"] or "", "reasoning_content": msg["reasoning"],
            "tool_calls": msg["tool_calls"]}
    full = hf.apply_chat_template(history + [turn], tools=chat_tools(TOOLS), tokenize=False)
    assert full == prompt + reply + "<|im_end|>\n"


# ------------------------------------------------------------------ the summarizing warm start (issue 30)
SUMMARIZE_DIR = REPO_ROOT / "models" / "tiny-summarize"


def test_summarizing_teacher_drops_the_fact_sometimes_and_answers_from_its_summary():
    """The teacher through the real agent loop and the real summarizing policy: a summary carries the
    note's fact about p_recall of the time, and the hidden door is opened exactly when the note
    reached the last room (p_correct = 1: every other room opens on its first try)."""
    import asyncio
    import random

    from minirl.agents.agent import run_episode
    from minirl.agents.env import TOOLS, make_rooms
    from minirl.generation.chat_format import CHAT_TEMPLATE

    b = build_module()
    boot = b.PreTrainedTokenizerFast(tokenizer_object=b.Tokenizer(b.models.BPE()))
    boot.chat_template = CHAT_TEMPLATE

    def render(messages, tools):
        return boot.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)

    rng = random.Random(3)
    teacher = b.SummarizingTeacher(rng, 1.0, 0.4, render, lambda m, t: len(render(m, t)) // 3)
    carried = dropped = 0
    for i in range(150):
        env = DoorsEnv(seed=rng.randrange(2**31), num_rooms=4, task="doors_memory")
        cfg = AgentConfig(max_steps=4)
        cfg.context_history.policy.type = "summarize"
        # rough counts ~100, 190, 280, 370: before the last room only
        cfg.context_history.policy.summarize.threshold_tokens = [320, 340]
        row = {"responses_create_params": {"input": env.initial_input(), "tools": TOOLS},
               "task": {"env": "doors_memory", "seed": env.seed, "num_rooms": 4},
               "_minirl": {"step": 0, "group": i, "rollout": 0, "attempt": 0}}
        res = asyncio.run(run_episode(row, cfg, teacher))
        ev = res["evidence"]
        assert ev["summaries"] == 1 and ev["summary_facts_needed"] == 1, ev
        last = json.loads([it for it in res["response"]["output"] if it["type"] == "function_call"][-1]["arguments"])
        right = last["code"] == make_rooms(env.seed, 4)[-1].code
        if ev["summary_facts_recalled"]:
            carried += 1
            assert right and res["reward"] == 1.0
        else:
            dropped += 1
            assert res["reward"] == (3 + right) / 4
    assert 0.25 < carried / 150 < 0.55, carried  # p_recall 0.4: noisy, so RL has room to improve
    kinds = [b.example_kind(p, r) for p, r in teacher.examples]
    assert kinds.count("summary") == 150 and kinds.count("hidden_door") == 150
def test_committed_summarize_model_covers_the_protocol_and_is_a_noisy_summarizer():
    from minirl.agents.compaction.summary_format import SUMMARY_REQUEST, handoff_text

    hf = AutoTokenizer.from_pretrained(SUMMARIZE_DIR)
    raw = Tokenizer.from_file(str(SUMMARIZE_DIR / "tokenizer.json"))
    assert type(hf).__name__ == "Qwen2Tokenizer"
    for text in (SAMPLE, SUMMARY_REQUEST, handoff_text("note7"), "<summary>door3</summary>"):
        ids = hf(text, add_special_tokens=False)["input_ids"]
        assert ids == raw.encode(text, add_special_tokens=False).ids and hf.decode(ids) == text
    words = hf.tokenize(SUMMARY_REQUEST)
    assert "summary" in words and len(words) <= 20, words  # the protocol's words are in the vocabulary
    info = json.loads((SUMMARIZE_DIR / "build_info.json").read_text())
    assert info["args"]["task"] == "doors_memory" and info["args"]["summarize"]
    assert 0 < info["summary_recall"] <= 0.6  # it drops the fact often (or miscopies it): room for RL
    assert info["hidden_door_rate"] >= 0.5 and info["summary_wellformed"] >= 0.9
    assert sum(f.stat().st_size for f in SUMMARIZE_DIR.iterdir()) < 4_000_000


def teacher_examples(episodes: int, task: str):
    """The build module, the committed summarizer's tokenizer, and `episodes` of `task` played by the
    summarizing teacher (p_correct 0.9, p_recall 0.5) with that tokenizer's counts."""
    from minirl.generation.chat_format import CHAT_TEMPLATE

    b = build_module()
    boot = b.PreTrainedTokenizerFast(tokenizer_object=b.Tokenizer(b.models.BPE()))
    boot.chat_template = CHAT_TEMPLATE

    def render(messages, tools):
        return boot.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)

    hf = AutoTokenizer.from_pretrained(SUMMARIZE_DIR)
    count = lambda m, t: len(hf(render(m, t))["input_ids"])  # noqa: E731
    return b, hf, b.summarizing_transcripts(episodes, 0.9, 0.5, 0, render, count, task)


def test_note_drills_train_the_notes_digit_and_redraw_it():
    """--note-drills / --read-drills: the loss falls on the digit right after the summary's (or the last
    room's think block's) `note`, and it is the digit of every note the drill's prompt shows (redrawn per
    drill, so it cannot be memorised); a last-room drill also trains its `note`, a summary drill does not."""
    import re

    b, hf, examples = teacher_examples(16, "doors_memory")
    for kind, head, trained in (("summary", "<summary>keep\nnote", 1),
                                ("hidden_door", "<|im_start|>assistant\n<think>note", 2)):
        drills = b.note_drills(examples, hf, 3, 0, kind)
        assert drills and len(drills) % 3 == 0
        digits = set()
        for ids, targets in drills:
            assert len(targets) == trained and hf.decode(ids[targets[0]:targets[-1]]) in ("", "note")
            before, digit = hf.decode(ids[: targets[-1]]), hf.decode(ids[targets[-1]])
            assert before.endswith(head) and set(re.findall(r"note(\d)", before)) == {digit}
            digits.add(digit)
        assert len(digits) > 1


def test_read_drills_on_doors_notes_read_the_note_the_hidden_door_names():
    """--read-drills on doors_notes: every note's digit is redrawn (one digit per tag), and the last room's
    drill answers with the note whose tag its hidden door names (`doorB?` -> `noteB<d>`), its label and
    digit trained, so the model must pick that note from the others, distractor included."""
    import re

    b, hf, examples = teacher_examples(12, "doors_notes")
    assert b.note_drills(examples, hf, 2, 0, "summary") == []  # no untagged note: a summary drill needs one
    drills = b.note_drills(examples, hf, 2, 0, "hidden_door")
    assert drills and len(drills) % 2 == 0
    tags, others_differ = set(), 0
    for ids, targets in drills:
        prompt = hf.decode(ids[: targets[0]])
        tag = re.findall(r"door([A-Z])\?", prompt)[-1]
        label, digit = hf.decode(ids[targets[0]:targets[-1]]), hf.decode(ids[targets[-1]])
        assert prompt.endswith("<think>") and label == f"note{tag}", (prompt[-40:], label)
        notes = dict(re.findall(r"note([A-Z])(\d)", prompt))  # every tag's one redrawn digit
        assert notes[tag] == digit and set(re.findall(rf"note{tag}(\d)", prompt)) == {digit}
        others_differ += any(d != digit for t, d in notes.items() if t != tag)
        tags.add(tag)
    assert tags == {"A", "B"} and others_differ > 0
