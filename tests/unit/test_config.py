"""Config loading: layering, interpolation, and one clear error naming the key."""

import re
from pathlib import Path

import pytest

from minirl.config import REPO_ROOT, ConfigError, FaultSpec, load_config, to_yaml

CONFIGS = REPO_ROOT / "configs"


def test_defaults_load_and_resolve_the_model_path():
    cfg = load_config()
    assert Path(cfg.policy.model_name).is_absolute() and (Path(cfg.policy.model_name) / "config.json").exists()
    assert cfg.context_compaction.enabled and cfg.agent.name == "compaction_agent"
    assert cfg.policy.train_global_batch_size == cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt


def test_train_global_batch_size_follows_the_grpo_keys():
    cfg = load_config(None, ["grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=2"])
    assert cfg.policy.train_global_batch_size == 8


@pytest.mark.parametrize("name", ["default.yaml", "cc.yaml", "plain.yaml", "upstream_pr4124.yaml"])
def test_shipped_configs_load(name):
    load_config(str(CONFIGS / name))


def test_upstream_preset_sets_every_switch():
    cfg = load_config(str(CONFIGS / "upstream_pr4124.yaml"))
    assert cfg.context_compaction.enabled
    assert not cfg.context_compaction.allow_step_shrink
    assert not cfg.context_compaction.redispatch_dropped_groups
    assert cfg.agent.context_history.guards.on_reject == "raise"
    assert cfg.async_rl.rollout_failure.min_step_batch_fraction == 1
    assert cfg.async_rl.rollout_failure.max_consecutive_dropped_prompts == 0
    assert not cfg.grpo.baseline_excludes_masked
    assert cfg.loss_fn.reference_policy_kl_penalty == 0.01  # upstream's default; the default run's is 0
    assert load_config().loss_fn.reference_policy_kl_penalty == 0.0
    # one key turns a fix back on
    cfg = load_config(str(CONFIGS / "upstream_pr4124.yaml"), ["context_compaction.redispatch_dropped_groups=true"])
    assert cfg.context_compaction.redispatch_dropped_groups


def test_fault_list_in_yaml_flow_style():
    cfg = load_config(None, ["faults.inject=[{kind: guard_reject, step: 0, group: 1, rollout: 0}]",
                             "faults.rate.agent_exception=0.05"])
    spec = cfg.faults.inject[0]
    assert (spec.kind, spec.step, spec.group, spec.rollout, spec.attempt) == ("guard_reject", 0, 1, 0, None)
    assert cfg.faults.rate == {"agent_exception": 0.05}


@pytest.mark.parametrize(
    "overrides,key,text",
    [
        (["no.such.key=1"], "no.such.key", "unknown config key"),
        (["grpo.max_num_steps=abc"], "grpo.max_num_steps", "could not be converted"),
        (["policy.train_global_batch_size=5"], "policy.train_global_batch_size", "must equal"),
        (["async_rl.rollout_failure.max_backoff_s=0.1"], "async_rl.rollout_failure.max_backoff_s", ">= backoff_base_s"),
        (["async_rl.rollout_failure.min_step_batch_fraction=0"], "async_rl.rollout_failure.min_step_batch_fraction",
         "(0, 1]"),
        (["context_compaction.allow_step_shrink=false"], "async_rl.rollout_failure.min_step_batch_fraction",
         "context compaction requires min_step_batch_fraction=1"),
        (["loss_fn.token_level_loss=false"], "loss_fn.token_level_loss", "requires token_level_loss"),
        (["agent.context_history.schedule.actions_per_chunk=2"], "agent.context_history.schedule.actions_per_chunk",
         "must be 1"),
        (["faults.rate.meteor=0.1"], "faults.rate.meteor", "unknown fault kind"),
        (["faults.inject=[{kind: timeout}]", "async_rl.rollout_failure.nemo_gym.rollout_timeout_s=null"],
         "async_rl.rollout_failure.nemo_gym.rollout_timeout_s", "would hang"),
        (["grpo.num_prompts_per_step=0"], "grpo.num_prompts_per_step", ">= 1"),
        # values that once passed validation and failed after Ray started (issue N)
        (["policy.generation.temperature=0"], "policy.generation.temperature", "must be > 0"),
        (["policy.generation.temperature=-1"], "policy.generation.temperature", "must be > 0"),
        (["policy.generation.temperature=nan"], "policy.generation.temperature", "finite"),
        (["policy.generation.top_p=0"], "policy.generation.top_p", "(0, 1]"),
        (["policy.generation.top_p=7"], "policy.generation.top_p", "(0, 1]"),
        (["policy.optimizer.lr=-0.001"], "policy.optimizer.lr", ">= 0"),
        (["policy.optimizer.lr=inf"], "policy.optimizer.lr", "finite"),
        (["policy.optimizer.eps=0"], "policy.optimizer.eps", "> 0"),
        (["policy.optimizer.betas=[0.9,1.0]"], "policy.optimizer.betas", "[0, 1)"),
        (["policy.max_grad_norm=-1"], "policy.max_grad_norm", ">= 0"),
        (["policy.max_total_sequence_length=0"], "policy.max_total_sequence_length", ">= 1"),
        (["policy.generation.vllm_cfg.max_model_len=0"], "policy.generation.vllm_cfg.max_model_len", ">= 1"),
        (["policy.generation.vllm_cfg.kv_cache_space_gb=0"], "policy.generation.vllm_cfg.kv_cache_space_gb", ">= 1"),
        (["policy.generation.vllm_cfg.omp_threads=0"], "policy.generation.vllm_cfg.omp_threads", ">= 1"),
        (["async_rl.stall_watchdog.stall_timeout_s=-1"], "async_rl.stall_watchdog.stall_timeout_s", "> 0"),
        (["agent.max_request_bytes=-1"], "agent.max_request_bytes", ">= 1"),
        # the generation router in front of the worker would refuse (413, DATA) what the worker would serve
        (["policy.generation.vllm_cfg.max_request_bytes=100000000"], "policy.generation.vllm_cfg.max_request_bytes",
         "[1, 67108864]"),
        (["loss_fn.ratio_clip_min=1"], "loss_fn.ratio_clip_min", "must be < 1"),
        (["loss_fn.ratio_clip_min=-0.1"], "loss_fn.ratio_clip_min", ">= 0"),
        (["loss_fn.ratio_clip_max=-0.1"], "loss_fn.ratio_clip_max", ">= 0"),
        (["env.num_rooms=17"], "env.num_rooms", "<= env.max_num_rooms (16)"),
        (["env.num_rooms=0"], "env.num_rooms", ">= 1"),
        (["faults.inject=[{kind: guard_reject, step: -1}]"], "faults.inject[0].step", ">= 0"),
        # inside a list of structured items OmegaConf names the leaf alone (`grupo: ...`)
        (["faults.inject=[{kind: worker_kill}, {kind: worker_kill, grupo: 2}]"], "faults.inject[1].grupo",
         "unknown config key"),
        (["faults.inject=[{kind: timeout, step: abc}]"], "faults.inject[0].step", "could not be converted to Integer"),
        (["faults.inject=[{kind: timeout}, {kind: timeout, call: null}]"], "faults.inject[1].call", "'None'"),
        (["faults.inject=[{kind: timeout}, 5]"], "faults.inject[1]", "must be a mapping of FaultSpec keys, got 5"),
        (["faults.inject=[{kind: worker_kill, call: -1}]"], "faults.inject[0].call", "must be >= 0, got -1"),
        # two specs of a kind that one attempt matches: only the first's call fired there, the second was ignored
        (["faults.inject=[{kind: model_error, step: 0, call: 0}, {kind: model_error, group: 1, call: 2}]"],
         "faults.inject[1]", "matches a rollout attempt that inject[0] matches too (both model_error)"),
        (["faults.inject=[{kind: worker_kill, stepp: {a: 1}}]"], "faults.inject[0].stepp.a", "unknown config key"),
        (["policy.model_name=/no/such/model"], "policy.model_name", "/no/such/model: no such directory"),
        (["policy.model_name=configs"], "policy.model_name", "config.json does not load"),
        (["checkpoint.resume=/no/such/step_3"], "checkpoint.resume", "'/no/such/step_3' is not a directory"),
        (["agent.external_url=localhost-8000"], "agent.external_url", "http(s) URL with a host"),
        (["agent.external_url=http://"], "agent.external_url", "http(s) URL with a host"),
        (["agent.external_url=http://127.0.0.1:99999"], "agent.external_url", "Port out of range"),
        (["grpo=5"], "grpo", "is a section"),
        # issue 29: found only after Ray and vLLM started (or never)
        (["policy.generation.vllm_cfg.max_model_len=4096"], "policy.generation.vllm_cfg.max_model_len",
         "must be <= the model's max_position_embeddings (2048"),
        (["async_rl.sampler.name=in_ordr"], "async_rl.sampler.name", "got 'in_ordr'"),  # async off: still a typo
        (["policy.generation.temperature=1e-6"], "policy.generation.temperature",
         "must be >= 1e-05 (below it vLLM samples greedily"),
        (["cluster.num_cpus=2", "cluster.num_generation_workers=8"], "cluster.num_cpus",
         "the workers need 9 CPUs (cluster.num_generation_workers=8 x cluster.cpus_per_generation_worker=1 + "
         "cluster.num_policy_workers=1 x cluster.cpus_per_policy_worker=1), more than Ray offers (cluster.num_cpus=2)"),
        (["cluster.num_gpus=1", "cluster.gpus_per_policy_worker=2"], "cluster.num_gpus", "the workers need 2 GPUs"),
        # a negative timeout read as no limit; an empty run_dir wrote the run into the working directory
        (["policy.generation.vllm_cfg.step_timeout_s=-1"], "policy.generation.vllm_cfg.step_timeout_s", ">= 0"),
        (["run_dir=' '"], "run_dir", "must name a folder (null: runs/<UTC timestamp>), got ' '"),
        # numpy refuses a seed of 2**32 in vLLM's workers, after Ray started (found by review)
        (["grpo.seed=4294967295", "cluster.num_generation_workers=2"], "grpo.seed",
         "below 2**32 (numpy's and vLLM's seed range), got 4294967296"),
    ],
)
def test_errors_name_the_key(overrides, key, text):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert str(err.value).startswith(key + ":") and text in str(err.value)


@pytest.mark.parametrize("override,key,text", [
    ("faults.inject={kind: timeout, step: 0}", "faults.inject",
     "is a list: give it [...], got {'kind': 'timeout', 'step': 0}"),
    ("policy.optimizer.betas={a: 0.9}", "policy.optimizer.betas.a", "policy.optimizer.betas is a list: give it whole"),
    ("env.num_rooms_choices={a: 2}", "env.num_rooms_choices.a", "env.num_rooms_choices is a list: give it whole"),
    # OmegaConf's own dotted index into a list
    ("policy.optimizer.betas.0=0.5", "policy.optimizer.betas.0",
     "policy.optimizer.betas is a list: give it whole, as policy.optimizer.betas=[...], not an item by its index"),
    ("faults.inject.0.step=1", "faults.inject.0.step",
     "faults.inject is a list: give it whole, as faults.inject=[...]"),
    ("env.num_rooms_choices=3", "env.num_rooms_choices", "is a list: give it [...], got 3"),
])
def test_anything_but_a_list_for_a_list_is_a_config_error(override, key, text):
    """A mapping where the config has a list (a forgotten pair of brackets, or `key.0=v`) escaped as
    OmegaConf's bare TypeError "Cannot merge incompatible container types": a traceback, exit 1."""
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert err.value.key == key and text in err.value.problem, str(err.value)


@pytest.mark.parametrize("override,key,text", [
    ("faults.rate.timeout=[0.1]", "faults.rate.timeout", "must be a number, got a list [0.1]"),
    ("faults.rate={timeout: {p: 0.1}}", "faults.rate.timeout", "must be a number, got a mapping {'p': 0.1}"),
    ("faults.rate_per_room.agent_exception=[0.1]", "faults.rate_per_room.agent_exception",
     "must be a number, got a list [0.1]"),
    ("policy.optimizer.betas=[[0.9],0.5]", "policy.optimizer.betas[0]", "must be a number, got a list [0.9]"),
    ("policy.optimizer.betas=[{a: 1},0.5]", "policy.optimizer.betas[0]", "must be a number, got a mapping"),
    ("env.num_rooms_choices=[[2]]", "env.num_rooms_choices[0]", "must be an integer, got a list [2]"),
    ("agent.context_history.policy.summarize.threshold_tokens=[[1],2]",
     "agent.context_history.policy.summarize.threshold_tokens[0]", "must be an integer, got a list [1]"),
    ("agent.external_url=[[http://a:1]]", "agent.external_url[0]", "must be a string, got a list ['http://a:1']"),
])
def test_a_list_or_mapping_where_a_value_belongs_is_a_config_error(override, key, text):
    """OmegaConf types neither a `dict[str, float]`'s values nor a typed list's items: a list there
    passed the merge and crashed a section's check (TypeError `'<=' not supported`, AttributeError
    from urlparse) with a traceback naming no key."""
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert err.value.key == key and text in err.value.problem, str(err.value)


FAULTY = "faults:\n  rate: {timeout: 0.2}\n  rate_per_room: {agent_exception: 0.1}\n"


@pytest.mark.parametrize("overrides,rate,per_room", [
    (["faults.rate={}"], {}, {"agent_exception": 0.1}),
    (["faults.rate={agent_exception: 0.1}"], {"agent_exception": 0.1}, {"agent_exception": 0.1}),
    (["faults={rate_per_room: {}}"], {"timeout": 0.2}, {}),
    (["faults.rate.agent_exception=0.1"], {"timeout": 0.2, "agent_exception": 0.1}, {"agent_exception": 0.1}),
    (["faults.rate={}", "faults.rate.transport=0.3"], {"transport": 0.3}, {"agent_exception": 0.1}),
])
def test_a_fault_mapping_given_whole_replaces_the_earlier_one(tmp_path, overrides, rate, per_room):
    """`faults.rate` and `faults.rate_per_room` are free-form mappings: one given whole by a later
    layer replaces the earlier one (`{}` clears it), as a list does, and a dotted `faults.rate.KIND=p`
    sets one kind. OmegaConf deep-merged them: `faults.rate={}` left the file's rates on."""
    path = tmp_path / "faulty.yaml"
    path.write_text(FAULTY)
    cfg = load_config(str(path), overrides)
    assert (cfg.faults.rate, cfg.faults.rate_per_room) == (rate, per_room)


def test_a_later_files_fault_mapping_replaces_the_earlier_files(tmp_path):
    (tmp_path / "base.yaml").write_text(FAULTY)
    (tmp_path / "later.yaml").write_text("faults:\n  rate: {transport: 0.3}\n")
    cfg = load_config(str(tmp_path / "later.yaml"), base=tmp_path / "base.yaml")
    assert (cfg.faults.rate, cfg.faults.rate_per_room) == ({"transport": 0.3}, {"agent_exception": 0.1})


def test_a_saved_config_follows_an_override_of_the_step_size(tmp_path):
    """A run's config.yaml holds `policy.train_global_batch_size` resolved (32); loaded again (minirl.evaluate,
    `--config runs/X/config.yaml`) with another step size it was refused naming that key, which the user
    never set. A file's value equal to its prompts x generations now follows the grpo keys; one set by
    hand on the command line, or a file's that differs, is still checked."""
    saved = tmp_path / "config.yaml"
    saved.write_text(to_yaml(load_config()))
    assert "train_global_batch_size: 32" in saved.read_text()
    cfg = load_config(str(saved), ["grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=2"])
    assert cfg.policy.train_global_batch_size == 8
    with pytest.raises(ConfigError, match=r"^policy.train_global_batch_size: must equal .* = 16 .* got 32$"):
        load_config(str(saved), ["policy.train_global_batch_size=32", "grpo.num_prompts_per_step=4"])
    (tmp_path / "odd.yaml").write_text("policy:\n  train_global_batch_size: 5\n")
    with pytest.raises(ConfigError, match=r"^policy.train_global_batch_size: must equal .* got 5$"):
        load_config(str(tmp_path / "odd.yaml"))


def test_a_task_mix_leaves_num_rooms_unchecked():
    """With env.num_rooms_choices every prompt's room count is drawn from it: env.num_rooms (default 2)
    is never read, yet `num_rooms_choices=[1] max_num_rooms=1` was refused naming env.num_rooms."""
    cfg = load_config(None, ["env.num_rooms_choices=[1]", "env.max_num_rooms=1"])
    assert cfg.env.num_rooms_choices == [1]
    with pytest.raises(ConfigError, match=r"^env.num_rooms: must be <= env.max_num_rooms \(1\), got 2"):
        load_config(None, ["env.max_num_rooms=1"])


def test_valid_edge_values_pass():
    cfg = load_config(None,
                      ["async_rl.stall_watchdog.stall_timeout_s=null", "policy.optimizer.lr=0", "env.num_rooms=16",
                             "policy.generation.top_p=1", "agent.external_url=https://agents.example:8443/base"])
    assert cfg.env.num_rooms == cfg.env.max_num_rooms == 16 and cfg.async_rl.stall_watchdog.stall_timeout_s is None


@pytest.mark.parametrize(
    "text,key,problem",
    [
        ("grpo:\n  max_num_steps: 3\n  seed: [1, 2\n", "--config", "line 4, column 1: YAML error: expected ',' or ']'"),
        ("grpo: {max_num_steps: 3\npolicy: x: y\n", "--config", "line 2"),
        ("- grpo\n- policy\n", "--config", "must be a mapping of config keys (key: value), got a YAML list"),
        ("just words\n", "--config", "got a YAML scalar"),
        ("grpo: 5\n", "grpo", "is a section: give it a mapping of keys, got 5"),
        ("policy:\n  generation: [1]\n", "policy.generation", "is a section"),
        ("policy:\n  generation:\n    temperature: 0\n", "policy.generation.temperature", "must be > 0"),
        ("faults:\n  inject:\n    - {kind: timeout}\n    - {kind: timeout, grupo: 1}\n", "faults.inject[1].grupo",
         "unknown config key"),
        ("faults:\n  inject:\n    - {kind: timeout, rollout: x}\n", "faults.inject[0].rollout",
         "could not be converted"),
        ("faults:\n  inject:\n    kind: worker_kill\n    step: 1\n", "faults.inject", "is a list: give it [...]"),
        ("faults:\n  rate:\n    timeout: [0.1]\n", "faults.rate.timeout", "must be a number, got a list [0.1]"),
        # found by review: a dotted key said "unknown", and a NUL byte in a path was a traceback (exit 1)
        ("grpo.seed: 5\n", "grpo.seed", "in a YAML file write it nested (grpo: {seed: ...})"),
        ('run_dir: "runs/x\\0y"\n', "run_dir", "a path cannot hold a NUL byte"),
        ('data:\n  train_jsonl: "rows\\0.jsonl"\n', "data.train_jsonl", "cannot be read (embedded null byte)"),
    ],
)
def test_yaml_file_errors_are_one_line_naming_the_key_or_file(tmp_path, text, key, problem):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(str(path))
    msg = str(err.value)
    assert msg.startswith(key + ":") and problem in msg and "\n" not in msg
    if key == "--config":
        assert str(path) in msg


def test_validate_walks_choices_bounds_and_sections_of_a_config_built_in_python():
    """The rules live on the fields: a Literal's choices, a `bounded` range and a section's check()
    are found by walking the dataclasses, at any depth (a list's items too), and named by dotted key."""
    from minirl.config import FaultSpec, validate

    for path, value, problem in (
        ("agent.name", "other_agent", "agent.name: must be simple_agent or compaction_agent, got 'other_agent'"),
        ("loss_fn.truncated_importance_sampling_type", "tls", "must be null, tis, icepop or seq-mask-tis, got 'tls'"),
        ("async_rl.generation_router.port_range_low", 0,
         "async_rl.generation_router.port_range_low: must be in [1, 65535], got 0"),
        ("async_rl.max_inflight_prompts", 0, "async_rl.max_inflight_prompts: must be >= 1, got 0"),
        ("async_rl.rollout_failure.min_step_batch_fraction", 1.5, "must be in (0, 1], got 1.5"),
        ("policy.optimizer.eps", float("nan"), "policy.optimizer.eps: must be a finite number, got nan"),
        ("env.num_rooms", 17, "env.num_rooms: must be <= env.max_num_rooms (16), got 17"),
        ("faults.inject", [FaultSpec(kind="guard_reject"), FaultSpec(kind="guard_reject", rollout=-1)],
         "faults.inject[1].rollout: must be >= 0, got -1"),
        ("faults.inject", [FaultSpec(kind="meteor")], "faults.inject[0].kind: must be one of context_overflow,"),
    ):
        cfg = load_config()
        *parents, name = path.split(".")
        node = cfg
        for part in parents:
            node = getattr(node, part)
        setattr(node, name, value)
        with pytest.raises(ConfigError) as err:
            validate(cfg)
        assert problem in str(err.value) and str(err.value).startswith(path), (path, str(err.value))
    validate(load_config())  # and the default passes


def test_the_sampler_table_the_config_reads_is_what_the_samplers_declare():
    from minirl.async_rl.samplers import SAMPLERS
    from minirl.config import SAMPLER_TRAITS, SamplerConfig, SamplerName, _choices

    assert list(SAMPLER_TRAITS) == list(SAMPLERS) == list(_choices(SamplerName))
    for name, cls in SAMPLERS.items():
        traits = SAMPLER_TRAITS[name]
        assert (traits.gated, traits.stamps_target_steps, traits.needs_is_correction) == (
            cls.gated, cls.stamps_target_steps, cls.needs_is_correction), name
        assert all(traits.capacity(n, s) == cls.capacity(n, s) for n in (1, 4, 8) for s in (0, 1, 3)), name
    assert SamplerConfig().name in SAMPLER_TRAITS


def test_every_fault_kind_fires_at_the_site_its_table_names():
    """minirl.faults.SITES is the catalogue: each kind's site file asks `fires("kind")` (or `fault`) for it,
    and no site asks for a kind the table does not list."""
    import re

    from minirl.faults import AGENT_SIDE_KINDS, FAULT_KINDS, SITES

    asked: dict[str, set] = {}
    for site in set(SITES.values()):
        path = REPO_ROOT / "minirl" / re.search(r"\((\S+\.py)\)", site).group(1)
        asked[site] = set(re.findall(r"\b(?:fires|fault)\(\"(\w+)\"", path.read_text()))
    for kind, site in SITES.items():
        assert kind in asked[site], (kind, site)
    assert set().union(*asked.values()) == set(FAULT_KINDS)
    assert AGENT_SIDE_KINDS == ("guard_reject", "agent_exception", "timeout", "transport", "bad_output", "agent_kill",
                                "session_lost", "summary_empty", "summary_tool_call", "summary_overflow")


def test_one_fault_site_predicate_per_attempt():
    """fault_site: a per-call kind fires at its planned call only, a per-attempt kind at any call; nothing
    fires without a plan or without coordinates (a request from outside a run)."""
    from minirl.config import FaultsConfig
    from minirl.faults import FaultPlan, fault_site
    from minirl.wire import Coords

    plan = FaultPlan(FaultsConfig(inject=[FaultSpec(kind="model_error", step=0, group=1, call=2)]))
    hit, miss = Coords(0, 1, 0, 0), Coords(0, 2, 0, 0)
    assert [fault_site(plan, hit, call=c)("model_error") for c in range(4)] == [False, False, True, False]
    assert [fault_site(plan, hit)("model_error", c) for c in range(4)] == [False, False, True, False]
    assert fault_site(plan, hit)("model_error") and not fault_site(plan, hit)("timeout")
    assert not fault_site(plan, miss)("model_error") and not fault_site(plan, None, call=2)("model_error")
    assert not fault_site(None, hit, call=2)("model_error")


@pytest.mark.parametrize("data,key,problem", [
    ({"inject": [{"kind": "session_lost", "grup": 1}]}, "faults.inject[0].grup", "unknown config key"),
    ({"inject": [{"kind": "sesion_lost"}]}, "faults.inject[0].kind", "must be one of"),
    ({"rate": {"session_lost": 7}}, "faults.rate.session_lost", "must be a probability in [0, 1], got 7.0"),
    ({"rate_per_room": {"model_error": 0.1}}, "faults.rate_per_room.model_error", "needs the row's room count"),
    ({"sead": 1}, "faults.sead", "unknown config key"),
    ([1], "faults", "give it a mapping of keys, got a list"),
    ({"inject": {"kind": "timeout", "step": 0}}, "faults.inject", "is a list: give it [...], got {'kind': 'timeout'"),
    ({"inject": {"kind": "timeout"}}, "faults.inject.kind", "faults.inject is a list: give it whole"),
    ({"rate": {"timeout": [1]}}, "faults.rate.timeout", "must be a number, got a list [1]"),
])
def test_a_gym_side_fault_plan_is_checked_as_a_runs_is(data, key, problem):
    """The Gym 0.7 doors server's `--faults` (minirl's faults.* as JSON) went into a SimpleNamespace
    unchecked: a misspelt `grup` matched every group, `sesion_lost` never fired, a rate of 7 always did."""
    from minirl.config import faults_section

    with pytest.raises(ConfigError) as err:
        faults_section(data)
    assert err.value.key == key and problem in err.value.problem
    plan = faults_section({"seed": 3, "inject": [{"kind": "session_lost", "step": 1, "group": 0, "rollout": 0}]})
    assert plan.seed == 3 and plan.inject[0].group == 0 and plan.inject[0].attempt is None


def test_a_text_override_keeps_its_text_and_an_interpolation_resolves():
    """Found by review: YAML 1.1 read `run_dir=0755` as 493, `20241204_1200` as 202412041200 and `12:30` as 750,
    so the run wrote to another folder than the one named; and `${grpo.seed}` in an override was refused as
    'not found' (it was resolved against a throwaway one-key config)."""
    for text in ("0755", "20241204_1200", "12:30", "1e3", "true"):
        assert load_config(None, [f"run_dir={text}"]).run_dir == text
    assert load_config(None, ["run_dir=runs/seed_${grpo.seed}", "grpo.seed=7"]).run_dir == "runs/seed_7"
    assert load_config(None, ["grpo.val_period=${grpo.max_num_steps}"]).grpo.val_period == 40
    assert load_config(None, ["run_dir=null"]).run_dir is None and load_config(None, ["grpo.seed=0x10"]).grpo.seed == 16
    with pytest.raises(ConfigError, match=r"^run_dir: .*nope"):
        load_config(None, ["run_dir=${nope}"])


@pytest.mark.parametrize("override,key", [
    ("env.num_rooms_choices=[2,3", "env.num_rooms_choices"), ("faults.inject=[{kind: timeout]", "faults.inject"),
    ("grpo.seed={1", "grpo.seed"), ("=3", "=3")])
def test_a_value_yaml_cannot_read_is_a_config_error_naming_the_key(override, key):
    """Found by review: a value YAML's parser refuses (an unclosed `[`) raised yaml's ParserError, a traceback
    and exit 1 naming no key; an empty key was 'unknown config key'."""
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert err.value.key == key and "\n" not in str(err.value)


def test_a_text_field_keeps_a_value_yaml_cannot_read_as_typed():
    """An IPv6 head's address, a run_dir starting with `{`: a str field's text is the user's, as 0755 is."""
    assert load_config(None, ["cluster.ray_address=[::1]:6379"]).cluster.ray_address == "[::1]:6379"
    assert load_config(None, ["run_dir={x"]).run_dir == "{x"


def test_an_empty_path_is_refused_not_read_as_the_current_directory(tmp_path):
    """`Path('')` is '.': `checkpoint.resume: ""` passed the check and failed later as an untrustworthy
    checkpoint, `data.train_jsonl: ""` said ': is a directory'."""
    for key, text in (("checkpoint", "resume: ''"), ("data", "train_jsonl: ''")):
        (tmp_path / f"{key}.yaml").write_text(f"{key}:\n  {text}\n")
        with pytest.raises(ConfigError, match=rf"^{key}\.(resume|train_jsonl): .*''"):
            load_config(str(tmp_path / f"{key}.yaml"))


def test_a_guard_that_would_refuse_every_call_is_a_config_error():
    guards = "agent.context_history.guards"
    with pytest.raises(ConfigError, match=rf"^{guards}.reserved_generation_tokens: must be < max_total_tokens \(10\)"):
        load_config(None, [f"{guards}.max_total_tokens=10", f"{guards}.reserved_generation_tokens=20"])
    assert load_config(None, [f"{guards}.max_total_tokens=30", f"{guards}.reserved_generation_tokens=20"])


def test_a_host_that_does_not_resolve_or_bind_here_is_a_config_error():
    """Found by review: `cluster.host` was never checked; a typo failed in the first server's bind after Ray
    had started (`gaierror`), naming no key. On a local Ray every server is on this machine, so it must bind."""
    with pytest.raises(ConfigError, match=r"^cluster.host: 'no-such-host\.invalid' does not resolve"):
        load_config(None, ["cluster.host=no-such-host.invalid"])
    import socket

    def foreign(ip: str) -> bool:
        with socket.socket() as s:
            try:
                s.bind((ip, 0))
            except OSError:
                return True
        return False

    ip = next(ip for ip in ("203.0.113.7", "198.51.100.7", "192.0.2.77") if foreign(ip))  # documentation nets
    with pytest.raises(ConfigError, match=rf"^cluster.host: '{ip}': this machine cannot bind it"):
        load_config(None, [f"cluster.host={ip}"])
    for host in ("auto", "127.0.0.1", "localhost", "0.0.0.0"):
        assert load_config(None, [f"cluster.host={host}"]).cluster.host == host


def test_an_unknown_key_near_a_real_one_names_it():
    """A misspelt key says which key it is near; a key near none says only that it is unknown."""
    for override, said in (("grpo.num_prompt_per_step=4", "(did you mean grpo.num_prompts_per_step?)"),
                           ("policy.optimizer.lrr=1", "(did you mean policy.optimizer.lr?)"),
                           ("faults.inject=[{kind: timeout, grup: 1}]", "(did you mean faults.inject[0].group?)")):
        with pytest.raises(ConfigError, match=r"unknown config key " + re.escape(said) + "$"):
            load_config(None, [override])
    with pytest.raises(ConfigError, match=r"^no\.such\.key: unknown config key$"):
        load_config(None, ["no.such.key=1"])
