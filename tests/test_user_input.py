"""Input that meets users halfway: reward shorthands, the prompt column, run directories, absolute paths,
library errors with their cause, ``unirl config list|show``, ``--version`` and config names in ``--help``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from unirl.cli import main


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _problems(out: str) -> list[str]:
    return [line[len("# PROBLEM "):] for line in out.splitlines() if line.startswith("# PROBLEM ")]


def test_rewards_by_name_and_by_file_on_the_command_line(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_rewards.py").write_text("def short(samples, **kwargs):\n    return [0.0] * len(samples)\n")
    code, out, err = _run(capsys, "train", "text", "--config", "tiny", "--dry-run", "rewards=[my_rewards.py:short, gsm8k]",
                          "rewards[1].weight=0.5", f"output_dir={tmp_path / 'run'}")
    assert code == 0, out + err
    assert yaml.safe_load(out)["rewards"] == [{"name": "my_rewards.py:short", "weight": 1.0, "kwargs": {}, "timeout_s": None},
                                              {"name": "gsm8k", "weight": 0.5, "kwargs": {}, "timeout_s": None}]
    assert "# ok      rewards[0].name: my_rewards.py:short resolves" in out
    assert "# ok      rewards[1].name: gsm8k (text reward, built-in)" in out


@pytest.mark.parametrize("row, key", [({"prompt": "p", "question": "q"}, "prompt"), ({"question": "q", "id": 3}, "question"),
                                      ({"text": "t", "id": 3, "score": 0.5}, "text")])
def test_the_prompt_column_is_found(row, key):
    from unirl.text.data import to_prompt_rows

    assert to_prompt_rows([row], adapter="plain", prompt_key=None, source="d.jsonl")[0]["prompt"] == row[key]


def test_a_prompt_column_that_cannot_be_found_names_the_settings():
    from unirl.text.data import to_prompt_rows

    with pytest.raises(ValueError, match=r"d.jsonl: no 'prompt' or 'question' column and 2 text columns \(\['a', 'b'\]\); "
                                       r"set data.prompt_key .* and data.adapter"):
        to_prompt_rows([{"a": "x", "b": "y"}], adapter="plain", prompt_key=None, source="d.jsonl")
    with pytest.raises(ValueError, match=r"row 0 has no 'query' column \(columns: \['prompt'\]\); set data.prompt_key .* "
                                       r"\(data.adapter is 'plain'\)"):
        to_prompt_rows([{"prompt": "x"}], adapter="plain", prompt_key="query", source="d.jsonl")


def test_a_config_from_scratch_reads_trl_style_prompts(tmp_path, capsys, monkeypatch):
    """No adapter, no prompt_key: a file of {"prompt": ...} rows parses (it used to need the GSM8K adapter's columns)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "rows.jsonl").write_text('{"prompt": "Say hi"}\n{"prompt": "Say bye"}\n')
    (tmp_path / "mine.yaml").write_text("model: {name_or_path: tiny}\ndata: {train: rows.jsonl, test: null}\n"
                                        "rewards: [gsm8k]\n")
    code, out, err = _run(capsys, "train", "text", "--config", "mine.yaml", "--dry-run")
    assert code == 0, out + err
    assert "# ok      data.train: rows.jsonl -> 2 rows; the first ones parse with adapter plain" in out


def test_the_dry_run_refuses_a_directory_holding_a_run_as_the_real_run_does(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    code, out, _ = _run(capsys, "train", "text", "--config", "tiny", "--dry-run", "--output-dir", str(run))
    assert code == 2
    assert _problems(out) == [f"output_dir: {run} already holds a run (metrics.jsonl); pass trainer.resume=true to "
                              f"continue it, --new-run (unirl.train(..., new_run=True)) for a fresh directory beside it, "
                              f"or another --output-dir"]
    code, out, _ = _run(capsys, "train", "text", "--config", "tiny", "--dry-run", "--output-dir", str(run),
                        "trainer.resume=true")
    assert code == 0 and f"# ok      output_dir: {run} holds a run that trainer.resume=true continues" in out
    code, out, _ = _run(capsys, "train", "text", "--config", "tiny", "--dry-run", "--output-dir", str(run), "--new-run")
    assert code == 0, out
    fresh = yaml.safe_load(out)["output_dir"]
    assert re.fullmatch(re.escape(str(run)) + r"-\d{8}-\d{6}", fresh) and not Path(fresh).exists()


def test_paths_found_from_the_working_directory_become_absolute(tmp_path, monkeypatch):
    import unirl
    from unirl.config import absolute_paths

    monkeypatch.chdir(tmp_path)
    (tmp_path / "rows.jsonl").write_text('{"prompt": "x"}\n')
    (tmp_path / "r.py").write_text("def f(samples, **kwargs):\n    return [0.0] * len(samples)\n")
    cfg = unirl.load_config("text", "tiny", ["data.train=rows.jsonl", "data.test=missing.jsonl",
                                             "rewards=[r.py:f, gsm8k, unirl.rewards.gsm8k:gsm8k]"])
    absolute_paths(cfg)
    assert cfg.data.train == str(tmp_path / "rows.jsonl") and cfg.data.test == "missing.jsonl"
    assert [r.name for r in cfg.rewards] == [f"{tmp_path / 'r.py'}:f", "gsm8k", "unirl.rewards.gsm8k:gsm8k"]


def test_a_library_error_is_shown_with_its_cause():
    from unirl.cli import _one_line

    def load():
        try:
            raise KeyError("offline mode is enabled")
        except KeyError as err:
            raise OSError("Cannot load model x. Please check out the root cause in the stacktrace above.") from err

    with pytest.raises(OSError) as info:
        load()
    assert _one_line(info.value) == ("Cannot load model x. Please check out the root cause in the stacktrace above.; "
                                     "caused by KeyError: 'offline mode is enabled'")
    assert _one_line(ValueError("unirl's own message")) == "unirl's own message"


def test_config_list_show_version_and_help(capsys):
    code, out, _ = _run(capsys, "config", "list")
    assert code == 0
    assert re.search(r"^text +tiny +The embedded tiny default", out, re.M)
    assert re.search(r"^diffusion +sd3_ocr +FlowGRPO's OCR", out, re.M)
    code, out, _ = _run(capsys, "config", "show", "text", "--config", "tiny", "algo.clip_high=0.3")
    assert code == 0
    rows = {line[2:].split()[0]: line for line in out.splitlines()[1:]}
    assert rows["algo.clip_high"].split() == ["*", "algo.clip_high", "0.3", "0.2"]  # changed: value, default
    assert rows["algo.clip_low"].split() == ["algo.clip_low", "0.2", "0.2"]
    assert rows["trainer.total_steps"].split() == ["*", "trainer.total_steps", "150", "100"]
    from unirl.config import config_to_dict
    from unirl.cli.config import flatten
    from unirl.text.config import TextConfig

    assert set(rows) == set(flatten(config_to_dict(TextConfig())))  # every key
    with pytest.raises(SystemExit):
        main(["--version"])
    from unirl import __version__

    assert capsys.readouterr().out.strip() == f"unirl {__version__}"
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    from unirl.config import CONFIGS_ROOT

    shipped = ", ".join(sorted(p.stem for p in (CONFIGS_ROOT / "diffusion").glob("*.yaml")))  # every shipped one
    assert {"sd3_geneval", "sd3_ocr", "tiny", "flux_pickscore"} <= set(shipped.split(", "))
    assert f"config name (diffusion: {shipped}; text:" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("env", ["text", "diffusion"])
def test_every_recipe_sets_its_keys_and_the_overrides_win(env):
    import unirl
    from unirl.config import config_to_dict
    from unirl.cli.config import flatten
    from unirl.config.recipes import RECIPES

    base = flatten(config_to_dict(unirl.load_config(env, "tiny")))
    for name, recipe in RECIPES.items():
        cfg = flatten(config_to_dict(unirl.load_config(env, "tiny", recipe=name)))
        assert {k: cfg[k] for k in recipe.keys} == recipe.keys, name
        assert {k: v for k, v in cfg.items() if k not in recipe.keys} == {k: v for k, v in base.items() if k not in recipe.keys}
    cfg = unirl.load_config(env, "tiny", ["algo.clip_high=0.001"], recipe="gspo")
    assert (cfg.algo.clip_low, cfg.algo.clip_high) == (3e-4, 0.001)
    with pytest.raises(ValueError, match=r"unknown recipe 'dr-grpo'. Did you mean 'dr_grpo'\?"):
        unirl.load_config(env, "tiny", recipe="dr-grpo")


def test_the_recipe_option_on_the_command_line(tmp_path, capsys):
    code, out, err = _run(capsys, "train", "text", "--config", "tiny", "--recipe", "dr_grpo", "--dry-run",
                          "--output-dir", str(tmp_path / "run"))
    assert code == 0, out + err
    algo = yaml.safe_load(out)["algo"]
    assert (algo["adv_scale"], algo["loss_agg"]) == ("none", "seq-mean-token-sum-norm")
    code, out, _ = _run(capsys, "config", "list")
    assert "dr_grpo   algo.adv_estimator=grpo, algo.adv_scale=none, algo.loss_agg=seq-mean-token-sum-norm: Dr. GRPO" in out
