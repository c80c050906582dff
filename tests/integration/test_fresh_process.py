"""Checks that need a fresh Python process, so they live apart from their areas' unit tests
(tests/unit/test_config.py, tests/unit/test_compaction_registry.py): a CLI run with a bad value exits 2
with one line before Ray starts, and importing the config or the compaction package loads and registers
no more than it says."""

import subprocess
import sys
import time

import pytest

from helpers import run_cli
from minirl.config import REPO_ROOT


@pytest.mark.parametrize("override,line", [
    ("no.such.key=1", "ConfigError: no.such.key: unknown config key"),
    ("policy.generation.temperature=0", "ConfigError: policy.generation.temperature: must be > 0, got 0.0"),
    ("policy.generation.vllm_cfg.max_model_len=4096",
     "ConfigError: policy.generation.vllm_cfg.max_model_len: must be <= the "
     f"model's max_position_embeddings (2048, {REPO_ROOT}/models/tiny-doors/config.json), got 4096"),
    # were OmegaConf's bare TypeError, or a section check's, with a traceback and exit 1
    ("faults.inject={kind: timeout, step: 0}",
     "ConfigError: faults.inject: is a list: give it [...], got {'kind': 'timeout', 'step': 0}"),
    ("faults.rate.timeout=[0.1]", "ConfigError: faults.rate.timeout: must be a number, got a list [0.1]"),
])
def test_cli_bad_value_exits_2_with_one_line_before_ray_starts(override, line):
    t0 = time.perf_counter()
    proc = run_cli(override, timeout=60)
    elapsed = time.perf_counter() - t0
    assert proc.returncode == 2
    assert [x for x in proc.stderr.splitlines() if x.strip()] == [line]
    assert proc.stdout == "", "nothing ran: no run directory was made, Ray never started"
    assert elapsed < 5, f"took {elapsed:.1f}s: the check must come before Ray starts"


def test_loading_a_config_loads_no_runtime_code():
    """The config reads the fault table from minirl.faults and nothing else of minirl's: no aiohttp,
    Ray, torch or vLLM on the driver to check a config."""
    code = ("import sys, minirl.config; print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('minirl', 'aiohttp', 'ray', 'torch', 'vllm')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['minirl', 'minirl.config', 'minirl.faults']"


def test_importing_a_policy_module_registers_nothing():
    """The registry is the package's dict: a policy module adds no entry when imported on its own."""
    code = ("import sys; import minirl.agents.compaction.summarize as m, minirl.agents.compaction as c; "
            "assert not hasattr(m, 'register'); print(sorted(c.POLICIES))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['identity', 'recency', 'summarize']"


def test_the_driver_imports_no_torch(tmp_path):
    """A run's driver (minirl.train, the cluster it starts, its metrics with TensorBoard on, its validator)
    imports no torch: only the policy workers need it. Its TensorBoard writer once cost it ~2 s of CPU a
    run by importing torch.utils.tensorboard (minirl.metrics.TensorBoardScalars)."""
    code = ("import sys, pathlib, minirl.train, minirl.cluster, minirl.validation; from minirl.metrics import "
            "MetricsLogger; m = MetricsLogger(pathlib.Path(sys.argv[1]), True, False, 1); "
            "m.tb.add_scalar('x', 1.0, 0); m.close(); print('torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)],
                          capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert proc.returncode == 0 and proc.stdout.strip() == "False", proc.stderr[-2000:]
