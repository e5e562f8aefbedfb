"""The generic config loader: YAML + overrides into nested dataclasses, errors with the dotted path."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

import pytest

from unirl.config import loading as config_module
from unirl.config import ConfigError, config_to_dict, dump_config, load_config, resolve_config_path


@dataclass
class Clip:
    low: float = 0.2
    high: float = 0.2


@dataclass
class Algo:
    estimator: Literal["grpo", "rloo"] = "grpo"
    clip: Clip = field(default_factory=Clip)
    kl_coef: float = 0.0
    dual_clip: Optional[float] = None


@dataclass
class Reward:
    name: str
    weight: float = 1.0
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class Trainer:
    total_steps: int = 10
    prompts_per_step: int = 4
    group_size: int = 2
    mini_batch_size: int = 8
    resume: bool = False
    output_dir: Path = Path("runs")
    betas: tuple[float, ...] = (0.9, 0.999)
    log_with: list[str] = field(default_factory=list)

    def __post_init__(self):
        n = self.prompts_per_step * self.group_size
        if n % self.mini_batch_size:
            raise ValueError(f"mini_batch_size={self.mini_batch_size} must divide prompts_per_step*group_size={n}")


@dataclass
class Run:
    model: str
    algo: Algo = field(default_factory=Algo)
    trainer: Trainer = field(default_factory=Trainer)
    rewards: list[Reward] = field(default_factory=lambda: [Reward("gsm8k")])
    seed: int | None = None


@dataclass
class Tuned:
    # A default instance that differs from the class defaults: a partial mapping keeps it.
    clip: Clip = field(default_factory=lambda: Clip(low=0.1, high=0.3))


def error_of(source, overrides=(), cls=Run) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(cls, source, overrides)
    return str(info.value)


@pytest.mark.requires("wandb", why="trainer.log_with=[wandb] is checked to be installed")
def test_yaml_then_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        "model: tiny\n"
        "algo:\n  clip: {high: 0.25}\n  kl_coef: 1e-3\n"  # PyYAML alone would read 1e-3 as a string
        "trainer:\n  total_steps: 3\n  output_dir: out/run\n"
        "rewards:\n  - name: gsm8k\n    kwargs: {method: flexible}\n  - {name: len.py:score, weight: 0.5}\n"
    )
    run = load_config(
        Run,
        path,
        ["algo.clip.high=0.28", "trainer.total_steps=5", "trainer.resume=true", "algo.kl_coef=1e-4",
         "rewards[1].weight=2", "rewards.0.kwargs.format_score=0.1", "seed=null", "trainer.log_with=[wandb]"],
    )
    assert run.algo.clip == Clip(low=0.2, high=0.28)
    assert run.algo.kl_coef == 1e-4 and isinstance(run.algo.kl_coef, float)
    assert run.trainer.total_steps == 5 and run.trainer.resume is True
    assert run.trainer.output_dir == Path("out/run")
    assert run.trainer.log_with == ["wandb"]
    assert run.rewards == [Reward("gsm8k", 1.0, {"method": "flexible", "format_score": 0.1}), Reward("len.py:score", 2.0)]
    assert run.seed is None


def test_defaults_and_int_for_float():
    run = load_config(Run, {"model": "tiny", "algo": {"clip": {"low": 1}}})
    assert run.algo.clip.low == 1.0 and isinstance(run.algo.clip.low, float)
    assert run.trainer == Trainer() and run.rewards == [Reward("gsm8k")]


def test_override_reaches_a_section_missing_from_the_file():
    run = load_config(Run, {"model": "tiny"}, ["trainer.group_size=4", "rewards[0].weight=3"])
    assert run.trainer.group_size == 4 and run.rewards[0] == Reward("gsm8k", 3.0)


def test_partial_mapping_keeps_the_default_instance():
    assert load_config(Tuned, {"clip": {"high": 0.5}}).clip == Clip(low=0.1, high=0.5)


def test_unknown_key_at_depth_2_names_path_and_close_match():
    message = error_of({"model": "tiny", "algo": {"clip": {"hgih": 0.3}}})
    assert message.startswith("algo.clip.hgih: unknown key")
    assert "Did you mean 'high'?" in message and "low, high" in message
    message = error_of({"model": "tiny", "rewards": [{"name": "a", "wieght": 2}]})
    assert message.startswith("rewards[0].wieght: unknown key") and "'weight'" in message


def test_wrong_type_names_path_expected_and_got():
    assert error_of({"model": "tiny", "trainer": {"total_steps": "ten"}}) == "trainer.total_steps: expected int, got str 'ten'"
    assert error_of({"model": "tiny"}, ["trainer.total_steps=2.5"]) == "trainer.total_steps: expected int, got float 2.5"
    assert error_of({"model": 3}) == "model: expected str, got int 3"
    assert error_of({"model": "tiny", "algo": {"clip": 0.2}}).startswith("algo.clip: expected a mapping for Clip, got float")
    assert error_of({"model": "tiny", "trainer": {"betas": [0.9, "x"]}}) == "trainer.betas[1]: expected float, got str 'x'"
    assert error_of({"model": "tiny", "algo": {"dual_clip": "big"}}) == "algo.dual_clip: expected float, got str 'big'"


@pytest.mark.parametrize("value", ["1", "0", "yes", "on", "'true'"])
def test_bool_is_strict(value):
    message = error_of({"model": "tiny"}, [f"trainer.resume={value}"])
    assert message.startswith("trainer.resume: expected bool, got ")


def test_yes_and_no_stay_strings():
    assert load_config(Run, {}, ["model=no"]).model == "no"


def test_literal_error_lists_choices():
    message = error_of({"model": "tiny", "algo": {"estimator": "ppo"}})
    assert message == "algo.estimator: expected one of 'grpo', 'rloo', got str 'ppo'"


def test_missing_required_value_names_path():
    assert error_of({}) == "model: missing required value (str)"
    assert error_of({"model": "tiny", "rewards": [{"weight": 1}]}) == "rewards[0].name: missing required value (str)"


def test_post_init_error_gets_the_dataclass_path():
    message = error_of({"model": "tiny"}, ["trainer.mini_batch_size=3"])
    assert message == "trainer: mini_batch_size=3 must divide prompts_per_step*group_size=8"


@pytest.mark.parametrize(
    "override, expected",
    [
        ("algo.clip.hihg=1", "algo.clip.hihg: unknown key. Did you mean 'high'?"),
        ("trainr.total_steps=1", "trainr: unknown key. Did you mean 'trainer'?"),
        ("algo.kl_coef.x=1", "algo.kl_coef: is a float, it has no key 'x'"),
        ("rewards[4].weight=1", "rewards[4]: index out of range (the list has 1 items)"),
        ("trainer.total_steps", "override 'trainer.total_steps' must look like key=value"),
    ],
)
def test_bad_override_key(override, expected):
    assert error_of({"model": "tiny"}, [override]).startswith(expected)


def test_round_trip(tmp_path):
    run = load_config(Run, {"model": "tiny", "seed": 3}, ["trainer.betas=[0.5, 0.6]", "rewards[0].kwargs.k=[1, 2]"])
    plain = config_to_dict(run)
    assert plain["trainer"]["output_dir"] == "runs" and plain["trainer"]["betas"] == [0.5, 0.6]
    assert load_config(Run, plain) == run
    assert load_config(Run, dump_config(run, tmp_path / "sub" / "run.yaml")) == run


def test_resolve_config_path(tmp_path, monkeypatch):
    file = tmp_path / "mine.yaml"
    file.write_text("model: tiny\n")
    assert resolve_config_path("text", str(file)) == file

    (tmp_path / "configs" / "text").mkdir(parents=True)
    for name in ("gsm8k_qwen", "tiny"):
        (tmp_path / "configs" / "text" / f"{name}.yaml").write_text("model: tiny\n")
    monkeypatch.setattr(config_module, "CONFIGS_ROOT", tmp_path / "configs")
    assert resolve_config_path("text", "tiny") == tmp_path / "configs" / "text" / "tiny.yaml"
    assert resolve_config_path("text", "tiny.yaml") == tmp_path / "configs" / "text" / "tiny.yaml"

    with pytest.raises(ConfigError) as info:
        resolve_config_path("text", "gsm8k_qwn")
    assert "Did you mean 'gsm8k_qwen'?" in str(info.value)
    assert "Available text configs" in str(info.value) and "gsm8k_qwen, tiny" in str(info.value)
    with pytest.raises(ConfigError, match=r"no 'diffusion' config directory .*kinds there: text"):
        resolve_config_path("diffusion", "sd3")


def test_configs_root_is_the_repository_configs_dir():
    assert config_module.CONFIGS_ROOT == Path(config_module.__file__).resolve().parents[2] / "configs"


def test_max_staleness_is_bounded_by_the_runs_steps():
    """issue 51: ``source.max_staleness=1000000000`` was accepted (every batch sampled from the starting weights,
    each checkpoint holding all the remaining batches); it is refused at load, naming both fields."""
    from unirl.text.config import TextConfig

    with pytest.raises(ConfigError, match=r"source.max_staleness=1000000000 is more than trainer.total_steps=100"):
        load_config(TextConfig, {}, ["source.max_staleness=1000000000"])
    assert load_config(TextConfig, {}, ["source.max_staleness=3", "trainer.total_steps=3"]).source.max_staleness == 3
