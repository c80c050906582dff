"""Where a doors_notes warm start's read of a held note fails, step by step (issue 54, dev tool).

A last room that hides its door (`doorB?`) is read as `<think>noteB5</think>`: the model must write the
note of the door's tag, then copy that note's digit from the summary. Sampling (build_tiny_model's
`hidden_door_rate`) says only how often the whole read comes out right. This scores each step with the
teacher's own reply forced (held-out teacher prompts, p_correct = p_recall = 1, as the build's scores):
the mean probability the model gives each token of the read, by kind: `note` (the label's name), `tag`
(the tag letter; also `P(other tags)`, the mass on the other letters), `note+tag` (a tokenizer learned
on doors_notes writes `noteB` as one token), `digit`. Chance for a tag is 1/2 (A or B; the distractor C
is never needed), for the digit 1/10.

    python scripts/probe_reads.py models/tiny-summarize-notes [--n 150]

Figures: docs/experiments/summarize/notes-task.md ("Why the warm start cannot read a held note").
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch
from transformers import AutoTokenizer, Qwen2ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
import build_tiny_model as build  # noqa: E402

TAGS = "ABC"


def kind(text: str) -> str:
    if text.isdigit():
        return "digit"
    if text in TAGS:
        return "tag"
    return "note+tag" if text.startswith("note") and text[4:] in TAGS and len(text) == 5 else text.strip() or "\\n"


@torch.no_grad()
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--n", type=int, default=150, help="held-out last rooms that hold their note")
    args = ap.parse_args(argv)
    tok = AutoTokenizer.from_pretrained(args.model)
    model = Qwen2ForCausalLM.from_pretrained(args.model).eval()
    render = build.chat_renderer()

    def count(messages, tools):
        return len(tok(render(messages, tools), add_special_tokens=False)["input_ids"])

    held = build.summarizing_transcripts(300, 1.0, 1.0, 1, render, count, "doors_notes")
    tag_ids = {t: tok(t, add_special_tokens=False)["input_ids"] for t in TAGS}
    probs, seen = collections.defaultdict(list), 0
    for prompt, reply in held:
        read = reply.split("</think>")[0]
        if build.example_kind(prompt, reply) != "hidden_door" or "note" not in read:
            continue
        seen += 1
        if seen > args.n:
            break
        p = tok(prompt, add_special_tokens=False)["input_ids"]
        r = tok(read, add_special_tokens=False)["input_ids"]  # `<think>`, then the read
        dist = model(torch.tensor([p + r])).logits[0, len(p) - 1:].softmax(-1)
        for j in range(1, len(r)):
            text = tok.decode([r[j]])
            probs[step := kind(text)].append(dist[j, r[j]].item())
            if step == "tag":
                probs["P(other tags)"].append(sum(dist[j, ids[0]].item() for t, ids in tag_ids.items() if t != text))
    print(f"{args.model}: {min(seen, args.n)} held-out last rooms, teacher-forced")
    for name, values in probs.items():
        print(f"  {name:14s} {sum(values) / len(values):.3f}  (n={len(values)})")


if __name__ == "__main__":
    main()
