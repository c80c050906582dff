"""Evaluate a saved checkpoint: `python -m minirl.evaluate --checkpoint PATH [dotted.key=value ...]`.

Runs minirl.validation (no fault injection) on the checkpoint's weights, loaded as a resume loads
them, under the config of the run that wrote it (`<run_dir>/config.yaml`, so the held-out prompts
stay disjoint from its training prompts), the overrides applied last, its data checked as training
checks it with validation on (`prepare_data`; exit 2 naming the key). Prints the metrics as one JSON
object and writes them to `--out` (default `<run_dir>/eval/step_N/metrics.json`, beside the
evaluation's own events: the training run's logs stay as they were). Exit codes as `minirl.train`.
A run that attached to a sweep's engines, once they are gone, needs
`cluster.ray_address=null cluster.attach_generation_workers=null`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from minirl.config import ConfigError, load_config


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
        cfg = load_config(str(run_config) if run_config.exists() else None,
                          [*args.overrides, f"checkpoint.resume={ckpt}", f"run_dir={eval_dir}"])
        prepare_data(cfg)
        try:
            eval_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError("--checkpoint", f"cannot write {eval_dir}: {exc.strerror or exc}") from None
    except ConfigError as exc:
        print(f"ConfigError: {exc}", file=sys.stderr)
        return 2
    import ray

    from minirl.cluster import Cluster, describe

    try:
        with Cluster(cfg, eval_dir) as cluster:
            version = cluster.resume()
            metrics = ray.get(cluster.controller.validate.remote(version))
    except KeyboardInterrupt:
        print("KeyboardInterrupt: interrupted", file=sys.stderr)
        return 1
    except Exception as exc:  # report the root cause, last, after Ray is down
        print(describe(exc), file=sys.stderr, flush=True)
        return 1
    out = Path(args.out) if args.out else eval_dir / "metrics.json"
    out.write_text(json.dumps({"checkpoint": str(ckpt), **metrics}, indent=2) + "\n")
    print(json.dumps({"checkpoint": str(ckpt), **metrics}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
