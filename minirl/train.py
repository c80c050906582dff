"""Entry point: `python -m minirl.train [--config PATH] [dotted.key=value ...]`.

With no arguments it trains the default: context-compaction GRPO of the tiny model on the `doors`
task, on this machine's CPUs. Each iteration is one optimizer step: the controller collects the
step's rollouts and assembles the batch, the policy workers take one GRPO step on it, the new
weights go to every generation worker, then metrics are logged and a checkpoint written when due.
Exit codes: 0 on success; 2 for a bad config key or value, or surroundings the config cannot use
(one line naming the key; docs/contracts.md lists the cases); 1 for a run-ending failure. Either way
`ExceptionClass: message` is the last stderr line, and once the run has claimed its run directory, a
`run_failed` event.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from minirl import shutdown
from minirl.config import REPO_ROOT, ConfigError, MinirlConfig, load_config, probe_ray_address, to_yaml
from minirl.trainer import checkpoint


def train(cfg: MinirlConfig, cluster, run_dir: Path) -> None:
    import ray

    from minirl.metrics import MetricsLogger
    from minirl.timeline import trainer_lane
    from minirl.validation import Validator

    start = cluster.resume()
    _truncate_metrics(run_dir, start)
    log = MetricsLogger(run_dir, cfg.logger.tensorboard, cfg.logger.progress, cfg.grpo.max_num_steps, start)
    ckpt = cfg.checkpoint
    val = Validator(cfg, cluster.controller, run_dir, start)  # validates version `start` first with val_at_start
    for step in range(start, cfg.grpo.max_num_steps):
        t0 = time.perf_counter()
        batch, rollout_stats = cluster.controller.collect.options(num_returns=2).remote(step, version=step)
        rollout_stats = ray.get(rollout_stats)
        t1 = time.perf_counter()
        trained = [w.train.remote(batch) for w in cluster.policy]
        weights = cluster.policy[0].get_weights.remote()  # runs right after rank 0's update, on that actor
        train_stats = ray.get(trained)[0]
        t2 = time.perf_counter()
        generation_lane = cluster.sync_weights(version=step + 1, weights=weights)
        t3 = time.perf_counter()
        lane = trainer_lane(t0, t1, t2, t3, rollout_stats["timing/train/exposed_generation"])
        log.log({"step": step, **rollout_stats, **train_stats, "rollout_time_s": t1 - t0, "train_time_s": t2 - t1,
                 "sync_time_s": t3 - t2, "step_time_s": t3 - t0, **lane, **generation_lane, **val.after(step)})
        last = step == cfg.grpo.max_num_steps - 1
        if ckpt.enabled and ((step + 1) % ckpt.save_period == 0 or last):
            cluster.save_checkpoint(step)
    log.close()


def _truncate_metrics(run_dir: Path, start: int) -> None:
    """Drop metric lines of steps from `start` on (after the checkpoint, or all when no checkpoint
    verified): they will be run again. A last line cut mid-write is dropped with a warning naming the
    file; any other line that does not parse ends the run naming the file and line (`checkpoint.keep_records`)."""
    checkpoint.keep_records(run_dir / "metrics.jsonl", lambda record: record["step"] < start)


def prepare_run_dir(cfg: MinirlConfig) -> Path:
    if cfg.run_dir is None:
        cfg.run_dir = str(checkpoint.new_run_dir(REPO_ROOT / "runs"))
    run_dir = Path(cfg.run_dir).resolve()
    removed = checkpoint.claim_run_dir(cfg, run_dir)  # an earlier run's records there: refused, or removed whole
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(to_yaml(cfg))
    except OSError as exc:
        raise ConfigError("run_dir", f"cannot write {run_dir}: {exc.strerror or exc}") from None
    if cfg.checkpoint.enabled:
        checkpoint.check_writable(run_dir)
    if removed:
        print(f"minirl: run_dir_exists=overwrite: removed the earlier run's {', '.join(removed)} from {run_dir}",
              flush=True)
    return run_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minirl.train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML file merged over the defaults (see configs/)")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value, applied last")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        # imported once the config loads: its agent-server row checks bring aiohttp and Ray's exceptions,
        # 2-5 s on a loaded 2-core machine, which a bad key's one-line exit should not wait for
        from minirl import data

        data.prepare(cfg)  # the dataset rows, checked before anything starts
        # the checkpoint's model, step shape and staleness window, before anything is written
        checkpoint.check_resume(cfg)
        probe_ray_address(cfg)  # a cluster to join answers (Ray itself retries one that does not for minutes)
        run_dir = prepare_run_dir(cfg)
    except ConfigError as exc:  # before Ray starts: one line naming the key
        print(f"ConfigError: {exc}", file=sys.stderr)
        return 2
    except checkpoint.CheckpointError as exc:  # a checkpoint.resume path that does not verify: a run-ending failure
        print(f"CheckpointError: {exc}", file=sys.stderr)
        return 1
    print(f"minirl: run directory {run_dir}", flush=True)
    from minirl.cluster import Cluster, cause, describe

    shutdown.arm(run_dir)  # SIGTERM (scancel, a time limit) ends the run as Ctrl-C does, saying what it keeps
    failure = None
    try:
        with Cluster(cfg, run_dir) as cluster:  # on the way out of a failure: its run_failed event
            train(cfg, cluster, run_dir)
    except (KeyboardInterrupt, Exception) as exc:  # the run ends: report the root cause, last, after Ray is down
        failure = exc
    if failure is not None:
        shutdown.report_kept()
        sys.stdout.flush()
        print(describe(failure), file=sys.stderr, flush=True)
        return 2 if isinstance(cause(failure), ConfigError) else 1
    print(f"minirl: done, metrics in {run_dir / 'metrics.jsonl'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
