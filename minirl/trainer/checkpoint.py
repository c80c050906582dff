"""Checkpoints: `run_dir/checkpoints/step_N/`, holding the policy (weights, optimizer, tokenizer),
the RNG, the data position, the failure policy's run-scoped counters and, async, the rollout pump's
buffer (`async_buffer.pkl`: the finished groups not yet trained with their weight versions, the
groups in flight; pickled dataclasses, read back only from a checkpoint whose manifest verifies). The fault stream needs no
position of its own: it is a function of (step, group, rollout, attempt), so resuming at step N
resumes it too.

A checkpoint is written into a temporary directory; `state.json`, written last, carries a manifest
of every other file (relative path, size, sha256); every file and directory is fsynced, then the
directory is renamed to `step_N` and its parent fsynced.

Invariant: a checkpoint is trusted only when its manifest verifies (an empty manifest does not);
`select` never resumes from one that does not (`auto` falls back to the newest that does and reports
each one skipped, an explicit path raises CheckpointError naming the path and the file), and
resuming repeats no step and skips none.

`state.json` also holds the run's resolved config (`config`). A resume whose config changes the
step's shape or the staleness window (RESUME_KEYS) is refused before Ray starts, with one
ConfigError line naming each changed key with its old and new values: the restored data position,
buffer and cursor are only meaningful under the config that wrote them.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

STATE = "state.json"
ASYNC_BUFFER = "async_buffer.pkl"
RESUME_KEYS = ("grpo.num_prompts_per_step", "grpo.num_generations_per_prompt", "async_rl.enabled")
"""Keys a resume must keep: they fix which prompt groups make a step."""
ASYNC_RESUME_KEYS = ("async_rl.sampler.name", "async_rl.sampler.max_staleness_versions", "async_rl.max_buffered_rollouts",
                     "async_rl.rollout_failure.on_dropped_prompt")
"""...and, when either run is async, these too: the buffer's cursor, its kept groups' window, its size."""


class CheckpointError(RuntimeError):
    """The checkpoint `checkpoint.resume` names cannot be trusted."""


def directory(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
    files = sorted(p for p in tmp.rglob("*") if p.is_file())
    manifest = {p.relative_to(tmp).as_posix(): {"size": p.stat().st_size, "sha256": _sha256(p)} for p in files}
    (tmp / STATE).write_text(json.dumps({**state, "manifest": manifest}, indent=2))
    for p in [*files, tmp / STATE, *sorted(d for d in tmp.rglob("*") if d.is_dir()), tmp]:
        _fsync(p)
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    _fsync(root)
    if keep_last_k > 0:
        for old in checkpoints(run_dir)[:-keep_last_k]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def checkpoints(run_dir: Path) -> list[Path]:
    """Every `step_N` directory, oldest first, verified or not."""
    root = directory(run_dir)
    found = [p for p in root.glob("step_*") if p.is_dir() and p.name[5:].isdigit()] if root.exists() else []
    return sorted(found, key=lambda p: int(p.name[5:]))


def verify(path: Path) -> str | None:
    """None when every file of the manifest is there with its size and sha256; else why not, naming the file."""
    try:
        manifest = json.loads((path / STATE).read_text())["manifest"]
    except (OSError, ValueError, TypeError) as exc:
        return f"{STATE} unreadable ({exc})"
    except KeyError:
        return f"{STATE} has no manifest (written before manifests existed): cannot verify"
    if not isinstance(manifest, dict) or not manifest:
        return f"{STATE} has an empty manifest: nothing to verify"
    for rel, want in manifest.items():
        file = path / rel
        if not file.is_file():
            return f"{rel}: missing"
        if (size := file.stat().st_size) != want["size"]:
            return f"{rel}: size {size} != {want['size']}"
        if _sha256(file) != want["sha256"]:
            return f"{rel}: sha256 mismatch"
    return None


def latest_verified(run_dir: Path) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest checkpoint that verifies (None if none does), and (path, reason) for each newer one."""
    skipped = []
    for path in reversed(checkpoints(run_dir)):
        if (reason := verify(path)) is None:
            return path, skipped
        skipped.append((path, reason))
    return None, skipped


def select(run_dir: Path, resume: str) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The checkpoint `checkpoint.resume` names (None: start from step 0), and those skipped on the way."""
    if resume == "none":
        return None, []
    if resume == "auto":
        return latest_verified(run_dir)
    if (reason := verify(Path(resume))) is not None:
        raise CheckpointError(
            f"checkpoint.resume={resume} cannot be trusted: {reason} "
            "(name another checkpoint, or use checkpoint.resume=auto to take the newest that verifies)"
        )
    return Path(resume), []


def read_state(path: Path) -> dict:
    return json.loads((path / STATE).read_text())


def _lookup(tree: dict, key: str):
    for part in key.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return "<unset>"
        tree = tree[part]
    return tree


def check_resume(cfg) -> None:
    """Before Ray starts: the checkpoint `checkpoint.resume` would take must have been written under
    the same RESUME_KEYS (and, async, ASYNC_RESUME_KEYS); else ConfigError naming each changed key.
    A checkpoint written before configs were saved is not checked. Which checkpoint is taken, and
    what is skipped on the way, is decided (and reported) again by `select` once the run starts."""
    from dataclasses import asdict

    from minirl.config import ConfigError

    if cfg.checkpoint.resume == "none" or (cfg.checkpoint.resume == "auto" and cfg.run_dir is None):
        return
    try:
        path, _ = select(Path(cfg.run_dir or "."), cfg.checkpoint.resume)
    except CheckpointError:
        return  # the run reports it, as before
    old = read_state(path).get("config") if path is not None else None
    if not isinstance(old, dict):
        return
    new = asdict(cfg)
    keys = RESUME_KEYS + (ASYNC_RESUME_KEYS if _lookup(old, "async_rl.enabled") is True or cfg.async_rl.enabled else ())
    changed = [(k, _lookup(old, k), _lookup(new, k)) for k in keys if _lookup(old, k) != _lookup(new, k)]
    if changed:
        raise ConfigError(changed[0][0], "differs from the checkpoint resumed (" + ", ".join(
            f"{k}: {a!r} -> {b!r}" for k, a, b in changed) + f"; {path}): a resume must keep the step's shape and "
            "the staleness window; set them back, or start a new run_dir")


def check_writable(run_dir: Path) -> None:
    """Before Ray starts: the checkpoint directory can be made and written (a probe file, removed)."""
    from minirl.config import ConfigError

    root = directory(run_dir)
    probe = root / f".probe_{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise ConfigError("checkpoint.enabled", f"checkpoints cannot be written to {root}: {exc.strerror or exc} "
                          "(make it writable, or set checkpoint.enabled=false)") from None
