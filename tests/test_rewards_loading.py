"""Every way a reward gets in (name, file, module, entry point, a config naming all four), the class
shape with config kwargs, async rewards, and each bad-reward case with its message."""

from __future__ import annotations

import re
import textwrap

import pytest

from unirl.rewards import registry
from unirl.rewards.loading import list_rewards, load_reward, reward_info
from unirl.rewards.registry import RewardError
from unirl.rewards.scoring import score_batch
from unirl.config.schema import RewardConfig
from unirl.reward_set import RewardSet




PLUGIN = '''
from unirl.rewards.registry import register_reward

def shout(samples, *, bonus=1.0, **kwargs):
    """Bonus for every exclamation mark."""
    return [bonus * s.count("!") for s in samples]

@register_reward("unirl_test_brightness", modality="image")
def brightness(samples, **kwargs):
    """Mean pixel value in [0, 1]."""
    return [sum(img.convert("L").getdata()) / (255.0 * img.width * img.height) for img in samples]
'''


@pytest.fixture
def installed_plugin(tmp_path, monkeypatch, isolated_registry):
    """A throw-away installed package: its module and a ``*.dist-info`` with ``entry_points.txt``
    on ``sys.path``, which ``importlib.metadata.entry_points`` really reads (as for a pip install)."""
    site = tmp_path / "site"
    (site / "unirl_test_plugin").mkdir(parents=True)
    (site / "unirl_test_plugin" / "__init__.py").write_text(PLUGIN)
    info = site / "unirl_test_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: unirl-test-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[unirl.rewards]\n"
        "unirl_test_shout = unirl_test_plugin:shout\n"
        "unirl_test_brightness = unirl_test_plugin:brightness\n"
        "unirl_test_broken = unirl_test_plugin_missing:fn\n"
    )
    monkeypatch.syspath_prepend(str(site))
    yield site
    import sys

    sys.modules.pop("unirl_test_plugin", None)


# ----------------------------------------------------------------------------------------------
# Ways in
# ----------------------------------------------------------------------------------------------


def test_entry_point_reward_is_found_listed_and_takes_kwargs(installed_plugin):
    fn = load_reward("unirl_test_shout", bonus=2.0)
    assert fn(["hi!!", "no"], prompts=["p", "p"]) == [4.0, 0.0]
    info = reward_info("unirl_test_shout")
    assert (info.modality, info.description) == ("text", "Bonus for every exclamation mark.")
    assert info.source == "entry point unirl-test-plugin 0.1 (unirl_test_plugin:shout)"
    # The module registered this one itself, with its modality; the entry point names the source.
    assert reward_info("unirl_test_brightness").modality == "image"
    assert reward_info("unirl_test_brightness").source.startswith("entry point unirl-test-plugin 0.1")

    listed = {info.name: info for info in list_rewards()}
    assert {"gsm8k", "math_verify", "unirl_test_shout", "unirl_test_brightness"} <= set(listed)
    assert listed["gsm8k"].source == "built-in"
    # A broken entry point does not hide the others; it is reported, and asking for it says why.
    assert "failed to import: ModuleNotFoundError" in registry.unavailable_builtins()["entry point unirl_test_broken"]
    with pytest.raises(RewardError, match="unknown reward 'unirl_test_broken'.*unirl_test_plugin_missing"):
        load_reward("unirl_test_broken")


def test_rewards_list_command(installed_plugin, capsys):
    import argparse

    from unirl.cli.rewards import add_parser

    parser = argparse.ArgumentParser(prog="unirl")  # as unirl/cli/__init__.py wires it
    add_parser(parser.add_subparsers(dest="command", required=True), argparse.ArgumentParser(add_help=False))
    args = parser.parse_args(["rewards", "list"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].split() == ["NAME", "MODALITY", "SOURCE", "DESCRIPTION"]
    row = next(line for line in lines if line.startswith("unirl_test_shout "))
    assert row.split(None, 2)[1] == "text"
    assert re.search(r"entry point unirl-test-plugin 0\.1 \(unirl_test_plugin:shout\) +Bonus for every exclamation mark\.$", row)
    gsm8k = next(line for line in lines if line.startswith("gsm8k "))
    assert gsm8k.split()[1:3] == ["text", "built-in"] and "GSM8K exact match" in gsm8k
    assert next(line for line in lines if line.startswith("pickscore ")).split()[1] == "image"
    assert "not available:" in out and "entry point unirl-test-plugin 0.1 unirl_test_broken" in out


def test_entry_point_is_imported_only_when_its_name_is_asked_for(installed_plugin):
    import sys

    load_reward("gsm8k")
    assert "unirl_test_plugin" not in sys.modules  # a built-in name never imports plugins
    load_reward("unirl_test_shout")
    assert "unirl_test_plugin" in sys.modules


def test_entry_point_clashing_with_a_builtin_is_an_error(tmp_path, monkeypatch, isolated_registry):
    info = tmp_path / "clash-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: clash\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[unirl.rewards]\ngsm8k = json:dumps\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RewardError, match="reward 'gsm8k' from entry point clash 0.1 .* clashes with .* built-in"):
        list_rewards()


def test_config_with_every_kind_of_spec(installed_plugin, tmp_path):
    from unirl.config import load_config
    from unirl.text.config import TextConfig

    reward_file = tmp_path / "my_reward.py"
    reward_file.write_text("def short(samples, *, limit=10, **kwargs):\n    return [float(len(s) <= limit) for s in samples]\n")
    config = tmp_path / "run.yaml"
    config.write_text(textwrap.dedent(f"""\
        rewards:
          - name: gsm8k                      # a registered name
            kwargs: {{method: strict}}
          - name: {reward_file}:short        # a file
            weight: 0.5
            kwargs: {{limit: 9}}
          - name: unirl.rewards.mathverify:math_verify_reward   # a module
            weight: 2.0
          - name: unirl_test_shout           # an entry point of an installed package
            weight: 0.25
        """))
    cfg = load_config(TextConfig, config)
    assert [r.name for r in cfg.rewards][0] == "gsm8k" and cfg.rewards[1].kwargs == {"limit": 9}

    rs = RewardSet(cfg.rewards)
    samples = ["It is 12!", r"#### 13, so $\boxed{13}$"]
    comp = rs.components(samples, prompts=["q0", "q1"], columns={"answer": ["12", "13"]})
    # By hand: gsm8k strict needs "####": none in sample 0 -> 0; 13 == 13 -> 1.
    assert comp["gsm8k"].tolist() == [0.0, 1.0]
    # short (limit 9): "It is 12!" has 9 characters -> 1; the second has 24 -> 0.
    assert comp["short"].tolist() == [1.0, 0.0]
    # math_verify: no LaTeX in sample 0 -> 0; \boxed{13} == 13 -> 1.
    assert comp["math_verify_reward"].tolist() == [0.0, 1.0]
    # shout: one "!" -> 1; none -> 0.
    assert comp["unirl_test_shout"].tolist() == [1.0, 0.0]
    total, metrics = rs.combine(comp, torch_tensor([0, 0]))
    # total = 1 * gsm8k + 0.5 * short + 2 * math_verify + 0.25 * shout
    #       = [0 + 0.5 + 0 + 0.25, 1 + 0 + 2 + 0]
    assert total.tolist() == [0.75, 3.0]
    assert metrics == {"reward/gsm8k": 0.5, "reward/short": 0.5, "reward/math_verify_reward": 0.5,
                       "reward/unirl_test_shout": 0.5}


def torch_tensor(values):
    import torch

    return torch.tensor(values)


# ----------------------------------------------------------------------------------------------
# The class shape and async rewards
# ----------------------------------------------------------------------------------------------


def test_class_reward_is_instantiated_once_with_config_kwargs(tmp_path):
    path = tmp_path / "cls_reward.py"
    path.write_text(textwrap.dedent('''\
        class Counter:
            """Scores the length of each sample times a factor; counts its instances."""
            instances = 0

            def __init__(self, *, factor=1.0):
                type(self).instances += 1
                self.factor = factor

            def __call__(self, samples, *, prompts, **kwargs):
                return [self.factor * len(s) for s in samples]
        '''))
    rs = RewardSet([RewardConfig(f"{path}:Counter", kwargs={"factor": 0.5})])
    for _ in range(3):
        comp = rs.components(["ab", "abcd"], prompts=["p", "p"], columns={})
    assert comp["Counter"].tolist() == [1.0, 2.0]
    assert type(rs.fns[0]).instances == 1
    with pytest.raises(RewardError, match=r"has no parameter 'factr'. Did you mean 'factor'\?"):
        load_reward(f"{path}:Counter", factr=2)


def test_model_reward_kwargs_reach_the_base_class(tmp_path):
    path = tmp_path / "model_reward.py"
    path.write_text(textwrap.dedent('''\
        from unirl.rewards.models import ModelReward

        class Lengths(ModelReward):
            loads = 0

            def __init__(self, *, scale=1.0, **kwargs):
                super().__init__(**kwargs)
                self.scale = scale

            def load(self):
                type(self).loads += 1

            def score(self, samples, *, prompts, **columns):
                return [self.scale * len(s) + len(samples) / 100 for s in samples]
        '''))
    fn = load_reward(f"{path}:Lengths", scale=2.0, batch_size=2, device="cpu")
    assert type(fn).loads == 0  # lazily: nothing loaded until the first batch
    # Batches of 2, 2, 1: the "+ batch size / 100" term shows how the samples were cut.
    assert score_batch(fn, ["a", "bb", "ccc", "dddd", "e"], name="lengths", prompts=["p"] * 5) == [
        2.02, 4.02, 6.02, 8.02, 2.01]
    fn(["a"], prompts=["p"])
    assert type(fn).loads == 1 and fn.device == "cpu" and fn.batch_size == 2
    with pytest.raises(RewardError, match="has no parameter 'batchsize'. Did you mean 'batch_size'"):
        load_reward(f"{path}:Lengths", batchsize=2)


def test_async_reward(tmp_path):
    path = tmp_path / "async_reward.py"
    path.write_text("import asyncio\nasync def slow(samples, *, delay=0.01, **kw):\n"
                    "    await asyncio.sleep(delay)\n    return [float(len(s)) for s in samples]\n")
    fn = load_reward(f"{path}:slow", delay=0.0)
    assert score_batch(fn, ["ab", "c"], name="slow", prompts=["p", "q"]) == [2.0, 1.0]


# ----------------------------------------------------------------------------------------------
# Bad rewards fail loudly, with the reward, the sample and its prompt
# ----------------------------------------------------------------------------------------------


BAD = '''
def raises_on_two(samples, **kwargs):
    return [1.0 / (len(s) - 2) for s in samples]        # ZeroDivisionError for "ab"

def batch_dependent(samples, **kwargs):
    if len(samples) > 1:
        raise RuntimeError("batch too big")
    return [0.0] * len(samples)

def too_few(samples, **kwargs):
    return [0.0] * (len(samples) - 1)

def nan(samples, **kwargs):
    return [0.0, float("nan")]

def inf(samples, **kwargs):
    return [float("-inf"), 0.0]

async def async_raises(samples, **kwargs):
    raise KeyError("missing column")
'''


@pytest.fixture
def bad(tmp_path):
    path = tmp_path / "bad.py"
    path.write_text(BAD)
    return lambda fn: load_reward(f"{path}:{fn}")


@pytest.mark.parametrize(
    "fn, message",
    [
        ("raises_on_two", r"reward 'r' raised ZeroDivisionError: float division by zero on sample 1 \(prompt 'second'\) "
                          r"\(found by re-scoring the batch of 2 one sample at a time\)"),
        ("batch_dependent", r"reward 'r' raised RuntimeError: batch too big on a batch of 2 samples; re-scored one at a "
                            r"time, none of the first 2 raised.*\(first sample \(prompt 'first'\)\)"),
        ("too_few", r"reward 'r' returned 1 scores for 2 samples"),
        ("nan", r"reward 'r' returned nan for sample 1 \(prompt 'second'\); scores must be finite"),
        ("inf", r"reward 'r' returned -inf for sample 0 \(prompt 'first'\); scores must be finite"),
        ("async_raises", r"reward 'r' raised KeyError: 'missing column' on sample 0 \(prompt 'first'\)"),
    ],
)
def test_bad_reward_messages(bad, fn, message):
    with pytest.raises(RewardError, match=message):
        score_batch(bad(fn), ["abc", "ab"], name="r", prompts=["first", "second"])


def test_bad_specs_say_what_is_missing(tmp_path):
    with pytest.raises(RewardError, match=r"unknown reward 'pickscor'. Did you mean 'pickscore'\?|unknown reward 'pickscor'"):
        load_reward("pickscor")
    with pytest.raises(RewardError, match=r"Available: .*gsm8k.*math_verify"):
        load_reward("nope")
    with pytest.raises(RewardError, match=r"file not found: .*nowhere\.py"):
        load_reward(f"{tmp_path}/nowhere.py:fn")
    (tmp_path / "r.py").write_text("def score(samples, **kw):\n    return [0.0] * len(samples)\n")
    with pytest.raises(RewardError, match=r"r\.py has no function 'scor'. Did you mean 'score'\?"):
        load_reward(f"{tmp_path}/r.py:scor")
    with pytest.raises(RewardError, match="cannot import module 'no_such_pkg.rewards'"):
        load_reward("no_such_pkg.rewards:fn")
    (tmp_path / "ctor.py").write_text("class Bad:\n    def __init__(self, *, path='x'):\n        open(path)\n")
    with pytest.raises(RewardError, match=r"Bad\(\*\*\{'path': '/no/such'\}\) raised FileNotFoundError"):
        load_reward(f"{tmp_path}/ctor.py:Bad", path="/no/such")


def test_loading_never_evaluates_strings(tmp_path):
    marker = tmp_path / "evaluated"
    spec = f"__import__('pathlib').Path({str(marker)!r}).touch():x"
    with pytest.raises(RewardError):
        load_reward(spec)
    assert not marker.exists()
