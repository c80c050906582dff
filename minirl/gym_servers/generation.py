"""minirl's generation side for a Gym deployment, as one command (docs/gym.md, step 1):

    python -m minirl.gym_servers.generation [--config FILE] [key=value ...]

starts a Ray cluster owned by this process, `cluster.num_generation_workers` detached generation
workers (`--name`-<rank>) and the generation router in front of them; prints Gym's `policy_base_url`
and `policy_model_name`, the overrides that attach `minirl.train` (give it the same config), and last
one line `generation-ready {json}`; then waits. Invariant: nothing is printed as ready before the
router answers; Ctrl-C or SIGTERM stops the Ray cluster this process started, and nothing else, at
once: during start-up (vLLM's, minutes) with exit 1 and nothing announced ready (a SIGTERM once
`ray.init` has put Ray's own handler in, until start-up ends, exits non-zero as Ray's does), and
once ready with exit 0.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys


def start(cfg, name: str) -> dict:
    """The workers and the router; returns what Gym and `minirl.train` need: `policy_base_url`
    (Gym's `+policy_base_url`), `policy_model_name` (Gym's `+policy_model_name`, the name the server
    answers to), the router's and the workers' URLs, and `attach`, the overrides for `minirl.train`."""
    import ray

    from minirl.cluster import NAMESPACE, start_shared_generation

    attach = start_shared_generation(cfg, name, router_host=cfg.cluster.host)
    workers = [ray.get(ray.get_actor(f"{name}-{i}", namespace=NAMESPACE).start.remote())
               for i in range(cfg.cluster.num_generation_workers)]
    if cfg.async_rl.generation_router.enabled:  # started with the workers
        router = ray.get(ray.get_actor(f"{name}-router", namespace=NAMESPACE).start.remote())
    else:  # Gym reaches the workers through one URL whatever the runs' own setting
        from minirl.generation.router import start_router

        _router, router = start_router(cfg, workers, cfg.cluster.host, name=name)
    return {"policy_base_url": router.rstrip("/") + "/v1", "policy_model_name": cfg.policy.model_name,
            "router": router, "workers": workers, "attach": attach}


def _stop(signum, frame) -> None:
    """Ctrl-C or SIGTERM, wherever the main thread is (a start-up's `ray.get` too): ends the command as
    Ctrl-C does; later ones are ignored, so that Ray's shutdown finishes."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m minirl.gym_servers.generation", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="YAML file merged over the defaults (the one minirl.train gets)")
    ap.add_argument("--name", default="minirl-gen",
                    help="the detached workers' name (cluster.attach_generation_workers)")
    ap.add_argument("overrides", nargs="*", help="dotted.key=value, applied last")
    args = ap.parse_args(argv)
    from minirl.config import ConfigError, load_config

    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"ConfigError: {exc}", file=sys.stderr)
        return 2
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _stop)
    import ray

    ready = None
    print("minirl: starting the generation workers and the router (vLLM's start-up takes minutes; Ctrl-C "
          "stops it)", flush=True)
    try:
        ready = start(cfg, args.name)
        signal.signal(signal.SIGTERM, _stop)  # ray.init replaced it with its own
        print(f"policy_base_url={ready['policy_base_url']}\npolicy_model_name={ready['policy_model_name']}\n"
              f"attach: {' '.join(ready['attach'])}\n"
              f"(router {ready['router']}, workers {ready['workers']}; Ctrl-C stops them)")
        print("generation-ready " + json.dumps(ready), flush=True)
        while True:
            signal.pause()
    except KeyboardInterrupt:
        if ready is None:
            print("KeyboardInterrupt: stopped during start-up, before anything was ready", file=sys.stderr, flush=True)
            return 1
    finally:
        ray.shutdown()  # the cluster start_shared_generation started: its detached actors go with it
    return 0


if __name__ == "__main__":
    sys.exit(main())
