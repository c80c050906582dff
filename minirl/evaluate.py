"""Evaluate a saved checkpoint: `python -m minirl.evaluate --checkpoint PATH [dotted.key=value ...]`.

Runs minirl.validation (no fault injection) on the checkpoint's weights, loaded as a resume loads
them, under the config of the run that wrote it (`<run_dir>/config.yaml`, so the held-out prompts
stay disjoint from its training prompts), the overrides applied last, its data checked as training
checks it with validation on (`prepare_data`; exit 2 naming the key). Prints the metrics as one JSON
object, then writes them to `--out` (default `<run_dir>/eval/step_N/metrics.json`, beside the
evaluation's own events: the training run's logs stay as they were), which is checked to be writable
before anything starts (`check_out`); a `policy.model_name` of another shape than the checkpoint's
is refused then too (`checkpoint.check_model`), and so is a checkpoint whose files do not match its manifest
(sizes and hashes: a ConfigError naming `--checkpoint`). Exit codes as `minirl.train`: 2 for a ConfigError, before Ray
(`cluster.ray_address` probed first, as train does) or from inside the cluster.
A run that attached to a sweep's engines, once they are gone, needs
`cluster.ray_address=null cluster.attach_generation_workers=null`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from minirl.config import ConfigError, load_config, probe_ray_address
from minirl.trainer import checkpoint


def prepare_data(cfg) -> None:
    """Training's data checks (`data.prepare`), with validation on whatever `grpo.val_*` say: an
    evaluation validates, so a run on `data.train_jsonl` needs `data.validation_jsonl` (the doors
    task's held-out prompts are not its environment's) with at least `grpo.val_num_prompts` rows."""
    from minirl import data

    val_at_start, cfg.grpo.val_at_start = cfg.grpo.val_at_start, True
    try:
        data.prepare(cfg)
    except ConfigError as exc:
        raise ConfigError(exc.key, f"{exc.problem} (minirl.evaluate always validates)") from None
    finally:
        cfg.grpo.val_at_start = val_at_start


def check_out(out: Path) -> None:
    """Before anything starts: `out` can be written (opened for appending, and left as it was), so an
    evaluation's metrics are never lost to a folder that is missing or read-only; else a ConfigError
    naming `--out`."""
    existed = out.exists()
    try:
        with open(out, "a"):
            pass
        if not existed:
            out.unlink()
    except OSError as exc:
        raise ConfigError("--out", f"cannot write {out}: {exc.strerror or exc}") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minirl.evaluate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="a checkpoints/step_N directory")
    parser.add_argument("--out", help="where to write the metrics JSON")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value, applied last")
    args = parser.parse_args(argv)
    ckpt = Path(args.checkpoint).resolve()
    run_config = ckpt.parent.parent / "config.yaml"
    eval_dir = ckpt.parent.parent / "eval" / ckpt.name
    try:
        if not ckpt.is_dir():  # the flag as typed, not the `checkpoint.resume` evaluate sets from it
            what = "is not a directory" if ckpt.exists() else "no such directory"
            raise ConfigError("--checkpoint", f"{args.checkpoint}: {what} (give a run's checkpoints/step_N)")
        cfg = load_config(str(run_config) if run_config.exists() else None,
                          [*args.overrides, f"checkpoint.resume={ckpt}", f"run_dir={eval_dir}"])
        prepare_data(cfg)
        checkpoint.check_model(cfg, ckpt)  # a `policy.model_name` override of another shape: named, before Ray
        probe_ray_address(cfg)  # a cluster to join answers (Ray itself retries one that does not for minutes)
        out = Path(args.out) if args.out else None
        if out is not None:
            check_out(out)
        # every file against the manifest, hashes too (as the resume inside checks it), the last check and before
        # anything is written: with sizes alone, a damaged file started Ray and the engines first, and left an eval
        # directory behind
        if (reason := checkpoint.verify(ckpt)) is not None:
            raise ConfigError("--checkpoint", f"{args.checkpoint} is no checkpoint that can be trusted: {reason}")
        try:
            eval_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError("--checkpoint", f"cannot write {eval_dir}: {exc.strerror or exc}") from None
        if out is None:  # the default, in the eval directory just made
            out = eval_dir / "metrics.json"
            check_out(out)
    except ConfigError as exc:
        print(f"ConfigError: {exc}", file=sys.stderr)
        return 2
    import ray

    from minirl.cluster import Cluster, cause, describe

    try:
        with Cluster(cfg, eval_dir) as cluster:
            version = cluster.resume()
            metrics = ray.get(cluster.controller.validate.remote(version))
    except (KeyboardInterrupt, Exception) as exc:  # report the root cause, last, after Ray is down
        print(describe(exc), file=sys.stderr, flush=True)
        return 2 if isinstance(cause(exc), ConfigError) else 1
    record = {"checkpoint": str(ckpt), **metrics}
    print(json.dumps(record), flush=True)  # first: a write that fails after all leaves the metrics on stdout
    out.write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
