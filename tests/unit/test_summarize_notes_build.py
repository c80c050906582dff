"""The doors_notes warm start (issue 54): scripts/build_tiny_model.py's summarizing teacher on
`--task doors_notes`, through the real agent loop and summarizing policy with
configs/summarize_notes.yaml's agent settings and the committed doors_memory summarizer's tokenizer
counts, and the committed models/tiny-summarize-notes. No Ray, no vLLM, no training: a few seconds.
"""

from __future__ import annotations

import asyncio
import json
import random

from transformers import AutoTokenizer

from minirl.agents.agent import run_episode
from minirl.agents.env import TOOLS, DoorsEnv
from minirl.config import REPO_ROOT, load_config
from helpers import build_module

NOTES_DIR = REPO_ROOT / "models" / "tiny-summarize-notes"


def test_the_notes_teacher_keeps_each_note_sometimes_and_reads_the_kept_ones():
    """p_correct = 1, p_recall = 0.5: with the config's threshold every episode summarizes after the
    three notes (and, its summary being long, again before the last room); each needed note survives
    a summary about half the time, an episode whose summaries kept every needed note opens every door
    on its first try, and every episode's two hidden doors are teacher examples of their kind."""
    b = build_module()
    hf = AutoTokenizer.from_pretrained(REPO_ROOT / "models" / "tiny-summarize")

    def render(messages, tools):
        return hf.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)

    rng = random.Random(4)
    teacher = b.SummarizingTeacher(rng, 1.0, 0.5, render, lambda m, t: len(hf(render(m, t))["input_ids"]))
    cfg = load_config("configs/summarize_notes.yaml", ["policy.model_name=models/tiny-summarize"])  # its agent settings
    needed = recalled = summaries = 0
    for i in range(60):
        env = DoorsEnv(seed=rng.randrange(2**31), num_rooms=7, task="doors_notes")
        row = {"responses_create_params": {"input": env.initial_input(), "tools": TOOLS},
               "task": {"env": "doors_notes", "seed": env.seed, "num_rooms": 7},
               "_minirl": {"step": 0, "group": i, "rollout": 0, "attempt": 0}}
        res = asyncio.run(run_episode(row, cfg.agent, teacher))
        ev = res["evidence"]
        assert ev["summaries"] in (1, 2) and ev["summary_facts_needed"] >= 2
        assert len(ev["segment_rewards"]) == ev["summaries"]
        needed, recalled = needed + ev["summary_facts_needed"], recalled + ev["summary_facts_recalled"]
        summaries += ev["summaries"]
        assert res["reward"] >= 5 / 7  # the ordinary rooms open on their first try (p_correct = 1)
        if ev["summary_facts_recalled"] == ev["summary_facts_needed"]:
            assert res["reward"] == 1.0 and all(r == 1.0 for r in ev["segment_rewards"])
    assert 0.3 < recalled / needed < 0.6, recalled / needed
    kinds = [b.example_kind(p, r) for p, r in teacher.examples]
    assert kinds.count("summary") == summaries and kinds.count("hidden_door") == 120


def test_committed_notes_model_reads_a_held_note_and_is_a_noisy_summarizer():
    """The config's warm start, as its build measured it (100 held-out teacher prompts a kind): it reads
    a held note well (the read the RL signal runs through: the doors_notes builds fine-tuned from
    models/tiny-summarize read one 0.15-0.33, notes-task.md), keeps a needed note in a summary only
    sometimes (room for RL), and its tokenizer writes each tagged label as one token, which that read
    relies on."""
    info = json.loads((NOTES_DIR / "build_info.json").read_text())
    assert info["args"]["task"] == "doors_notes" and info["args"]["summarize"] and "init" not in info["args"]
    assert info["hidden_door_rate"] >= 0.6 and info["door_rate"] >= 0.85
    assert 0.05 <= info["summary_fact_recall"] <= 0.6
    assert info["summary_wellformed"] >= 0.8
    tok = AutoTokenizer.from_pretrained(NOTES_DIR)
    assert [tok.decode([t]) for t in tok("\nnoteB5", add_special_tokens=False)["input_ids"]] == ["\n", "noteB", "5"]
    assert sum(f.stat().st_size for f in NOTES_DIR.iterdir()) < 4_000_000
