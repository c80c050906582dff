"""Checkpoints: `run_dir/checkpoints/step_N/`, written atomically (temporary directory, then
rename), holding the policy (weights, optimizer, tokenizer), the RNG, the data position and the
failure policy's run-scoped counters. The fault stream needs no position of its own: it is a
function of (step, group, rollout, attempt), so resuming at step N resumes it too.

Invariant: a directory named `step_N` is complete (it has `state.json`, written last, before the
rename); `latest` never returns a partial one, and resuming from it repeats no step and skips none.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path


def directory(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def save(run_dir: Path, step: int, state: dict, write_policy, model_dir: str, keep_last_k: int) -> Path:
    """`write_policy(tmp_dir)` writes the trainer's part; `state` is the controller's and loop's."""
    root = directory(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step}"
    tmp = root / f".tmp_step_{step}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    write_policy(str(tmp))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        src = Path(model_dir) / name
        if src.exists():
            shutil.copy(src, tmp / "policy" / name)
    (tmp / "state.json").write_text(json.dumps(state, indent=2))
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    if keep_last_k > 0:
        for old in completed(run_dir)[:-keep_last_k]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def completed(run_dir: Path) -> list[Path]:
    root = directory(run_dir)
    if not root.exists():
        return []
    done = [p for p in root.glob("step_*") if (p / "state.json").exists()]
    return sorted(done, key=lambda p: int(p.name.split("_")[1]))


def latest(run_dir: Path) -> Path | None:
    done = completed(run_dir)
    return done[-1] if done else None


def read_state(path: Path) -> dict:
    return json.loads((path / "state.json").read_text())
