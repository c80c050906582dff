"""Build minirl's default policy: a tiny Qwen2 causal LM, a local BPE tokenizer, and a warm start.

    python scripts/build_tiny_model.py --out models/tiny-doors            # the committed default
    python scripts/build_tiny_model.py --out /tmp/m --size small          # ~12M params, 32k vocab
    python scripts/build_tiny_model.py --out models/tiny-summarize --task doors_memory --summarize \
        --episodes 3000 --sft-steps 900 --batch 24                        # the committed summarizer

1. A noisy scripted teacher plays the `doors` task through minirl's own agent loop (with random
   compaction settings, so the model also sees compacted histories). With probability
   `--p-correct` it reads the door's number; otherwise it reads another object's number.
2. A byte-level BPE tokenizer is trained on those transcripts with Qwen2's own pre-tokenizer
   (split regex, then ByteLevel without regex), so Hugging Face's Qwen2Tokenizer and vLLM produce
   the same ids as the saved tokenizer.json.
3. A freshly initialised Qwen2ForCausalLM is fine-tuned on the teacher's replies (loss on reply
   tokens only), mixed with synthetic look-up drills (`<think>lamp` -> `3` from a picture) that
   grow the copying heads a 2-layer model otherwise learns slowly. Batches are windows of
   length-sorted examples, so little compute goes to padding. The result imitates the teacher:
   it reads the door about as often as the teacher did, which leaves GRPO clear room to improve.

With `--task doors_memory --summarize` (models/tiny-summarize, configs/summarize.yaml) the teacher
plays the memory task through the agent loop with summarizing compaction (`SummarizingTeacher`): on
the summary request (agents/compaction/summary_format.py) it writes a `<summary>` block that carries the note's
fact (`note7`) only with probability `--p-recall`, else the newest picture's door label (a noisy
summarizer that drops the fact that matters); in the last room (`door?`) it answers from a note in
its context, and guesses when there is none. The episodes are played twice: once with a rough token
count to train the tokenizer on the protocol's text, then with that tokenizer's real counts, so the
summaries fall where the policy's token threshold puts them. The look-up drills then include `note`.

The committed summarizer writes `note` in about half its summaries, as taught, but copies the right
digit in only about 0.3 of those (200 held-out summary requests at temperature 1: right note 0.155,
wrong digit 0.35, a door label 0.43), so its recall is 0.08-0.16, not the teacher's 0.5.
`--note-drills k` (off by default, not in a committed build) adds k copy drills per teacher summary
request that shows a note (`note_drills`: the digit redrawn, loss on the digit alone), to teach that
copy while the teacher's own replies still teach *whether* to keep the note. Measured (2026-12-02):
k = 6 gives recall 0.43 (the right digit in 0.88 of its `note` summaries) but the hidden door falls to
0.15 and well-formed summaries to 0.82; k = 2 with `--drill-fraction 0.125` gives recall 0.23 and the
hidden door 0.11: the drills cost the last room's read of the note.

Why (teacher-forced on held-out prompts, p = 1: the probability of the right digit right after
`note`): the committed model copies it in the last room (0.94 from a summary, 0.81 from the note's
picture) but not in a summary (0.39 from the picture; 0.10 re-summarizing a summary, where it copies
the newest picture's digit instead); the k = 2 build is the mirror image (summary 0.74 / 0.86, last
room 0.17 / 0.11, the newest picture's digit instead). Drilling one context moves the copy there and
off the other. `--read-drills k` drills the last room the same way (its prompts that show a note,
the digit redrawn, answered `<think>note<d>` and the call; DRILL_REPLIES; on doors_notes the note its
`door<T>?` names, every tag's digit redrawn: not yet in a committed build). With both, the copy holds
everywhere (0.91-1.00 in all four cases), and what breaks instead is the choice of label:
- `--note-drills 2 --read-drills 3 --sft-steps 1000` (loss on the read's digit alone): recall 0.41,
  well-formed 0.97, but the hidden door 0.40 (it writes `door?`, the no-note guess, in 63 of 100
  held-out last rooms) and the door rate 0.81 (`note` written in 8 of 60 ordinary rooms);
- `--note-drills 2 --read-drills 2 --sft-steps 900`, the read's `note` token trained too (the code
  now): recall 0.36, well-formed 0.93, hidden door 0.57 (`door?` in 34 of 100 last rooms), door rate
  0.75 (`note` in 9 of 60 ordinary rooms: the drills teach "a note in the context: read it",
  not "read it where the newest picture shows `door?`").
Neither meets a sane warm start's door rate (>= ~0.85, the committed model's 0.90), so
models/tiny-summarize is unchanged. The choice seesaws as the copy did: continuing the second build's
SFT for 300 steps (lr 3e-4, 1000 fresh teacher episodes, a diagnostic, not a build) gives recall 0.46,
hidden door 0.68, door rate 0.69 with the same mix, and 0.33 / 0.35 / 0.83 with contrast drills added
(ordinary rooms whose context shows a note, x2, loss on the teacher's label token): the 2-layer model
does not yet tell `door?` in the newest picture from a note elsewhere. Not tried: a larger `--size`.
RL from that second build (`python -m minirl.train --config configs/summarize.yaml
policy.model_name=<it>`, seed 0 as scripts/summarize_experiments.py sets it, 40 steps, 261 s, one run):
summary_recall *fell*, 0.33 -> 0.10 (mean of the first / last 10 steps), while the training reward rose
0.60 -> 0.70 (first / last 5) and held-out success went 0.12 -> 0.00 (16 prompts). One reading, not
tested: GRPO suppresses `note` in ordinary rooms, where writing it opens a wrong door, and the summary's
`note` shares that token.
(The learning rate already decays: OneCycleLR, cosine to ~0, so a last batch loss near 1 is that
length-sorted window's mix, not a constant rate's noise.)
With `--task doors_notes --summarize` (issue 54; configs/summarize_notes.yaml) the same teacher plays
the harder memory task (MEMORY_PLAY: its room counts, threshold range and note names): a summary keeps
each note its prompt shows (the newest of each tag, one a line, in the order shown)
with probability p_recall each, and a hidden door `doorA?` is answered from `noteA<d>`; with one
untagged note (doors_memory) that is exactly the old rule, so doors_memory's transcripts are unchanged.
`summary_fact_recall` scores what the run's `summary_recall` counts (each needed note, not the
distractor, held verbatim). `--init DIR` fine-tunes a built model (weights, and its tokenizer files
copied verbatim) instead of a fresh one; the corpus is then played once, with that tokenizer's counts.
Measured (2026-12-04, `--init models/tiny-summarize`, 100 held-out prompts a kind at temperature 1):
1000 episodes, 300 steps of batch 16 at lr 3e-4, p_recall 0.5: fact recall 0.01, hidden door 0.07,
door rate 0.87, well-formed 0.96; its summaries are malformed copies (`keep\nnote callstC0`,
`keep\nnoteC9`): 300 steps do not teach the tagged copy. The first models/tiny-summarize-notes (to 2026-12-05):
`--init models/tiny-summarize --episodes 1500 --sft-steps 900 --batch 16 --lr 1e-3 --p-recall 0.7`
(1809 s on the shared machine): fact recall 0.091 (18 of 198 needed notes), hidden door 0.29, door
rate 0.92, well-formed 0.98; recall above 0 but below the 0.1-0.4 aimed at. Every build fine-tuned
from models/tiny-summarize wrote the read's tag letter at a coin flip (scripts/probe_reads.py). The
committed models/tiny-summarize-notes (2026-12-05) is built from scratch instead: `--read-drills 2
--episodes 3000 --sft-steps 1200 --batch 16 --lr 1e-3 --p-recall 0.5` (230 s on a quiet machine), its
own tokenizer writing `noteB` as one token and a summary's notes one a line (SUMMARY_SEP): fact recall
0.347, hidden door 0.81, door rate 0.89, well-formed 0.97 (at `--p-recall 0.7`: 0.417, 0.82, 0.92, 0.86).
Without these flags the build is unchanged (models/tiny-doors stays byte-identical).

Everything runs offline on CPU; the output loads with `from_pretrained(out_dir)`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import shutil
import time
from pathlib import Path
from typing import NamedTuple

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from minirl.agents.agent import ModelReply, run_episode
from minirl.agents.env import COLORS, OBJECTS, TOOLS, DoorsEnv
from minirl.agents.items import parts_text
from minirl.agents.compaction.summary_format import SUMMARY_CLOSE, SUMMARY_OPEN, SUMMARY_REQUEST, summary_text
from minirl.config import AgentConfig
from minirl.generation.chat_format import (
    ADDED_TOKENS,
    CHAT_TEMPLATE,
    EOS_TOKEN,
    PAD_TOKEN,
    SPECIAL_TOKENS,
    parse_reply,
)

QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SIZES = {
    "tiny": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2),
    "small": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4),
}
_PICTURE = re.compile(r"<image>(.*?)</image>", re.DOTALL)
_LABEL = re.compile(r"([a-z]+)(\d)")


def open_reply(name: str, num) -> str:
    """The teachers' room reply: the label read in a think block, then open_door with its digit."""
    return f'<think>{name}{num}</think><tool_call>{{"name": "open_door", "arguments": {{"code": {num}}}}}</tool_call>'


class ScriptedTeacher:
    """A ModelClient that answers from the picture in the prompt, right with probability p."""

    def __init__(self, rng: random.Random, p_correct: float, render):
        self.rng, self.p, self.render = rng, p_correct, render
        self.examples: list[tuple[str, str]] = []

    async def chat(self, messages, tools, params, key, required_prefix):
        picture = _PICTURE.findall(messages[-1]["content"])[-1]
        objects = [_LABEL.fullmatch(line).groups() for line in picture.split("\n")[1:]]
        door = next(o for o in objects if o[0] == "door")
        name, num = door if self.rng.random() < self.p else self.rng.choice([o for o in objects if o[0] != "door"])
        reply = open_reply(name, num)
        self.examples.append((self.render(messages, tools), reply + EOS_TOKEN))
        tokens = {"prompt_token_ids": [], "generation_token_ids": [], "generation_log_probs": []}
        return ModelReply(parse_reply(reply), "stop", tokens)

    async def count_tokens(self, messages, tools, key, required_prefix):
        return 0


def random_agent_config(rng: random.Random) -> AgentConfig:
    cfg = AgentConfig(max_steps=rng.choice([3, 4, 5, 6]))
    ch = cfg.context_history
    ch.enabled = rng.random() < 0.7
    ch.policy.config.images.keep_last_groups = rng.choice([1, 2, 3])
    ch.policy.config.images.protect_initial_context = rng.random() < 0.7
    ch.policy.config.reasoning.keep_last_blocks = rng.choice([0, 1, 2, 3])
    return cfg


_NOTE = re.compile(r"note([A-Z]?)(\d)")
"""A note label: its tag (`doors_memory`'s note has none; `doors_notes`' are A, B, C) and its digit."""
_HIDDEN = re.compile(r"door([A-Z]?)\?")
"""A hidden door's label (`door?`, `doorA?`): its tag names the note whose digit opens it."""
DISTRACTOR_TAGS = frozenset("C")
"""`doors_notes`' tag of the note no room needs (env.note_layout), left out of the build's fact recall."""


class MemoryPlay(NamedTuple):
    """How the summarizing teacher plays one memory task."""

    rooms: tuple[int, ...]
    """Room counts its episodes draw from."""
    thresholds: tuple[int, int]
    """Range its per-episode summary thresholds (token counts) are drawn from: the task's config
    (`threshold_tokens`) lies inside it, and the rest lets summaries fall before other rooms too."""
    note_names: tuple[str, ...]
    """The note labels' names, added to the look-up drills' objects."""


MEMORY_PLAY = {
    "doors_memory": MemoryPlay(rooms=(3, 4, 4, 5), thresholds=(150, 330), note_names=("note",)),
    "doors_notes": MemoryPlay(rooms=(7, 7, 8), thresholds=(230, 400), note_names=("noteA", "noteB", "noteC")),
}
"""doors_memory: the note in room 2, the hidden door last (configs/summarize.yaml: [210, 250]);
doors_notes: three notes in rooms 2-4 (2-5 of 8), the hidden doors last (configs/summarize_notes.yaml:
[270, 316], prompts of ~66..450 tokens before the 1st..7th call)."""
SUMMARIZE_SHARE = 0.8
"""Share of the summarizing build's episodes played with summarizing compaction (the rest: recency)."""


SUMMARY_LEAD = "keep\n"
"""What the teacher's summary opens with: a word, then a newline, so the label after it tokenizes as a
picture's label does (`\n`, `note`, `7`; right after `>` it would be one `>note` token), and copying
the note's digit is the same look-up as reading a picture."""
SUMMARY_SEP = "\n"
"""Between the notes a summary keeps (doors_notes): one a line, as a picture lists them. Joined by a
space, each note after the first tokenizes otherwise (` note`, `B`, `5` where a picture has `noteB`,
`5`), and a last room cannot find it: built from scratch (3000 episodes, 1200 steps, read drills 2) a
doors_notes model read a held note 0.26 with spaces (`--size small`), 0.82 with newlines (`tiny`;
docs/experiments/summarize/notes-task.md)."""


def prompt_text(messages) -> str:
    return "\n".join(parts_text(m.get("content") or "") for m in messages)


def is_summary_request(messages) -> bool:
    return (bool(messages) and messages[-1]["role"] == "user"
            and parts_text(messages[-1]["content"] or "") == SUMMARY_REQUEST)


class SummarizingTeacher:
    """The memory tasks' noisy teacher (`--summarize`; `doors_memory`, `doors_notes`). Rooms: reads
    the newest picture's door with probability p_correct, else another object's label. A hidden door
    (`door<T>?`): answers from the newest `note<T><d>` anywhere in its prompt (a picture or a
    summary), else guesses a digit the picture does not show. The summary request: each note its
    prompt shows (the newest of each tag, in the order first shown), each kept with probability
    p_recall; when it keeps none, the newest picture's door label (`door?` before doors_memory's last
    room: a summary that drops the fact that matters); after SUMMARY_LEAD. `count` is the token
    count the summarizing policy reads."""

    def __init__(self, rng: random.Random, p_correct: float, p_recall: float, render, count):
        self.rng, self.p, self.p_recall, self.render, self.count = rng, p_correct, p_recall, render, count
        self.examples: list[tuple[str, str]] = []

    def _labels(self, text: str) -> list[str]:
        return _PICTURE.findall(text)[-1].split("\n")[1:]

    def _summary(self, text: str) -> str:
        notes: dict[str, str] = {}
        for tag, digit in _NOTE.findall(text):
            notes[tag] = digit  # the newest of each tag, at its first place
        kept = [f"note{tag}{digit}" for tag, digit in notes.items() if self.rng.random() < self.p_recall]
        if kept:
            return f"<summary>{SUMMARY_LEAD}{SUMMARY_SEP.join(kept)}</summary>"
        door = next(label for label in self._labels(text) if label.startswith("door"))
        return f"<summary>{SUMMARY_LEAD}{door}</summary>"

    def _room(self, text: str) -> str:
        labels = self._labels(text)
        door = next(label for label in labels if label.startswith("door"))
        if hidden := _HIDDEN.fullmatch(door):
            notes = [d for tag, d in _NOTE.findall(text) if tag == hidden[1]]
            shown = {label[-1] for label in labels}
            name, num = (f"note{hidden[1]}", notes[-1]) if notes else \
                (door, self.rng.choice([d for d in "0123456789" if d not in shown]))
        elif self.rng.random() < self.p:
            name, num = door[:-1], door[-1]
        else:
            other = self.rng.choice([label for label in labels if not label.startswith(("door", "note"))])
            name, num = other[:-1], other[-1]
        return open_reply(name, num)

    async def chat(self, messages, tools, params, key, required_prefix):
        text = prompt_text(messages)
        reply = self._summary(text) if is_summary_request(messages) else self._room(text)
        self.examples.append((self.render(messages, tools), reply + EOS_TOKEN))
        tokens = {"prompt_token_ids": [], "generation_token_ids": [], "generation_log_probs": []}
        return ModelReply(parse_reply(reply), "stop", tokens)

    async def count_tokens(self, messages, tools, key, required_prefix):
        return self.count(messages, tools)


def summarize_agent_config(rng: random.Random, rooms: int,
                           thresholds: tuple[int, int] = MEMORY_PLAY["doors_memory"].thresholds) -> AgentConfig:
    """The summarizing policy with a random threshold (so summaries fall before any room), or
    (1 - SUMMARIZE_SHARE of the episodes) a recency setting, so the model also sees dropped pictures."""
    if rng.random() >= SUMMARIZE_SHARE:
        cfg = random_agent_config(rng)
        cfg.max_steps = rooms + rng.choice([0, 1])
        return cfg
    cfg = AgentConfig(max_steps=rooms + rng.choice([0, 1]))
    policy = cfg.context_history.policy
    policy.type = "summarize"
    lo = rng.randrange(*thresholds)
    policy.summarize.threshold_tokens = [lo, lo + rng.choice([0, 20, 40])]
    return cfg


def summarizing_transcripts(n: int, p_correct: float, p_recall: float, seed: int, render, count,
                            task: str = "doors_memory") -> list[tuple[str, str]]:
    """`n` episodes of memory task `task` (MEMORY_PLAY) played by the SummarizingTeacher through
    run_episode (summarizing compaction)."""
    rng = random.Random(seed)
    teacher = SummarizingTeacher(rng, p_correct, p_recall, render, count)
    play_cfg = MEMORY_PLAY[task]

    async def play():
        for i in range(n):
            rooms = rng.choice(play_cfg.rooms)
            env = DoorsEnv(seed=rng.randrange(2**31), num_rooms=rooms, task=task)
            row = {
                "responses_create_params": {"input": env.initial_input(), "tools": TOOLS},
                "task": {"env": task, "seed": env.seed, "num_rooms": rooms},
                "_minirl": {"step": 0, "group": i, "rollout": 0, "attempt": 0},
            }
            await run_episode(row, summarize_agent_config(rng, rooms, play_cfg.thresholds), teacher)

    asyncio.run(play())
    return teacher.examples


def teacher_transcripts(n: int, p_correct: float, seed: int, render) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    teacher = ScriptedTeacher(rng, p_correct, render)

    async def play():
        for _ in range(n):
            env = DoorsEnv(seed=rng.randrange(2**31), num_rooms=rng.choice([1, 2, 2, 3]))
            row = {
                "responses_create_params": {"input": env.initial_input(), "tools": TOOLS},
                "task": {"env": "doors", "seed": env.seed, "num_rooms": env.num_rooms},
            }
            await run_episode(row, random_agent_config(rng), teacher)

    asyncio.run(play())
    return teacher.examples


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS])
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=SPECIAL_TOKENS[1:],
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf


def lookup_drill(rng: random.Random, tokenizer, pixels: int = 12, queries: int = 8,
                 extra: tuple = ()) -> tuple[list[int], list[int]]:
    """A picture followed by `queries` think blocks naming a random label: loss on the digits only.
    `extra` adds label names (`note` for the summarizing build)."""
    names = rng.sample(OBJECTS + ("door",) + extra, 4)
    nums = [rng.randrange(10) for _ in names]
    picture = " ".join(rng.choice(COLORS) for _ in range(pixels)) + "\n" \
        + "\n".join(f"{n}{d}" for n, d in zip(names, nums))
    text = f"<|im_start|>user\nRoom 1.<image>{picture}</image>{EOS_TOKEN}\n<|im_start|>assistant\n"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    targets = []
    for _ in range(queries):
        q = rng.randrange(len(names))
        ids += tokenizer("<think>" + names[q], add_special_tokens=False)["input_ids"]
        targets.append(len(ids))
        ids += tokenizer(f"{nums[q]}</think>", add_special_tokens=False)["input_ids"]
    return ids, targets


DRILL_REPLIES = {
    "summary": lambda tag, d: f"{SUMMARY_OPEN}{SUMMARY_LEAD}note{tag}{d}{SUMMARY_CLOSE}",
    "hidden_door": lambda tag, d: open_reply(f"note{tag}", d),
}
"""What a note drill answers, by the kind of teacher prompt it redraws: the summary that keeps the note
(`--note-drills`), or the last room's read of the note its hidden door names (`--read-drills`). Loss
falls on the digit, and in the last room on the note's label too (a note in the context is always read:
drilling the digit alone left the model writing `door?`, the no-note guess, in 63 of 100 last rooms);
on the summary's digit alone (whether it keeps the note is the teacher's p_recall)."""


def hidden_tag(prompt: str) -> str:
    """The tag of the hidden door a last-room prompt shows (`door?`: "", `doorA?`: "A")."""
    return _HIDDEN.fullmatch(_PICTURE.findall(prompt)[-1].split("\n")[-1])[1]


def note_drills(examples, tokenizer, copies: int, seed: int,
                kind: str = "summary") -> list[tuple[list[int], list[int]]]:
    """Copy drills for a note's digit: each teacher prompt of `kind` (a summary request, or with
    `hidden_door` the last room) that shows the note it needs (the summary: the untagged note of
    doors_memory; the last room: the note its hidden door's tag names), `copies` times with every note's
    digit redrawn, one digit per tag (so no digit can be memorised), answered DRILL_REPLIES[kind]. So
    how often a summary keeps the note stays what the teacher's own replies teach (p_recall), and on
    doors_notes the last room must pick the note of its door's tag from the others. Drilling one kind
    alone moves the copy there and off the other (see the module docstring)."""
    rng = random.Random(seed)
    reply = DRILL_REPLIES[kind]
    drills = []
    for prompt in (p for p, r in examples if example_kind(p, r) == kind):
        tag = hidden_tag(prompt) if kind == "hidden_door" else ""
        tags = list(dict.fromkeys(t for t, _ in _NOTE.findall(prompt)))
        if tag not in tags:
            continue
        label = f"note{tag}"
        lead = reply(tag, "").split(label)[0]
        head = tokenizer(lead + label, add_special_tokens=False)["input_ids"]
        before = len(head) - len(tokenizer(lead, add_special_tokens=False)["input_ids"]) \
            if kind == "hidden_door" else 0  # the label's tokens train in the last room
        for _ in range(copies):
            digits = {t: str(rng.randrange(10)) for t in tags}
            redrawn = _NOTE.sub(lambda m: f"note{m[1]}{digits[m[1]]}", prompt)
            p = tokenizer(redrawn, add_special_tokens=False)["input_ids"]
            r = tokenizer(reply(tag, digits[tag]) + EOS_TOKEN, add_special_tokens=False)["input_ids"]
            assert r[: len(head)] == head and tokenizer.decode(r[len(head)]) == digits[tag], \
                "the digit must be its own token"
            drills.append((p + r, list(range(len(p) + len(head) - before, len(p) + len(head) + 1))))
    return drills


def sft(model, tokenizer, examples, steps: int, batch: int, lr: float, seed: int, drill_fraction: float,
        drill_extra: tuple = (), extra: list[tuple[list[int], list[int]]] = ()) -> list[float]:
    """Fine-tune on the teacher's replies (loss on reply tokens), plus `extra` pre-tokenized sequences
    with their own loss positions (note_drills) in the same length-sorted pool, and look-up drills."""
    if steps == 0:  # an untrained model (bench/vs_trl.py's 12M variant)
        return []
    rng = random.Random(seed)
    encoded = list(extra)
    for prompt, reply in examples:
        p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        r = tokenizer(reply, add_special_tokens=False)["input_ids"]
        encoded.append((p + r, list(range(len(p), len(p) + len(r)))))
    encoded.sort(key=lambda e: len(e[0]))  # windows of similar lengths: little padding
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.05)
    drills = int(batch * drill_fraction)
    losses = []
    model.train()
    for step in range(steps):
        start = rng.randrange(0, max(1, len(encoded) - batch))
        seqs = encoded[start : start + batch - drills] \
            + [lookup_drill(rng, tokenizer, extra=drill_extra) for _ in range(drills)]
        width = max(len(s) for s, _ in seqs)
        ids = torch.full((len(seqs), width), tokenizer.pad_token_id)
        labels = torch.full((len(seqs), width), -100)
        attn = torch.zeros((len(seqs), width), dtype=torch.long)
        for row, (s, targets) in enumerate(seqs):
            ids[row, : len(s)] = torch.tensor(s)
            labels[row, targets] = torch.tensor([s[t] for t in targets])
            attn[row, : len(s)] = 1
        loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if step % 200 == 0 or step == steps - 1:
            print(f"  sft step {step:5d}  loss {loss.item():.4f}", flush=True)
    model.eval()
    return losses


@torch.no_grad()
def quality(model, tokenizer, examples, n: int, seed: int) -> dict:
    """Sample one reply per held-out prompt at temperature 1: how often the model reads the door,
    and how often its call carries the right code (what the reward pays for)."""
    torch.manual_seed(seed)
    door = right = wellformed = 0
    for prompt, reply in examples[:n]:
        ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
        out = model.generate(ids, max_new_tokens=40, do_sample=True, temperature=1.0, top_k=0,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        msg = parse_reply(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
        want = parse_reply(reply.removesuffix(EOS_TOKEN))["tool_calls"][0]["function"]["arguments"]
        wellformed += bool(msg["tool_calls"])
        door += (msg["reasoning"] or "").startswith("door")
        right += (bool(msg["tool_calls"])
                  and json.loads(msg["tool_calls"][0]["function"]["arguments"]) == json.loads(want))
    return {"door_rate": door / n, "right_code_rate": right / n, "wellformed_rate": wellformed / n}


def summarizing_corpus(args, render):
    """The summarizing build's teacher transcripts, its held-out set (p_correct = p_recall = 1) and its
    tokenizer. Played twice: first with a rough count (3 characters a token) to train the tokenizer
    on the protocol's text, then with that tokenizer's counts, as the generation server counts."""
    if args.init:  # a built model's tokenizer: the corpus is played once, with its counts
        tokenizer = AutoTokenizer.from_pretrained(args.init)
    else:
        rough = lambda messages, tools: len(render(messages, tools)) // 3  # noqa: E731
        first = summarizing_transcripts(args.episodes, args.p_correct, args.p_recall, args.seed, render, rough,
                                        args.task)
        tokenizer = train_tokenizer([p + r for p, r in first[:6000]], args.vocab_size)

    def count(messages, tools):
        return len(tokenizer(render(messages, tools), add_special_tokens=False)["input_ids"])

    examples = summarizing_transcripts(args.episodes, args.p_correct, args.p_recall, args.seed, render, count,
                                       args.task)
    held_out = summarizing_transcripts(3 * args.eval_n, 1.0, 1.0, args.seed + 1, render, count, args.task)
    kinds = [example_kind(p, r) for p, r in examples]
    print(f"teacher: {len(examples)} model calls from {args.episodes} episodes "
          f"({kinds.count('summary')} summaries, {kinds.count('hidden_door')} hidden doors)", flush=True)
    return examples, held_out, tokenizer


def example_kind(prompt: str, reply: str) -> str:
    """`summary` (a summary call), `hidden_door` (the last room, `door?`), or `room`."""
    if reply.startswith("<summary>"):
        return "summary"
    return "hidden_door" if _HIDDEN.fullmatch(_PICTURE.findall(prompt)[-1].split("\n")[-1]) else "room"


@torch.no_grad()
def summary_quality(model, tokenizer, examples, n: int, seed: int) -> dict:
    """Sample at temperature 1 on held-out prompts of each kind (the teacher with p = 1): how often a
    summary carries the note's fact (recall, where the prompt shows a note), how often the hidden
    door is opened from a note in the context, and how often an ordinary room's door is read.
    `summary_recall`: the whole summary as the teacher's (every note shown, in order);
    `summary_fact_recall`: per needed note shown (not a distractor), whether the summary holds it
    verbatim, as the run's summary_recall metric counts."""
    torch.manual_seed(seed)
    hits = {"summary_recall": [], "summary_fact_recall": [], "hidden_door_rate": [], "door_rate": [],
            "summary_wellformed": []}
    for prompt, reply in examples:
        kind = example_kind(prompt, reply)
        want = reply.removesuffix(EOS_TOKEN)
        if kind == "summary" and "note" not in want or kind == "hidden_door" and "<think>note" not in want:
            continue
        key = {"summary": "summary_recall", "hidden_door": "hidden_door_rate", "room": "door_rate"}[kind]
        if len(hits[key]) >= n:
            continue
        ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
        out = model.generate(ids, max_new_tokens=40, do_sample=True, temperature=1.0, top_k=0,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        text = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        if kind == "summary":
            hits["summary_wellformed"].append(bool(summary_text(text)))
            hits[key].append(summary_text(text) == summary_text(want))
            got = summary_text(text) or ""
            hits["summary_fact_recall"] += [f"note{t}{d}" in got
                                            for t, d in _NOTE.findall(want) if t not in DISTRACTOR_TAGS]
        else:
            msg, ref = parse_reply(text), parse_reply(want)
            got = msg["tool_calls"] and json.loads(msg["tool_calls"][0]["function"]["arguments"])
            hits[key].append(got == json.loads(ref["tool_calls"][0]["function"]["arguments"]))
    return {k: round(sum(v) / max(1, len(v)), 3) for k, v in hits.items()} | {f"{k}_n": len(v) for k, v in hits.items()}


def new_model(args, tokenizer) -> Qwen2ForCausalLM:
    """A freshly initialised Qwen2 of `--size` for `tokenizer`, or with `--init` the saved model."""
    if args.init:
        return Qwen2ForCausalLM.from_pretrained(args.init)
    vocab = max(len(tokenizer), args.pad_vocab_to)
    config = Qwen2Config(
        vocab_size=(vocab + 63) // 64 * 64,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.convert_tokens_to_ids(PAD_TOKEN),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
        **SIZES[args.size],
    )
    return Qwen2ForCausalLM(config)


def chat_renderer():
    """`render(messages, tools)`: the chat template's text for a model call (no tokenizer needed)."""
    bootstrap = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE()))
    bootstrap.chat_template = CHAT_TEMPLATE

    def render(messages, tools):
        return bootstrap.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)

    return render


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--episodes", type=int, default=4000)
    ap.add_argument("--p-correct", type=float, default=None,
                    help="teacher reads the door (default 0.3; 0.9 with --summarize)")
    ap.add_argument("--vocab-size", type=int, default=512, help="BPE vocabulary learned from the corpus")
    ap.add_argument("--pad-vocab-to", type=int, default=0, help="grow the embedding to this many rows (e.g. 32768)")
    ap.add_argument("--sft-steps", type=int, default=1200)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--drill-fraction", type=float, default=0.25, help="share of each batch that is look-up drills")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--task", choices=["doors", *MEMORY_PLAY], default="doors", help="a memory task needs --summarize")
    ap.add_argument("--summarize", action="store_true",
                    help="the SummarizingTeacher on a memory task (models/tiny-summarize, models/tiny-summarize-notes)")
    ap.add_argument("--p-recall", type=float, default=0.5, help="--summarize: a summary carries the note's fact")
    ap.add_argument("--init", default=None,
                    help="--summarize: fine-tune this built model (its weights and tokenizer) instead of a fresh one")
    ap.add_argument("--eval-n", type=int, default=100, help="--summarize: held-out samples per kind for the scores")
    ap.add_argument("--note-drills", type=int, default=0,
                    help="--summarize: copy drills per teacher summary request showing a note")
    ap.add_argument("--read-drills", type=int, default=0,
                    help="--summarize: copy drills per teacher last-room prompt showing a note")
    args = ap.parse_args(argv)
    if args.summarize != (args.task in MEMORY_PLAY):
        ap.error(f"--summarize goes with --task {' or '.join(MEMORY_PLAY)}")
    if args.init and not args.summarize:
        ap.error("--init goes with --summarize")
    if args.task != "doors_memory" and args.note_drills:
        ap.error("--note-drills is built for doors_memory's untagged note only (a doors_notes summary keeps several)")
    if args.p_correct is None:
        args.p_correct = 0.9 if args.summarize else 0.3
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t0 = time.time()

    render = chat_renderer()
    if args.summarize:
        examples, held_out, tokenizer = summarizing_corpus(args, render)
    else:
        examples = teacher_transcripts(args.episodes, args.p_correct, args.seed, render)
        held_out = teacher_transcripts(200, 1.0, args.seed + 1, render)
        print(f"teacher: {len(examples)} model calls from {args.episodes} episodes", flush=True)
        tokenizer = train_tokenizer([p + r for p, r in examples[:4000]], args.vocab_size)
    model = new_model(args, tokenizer)
    vocab = model.config.vocab_size
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params / 1e6:.2f}M parameters, vocab {vocab} ({len(tokenizer)} used)", flush=True)

    drill_extra = MEMORY_PLAY[args.task].note_names if args.summarize else ()
    extra = []
    if args.summarize:
        extra = note_drills(examples, tokenizer, args.note_drills, args.seed)
        extra += note_drills(examples, tokenizer, args.read_drills, args.seed + 1, "hidden_door")
    if extra:
        print(f"note drills: {len(extra)} (teacher prompts showing a note: summary requests x {args.note_drills}, "
              f"last rooms x {args.read_drills})", flush=True)
    sft(model, tokenizer, examples, args.sft_steps, args.batch, args.lr, args.seed, args.drill_fraction,
        drill_extra, extra)
    if args.summarize:
        scores = summary_quality(model, tokenizer, held_out, args.eval_n, args.seed)
    else:
        scores = quality(model, tokenizer, held_out, 100, args.seed)
    print(f"warm start: {scores}", flush=True)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    if args.init:  # its tokenizer files verbatim (a re-save rewrites its config)
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            shutil.copyfile(Path(args.init) / name, out / name)
    else:
        tokenizer.save_pretrained(out)
    summarize_only = ("task", "summarize", "p_recall", "eval_n", "note_drills", "read_drills", "init")
    recorded = {k: v for k, v in vars(args).items() if args.summarize and (k != "init" or v) or k not in summarize_only}
    info = {"args": recorded, "parameters": params, "vocab_size": vocab, **scores,
            "build_s": round(time.time() - t0, 1)}
    (out / "build_info.json").write_text(json.dumps(info, indent=2) + "\n")
    print(f"saved {out} in {time.time() - t0:.0f}s", flush=True)


if __name__ == "__main__":
    main()
