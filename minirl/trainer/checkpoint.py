"""Checkpoints: `run_dir/checkpoints/step_N/`, holding the policy (weights, optimizer, tokenizer), the
RNG, the data position, the failure policy's run-scoped counters, the resolved config and, async,
the rollout pump's buffer; `state.json`, written last, carries a manifest of every other file.
Also the checks before Ray starts: the resume's config and model (`check_resume`), the run_dir
(`claim_run_dir`) and the default one (`new_run_dir`).

Invariant: a checkpoint is trusted only when its manifest verifies (an empty manifest does not);
`select` never resumes from one that does not (`auto` falls back to the newest that does and reports
each one skipped, an explicit path raises CheckpointError naming the path and the file), and
resuming repeats no step and skips none. A resume from an older checkpoint sets the run_dir's newer
ones aside (`set_aside_newer`), so they are never taken for the resumed run's; `save` never prunes the
checkpoint it writes.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import itertools
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Callable

STATE = "state.json"
ASYNC_BUFFER = "async_buffer.pkl"
RESUME_KEYS = ("grpo.num_prompts_per_step", "grpo.num_generations_per_prompt", "async_rl.enabled")
"""Keys a resume must keep: they fix which prompt groups make a step."""
ASYNC_RESUME_KEYS = ("async_rl.sampler.name", "async_rl.sampler.max_staleness_versions",
                     "async_rl.max_buffered_rollouts", "async_rl.rollout_failure.on_dropped_prompt")
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
    """`write_policy(tmp_dir)` writes the trainer's part; `state` is the controller's and loop's.

    Written into a temporary directory; `state.json`, written last, carries a manifest of every other
    file (relative path, size, sha256); every file and directory is fsynced, then the directory is
    renamed to `step_N` and its parent fsynced. `keep_last_k` > 0 then keeps it and the newest
    `keep_last_k - 1` checkpoints of earlier steps, and removes the older ones. Async, the rollout
    pump's buffer is `async_buffer.pkl` (the finished groups not yet trained with their weight
    versions, the groups in flight; pickled dataclasses, read back only from a checkpoint whose
    manifest verifies). The fault stream needs no position of its own: it is a function of (step,
    group, rollout, attempt), so resuming at step N resumes it too."""
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
    if keep_last_k > 0:  # this one and the newest keep_last_k - 1 before it; never this one, nor a newer one
        older = [p for p in checkpoints(run_dir) if _step(p) < step]
        for old in older[: max(len(older) - (keep_last_k - 1), 0)]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def _step(path: Path) -> int:
    return int(path.name[5:])


ABANDONED = "abandoned_"
"""The prefix `set_aside_newer` gives a checkpoint of an abandoned continuation: `checkpoints`, so `select`,
`latest_verified` and pruning, list only `step_N`."""


def set_aside_newer(run_dir: Path, next_step: int) -> list[tuple[Path, Path]]:
    """Each `step_M` of `run_dir` with M >= `next_step` (the continuation that a resume from an older
    checkpoint abandons) renamed to `abandoned_step_M` (`abandoned_step_M.2`, ... when taken), so that
    pruning, `checkpoint.resume=auto` and the SIGTERM line never take it for this run's; nothing is
    deleted. Returns (old path, new path) for each, oldest first."""
    moved = []
    for path in checkpoints(run_dir):
        if _step(path) < next_step:
            continue
        target, n = path.with_name(ABANDONED + path.name), 1
        while target.exists():
            n += 1
            target = path.with_name(f"{ABANDONED}{path.name}.{n}")
        path.rename(target)
        moved.append((path, target))
    if moved:
        _fsync(directory(run_dir))
    return moved


def checkpoints(run_dir: Path) -> list[Path]:
    """Every `step_N` directory, oldest first, verified or not."""
    root = directory(run_dir)
    found = [p for p in root.glob("step_*") if p.is_dir() and p.name[5:].isdigit()] if root.exists() else []
    return sorted(found, key=_step)


def verify(path: Path, hashes: bool = True) -> str | None:
    """None when every file of the manifest is there with its size and (`hashes`) its sha256; else why not,
    naming the file."""
    try:
        manifest = json.loads((path / STATE).read_text())["manifest"]
    except (OSError, ValueError, TypeError) as exc:
        return f"{STATE} unreadable ({exc})"
    except KeyError:
        return f"{STATE} has no manifest (written before manifests existed): cannot verify"
    if not isinstance(manifest, dict) or not manifest:
        return f"{STATE} has an empty manifest: nothing to verify"
    for rel, want in manifest.items():
        if not (isinstance(want, dict) and isinstance(want.get("size"), int) and isinstance(want.get("sha256"), str)):
            return f"{STATE}: the manifest's entry for {rel} is not {{size, sha256}}: {str(want)[:80]}"
        file = path / rel
        if not file.is_file():
            return f"{rel}: missing"
        if (size := file.stat().st_size) != want["size"]:
            return f"{rel}: size {size} != {want['size']}"
        if hashes and _sha256(file) != want["sha256"]:
            return f"{rel}: sha256 mismatch"
    return None


def latest_verified(run_dir: Path, hashes: bool = True) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest checkpoint that verifies (None if none does), and (path, reason) for each newer one.
    `hashes=False` checks each file's presence and size only (no read of the weights)."""
    skipped = []
    for path in reversed(checkpoints(run_dir)):
        if (reason := verify(path, hashes)) is None:
            return path, skipped
        skipped.append((path, reason))
    return None, skipped


def select(run_dir: Path, resume: str) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The checkpoint `checkpoint.resume` names (None: start from step 0), and those skipped on the way.
    `auto` where checkpoints are there and none verifies is a CheckpointError naming each and why: step 0
    would run again over the run's records (its metric lines dropped, its ledger and checkpoints rewritten)."""
    if resume == "none":
        return None, []
    if resume == "auto":
        path, skipped = latest_verified(run_dir)
        if path is None and skipped:
            named = "; ".join(f"{p.name}: {reason}" for p, reason in skipped[:3])
            raise CheckpointError(
                f"checkpoint.resume=auto: no checkpoint in {directory(run_dir)} verifies ({named}"
                f"{'; ...' if len(skipped) > 3 else ''}): starting again at step 0 would run over this run's records; "
                "repair one and name it in checkpoint.resume, or start afresh in another run_dir"
            )
        return path, skipped
    if (reason := verify(Path(resume))) is not None:
        raise CheckpointError(
            f"checkpoint.resume={resume} cannot be trusted: {reason} "
            "(name another checkpoint, or use checkpoint.resume=auto to take the newest that verifies)"
        )
    return Path(resume), []


class RecordError(ValueError):
    """A line of a run's JSONL record, before its last, that is not a JSON record: not a cut tail."""


def keep_records(path: Path, keep: Callable[[dict], bool]) -> list[dict]:
    """On resume: rewrite the run's JSONL record `path` (metrics.jsonl, validation.jsonl) to the records
    `keep` accepts, through a temporary file and `os.replace`, and return them (none when there is no
    file). A last line that is not a JSON record is the tail of a write the run's end cut (a full disk,
    a kill): dropped, with one warning line on stderr naming the file. Any other such line is a
    RecordError naming the file and the line number."""
    if not path.exists():
        return []
    lines = [(n, line) for n, line in enumerate(path.read_text().splitlines(), 1) if line.strip()]
    kept = []
    for i, (n, line) in enumerate(lines):
        try:
            record = json.loads(line)
            wanted = keep(record)
        except (ValueError, KeyError, TypeError) as exc:
            if i < len(lines) - 1:
                raise RecordError(f"{path}, line {n}: not a JSON record ({type(exc).__name__}: {exc}); only a "
                                  "last line cut mid-write is dropped: repair or remove that line, then resume"
                                  ) from None
            print(f"minirl: {path}: dropping its last line {n}, cut mid-write (not a JSON record: "
                  f"{line[:40]!r}{'...' if len(line) > 40 else ''})", file=sys.stderr, flush=True)
            break
        if wanted:
            kept.append((line, record))
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(line + "\n" for line, _ in kept))
    _fsync(tmp)  # on disk before it replaces the records: a machine crash leaves the old file or the new
    os.replace(tmp, path)
    _fsync(path.parent)
    return [record for _, record in kept]


def read_state(path: Path) -> dict:
    return json.loads((path / STATE).read_text())


def _lookup(tree: dict, key: str):
    for part in key.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return "<unset>"
        tree = tree[part]
    return tree


def check_resume(cfg) -> None:
    """Before Ray starts: the checkpoint `checkpoint.resume` would take must hold weights of the shape
    of `policy.model_name` (`check_model`), and have been written under the same RESUME_KEYS (and,
    async, ASYNC_RESUME_KEYS); else ConfigError naming each changed key with its old and new values:
    the restored data position, buffer and cursor are only meaningful under the config that wrote
    them. A checkpoint written before
    configs were saved is not checked for those. An explicit path that does not verify raises `select`'s
    CheckpointError here, before Ray starts and before anything is written. Which checkpoint is taken,
    and what is skipped on the way, is decided (and reported) again by `select` once the run starts."""
    from dataclasses import asdict

    from minirl.config import ConfigError

    if cfg.checkpoint.resume == "none" or (cfg.checkpoint.resume == "auto" and cfg.run_dir is None):
        return
    named = Path(cfg.checkpoint.resume)
    if (named.name.startswith(ABANDONED) and cfg.run_dir is not None
            and named.resolve().parent == directory(Path(cfg.run_dir)).resolve()):
        raise ConfigError("checkpoint.resume", f"{named} is a continuation this run_dir abandoned; resumed in place "
                          "its steps would mix with the newer line's metric lines and checkpoints (a step skipped, "
                          "resume=auto taking the other line): resume it into a new run_dir")
    path, _ = select(Path(cfg.run_dir or "."), cfg.checkpoint.resume)
    if path is None:
        return
    check_model(cfg, path)
    old = read_state(path).get("config")
    if not isinstance(old, dict):
        return
    new = asdict(cfg)
    keys = RESUME_KEYS + (ASYNC_RESUME_KEYS if _lookup(old, "async_rl.enabled") is True or cfg.async_rl.enabled else ())
    changed = [(k, _lookup(old, k), _lookup(new, k)) for k in keys if _lookup(old, k) != _lookup(new, k)]
    if changed:
        raise ConfigError(changed[0][0], "differs from the checkpoint resumed (" + ", ".join(
            f"{k}: {a!r} -> {b!r}" for k, a, b in changed) + f"; {path}): a resume must keep the step's shape and "
            "the staleness window; set them back, or start a new run_dir")


MODEL_SHAPE_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "num_key_value_heads", "tie_word_embeddings")
"""The model config keys a checkpoint's weights must share with `policy.model_name` to load into it."""


def check_model(cfg, path: Path) -> None:
    """The checkpoint's `policy/config.json` (written by save_pretrained) against `policy.model_name`'s
    on MODEL_SHAPE_KEYS; else ConfigError naming both models and each differing key (torch's load
    would end the run after Ray starts with a tab-indented `size mismatch for ...` line). Before Ray,
    for a resume (`check_resume`) and for `minirl.evaluate`."""
    from minirl.config import ConfigError

    try:
        saved = json.loads((path / "policy" / "config.json").read_text())
        model = json.loads((Path(cfg.policy.model_name) / "config.json").read_text())
    except (OSError, ValueError):
        return  # no saved model config to compare (the load then says what it finds)
    changed = [(k, saved.get(k), model.get(k)) for k in MODEL_SHAPE_KEYS if saved.get(k) != model.get(k)]
    if changed:  # a key one file leaves to its transformers default (save_pretrained writes them all): as loaded
        from transformers import AutoConfig

        try:
            saved, model = (AutoConfig.from_pretrained(p).to_dict() for p in (path / "policy", cfg.policy.model_name))
        except (OSError, ValueError):
            return  # not a config transformers reads (the load then says what it finds)
        changed = [(k, saved.get(k), model.get(k)) for k in MODEL_SHAPE_KEYS if saved.get(k) != model.get(k)]
    if not changed:
        return
    try:  # the checkpoint's own config names the model it was written with
        old = read_state(path).get("config")
    except (OSError, ValueError, AttributeError):
        old = None  # none to read: `_lookup` says <unset>
    raise ConfigError("policy.model_name", f"{cfg.policy.model_name} is not the model of the checkpoint resumed "
                      f"({path}, written with policy.model_name={_lookup(old, 'policy.model_name')}): " + ", ".join(
                          f"{k} {a!r} there, {b!r} here" for k, a, b in changed)
                      + "; resume with that model, or start a new run_dir")


DATASET_KEYS = ("data.train_jsonl", "data.shuffle", "env.data_seed", "env.task", "env.num_rooms",
                "env.num_rooms_choices")
"""The keys that choose the prompt stream. A resume may change them (the steps to come then draw their
prompts from the new stream); the resume line and the `resumed` event say which changed."""


def dataset_changes(old, cfg) -> list[str]:
    """`key: old -> new` for each DATASET_KEYS the resumed checkpoint's config (`old`) holds otherwise."""
    from dataclasses import asdict

    if not isinstance(old, dict):
        return []
    new = asdict(cfg)
    return [f"{k}: {_lookup(old, k)!r} -> {_lookup(new, k)!r}"
            for k in DATASET_KEYS if _lookup(old, k) != _lookup(new, k)]


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


RUN_OUTPUTS = ("config.yaml", "endpoints.json", "metrics.jsonl", "events.jsonl", "validation.jsonl", "ledger",
               "tensorboard", "checkpoints", "eval")
"""Every entry a run (and `minirl.evaluate` of its checkpoints) writes in its run_dir; a test holds a real
run to this list. `run_dir_exists=overwrite` removes these and nothing else of the folder."""
REWRITTEN = ("config.yaml", "endpoints.json")
"""...of which each run writes these whole: alone, they hold no record of an earlier run."""


def earlier_run(run_dir: Path) -> list[str]:
    """The records of an earlier run in `run_dir` that a fresh run would write over or mix with: each
    RUN_OUTPUTS entry holding something (a file with bytes, a folder with a file; checkpoints: its step_N)."""
    found = []
    for name in RUN_OUTPUTS:
        path = run_dir / name
        if name in REWRITTEN:
            continue
        if name == "checkpoints":
            found += [f"checkpoints/{p.name}" for p in checkpoints(run_dir)]
        elif ((path.is_file() and path.stat().st_size > 0)
              or (path.is_dir() and any(p.is_file() for p in path.rglob("*")))):
            found.append(name)
    return found


def new_run_dir(root: Path) -> Path:
    """The default run_dir, `root/<UTC timestamp>`, claimed by an atomic mkdir: a second run started in the
    same second (a sweep launching several without run_dir=) gets `<timestamp>-2`, not the first one's."""
    from minirl.config import ConfigError

    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    for n in itertools.count(1):
        path = root / (stamp if n == 1 else f"{stamp}-{n}")
        try:
            path.mkdir(parents=True)
            return path
        except FileExistsError:
            continue
        except OSError as exc:
            raise ConfigError("run_dir", f"cannot write {path}: {exc.strerror or exc}") from None


def claim_run_dir(cfg, run_dir: Path) -> list[str]:
    """Before anything is written: a run that does not continue run_dir's own (`checkpoint.resume=none`,
    or a checkpoint of another folder) into a run_dir that holds an earlier run's records is refused
    (ConfigError naming the folder, `checkpoint.resume` and `run_dir_exists`), or, with
    `run_dir_exists=overwrite`, every RUN_OUTPUTS entry there is removed first: the two runs never mix.
    A resume from run_dir's own checkpoint (`auto`, or a path inside it) keeps them. Returns the entries
    removed."""
    from minirl.config import ConfigError

    resume = cfg.checkpoint.resume
    inside = resume == "auto" or (resume != "none" and run_dir in Path(resume).resolve().parents)
    if cfg.run_dir_exists == "overwrite" and inside:
        raise ConfigError("run_dir_exists", f"overwrite would remove the checkpoint checkpoint.resume={resume} resumes "
                          f"from {run_dir}: set run_dir_exists=error to continue that run, "
                          "or checkpoint.resume=none to replace it")
    records = earlier_run(run_dir) if not inside and run_dir.is_dir() else []
    if records and cfg.run_dir_exists == "error":
        shown = ", ".join(records[:6]) + (f" and {len(records) - 6} more" if len(records) > 6 else "")
        starts = ("checkpoint.resume=none starts a fresh one" if resume == "none" else
                  f"checkpoint.resume={resume} starts a run from another folder's checkpoint")
        raise ConfigError("run_dir", f"{run_dir} holds an earlier run ({shown}), and {starts} that would write over "
                          "it: continue it with checkpoint.resume=auto, choose another run_dir, or set "
                          "run_dir_exists=overwrite to remove it first")
    removed = [name for name in RUN_OUTPUTS if records and (run_dir / name).exists()]
    for name in removed:
        path = run_dir / name
        try:
            shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
        except OSError as exc:
            raise ConfigError("run_dir_exists", f"overwrite cannot remove {path}: {exc.strerror or exc}") from None
    return removed
