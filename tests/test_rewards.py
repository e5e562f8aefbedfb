"""Rewards: GSM8K answer extraction, the registry and loaders, score_batch checks, and real GSM8K data."""

from __future__ import annotations

import doctest
import json
import math
from pathlib import Path

import pytest

import unirl.rewards.gsm8k
from unirl.rewards import registry
from unirl.rewards.gsm8k import extract_answer, gold_answer, gsm8k
from unirl.rewards.registry import RewardError, load_reward, register_reward, reward_info, score_batch

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"


# ----------------------------------------------------------------------------------------------
# Extraction
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, strict, flexible",
    [
        ("3 + 4 = <<3+4=7>>7\n#### 7", "7", "7"),
        ("#### 1,000", "1000", "1000"),
        ("#### $5.00", "5", "5"),
        ("####  -3", "-3", "-3"),
        ("#### 2.50", "2.5", "2.5"),
        ("#### 18.0.", "18", "18"),
        ("#### 0.75", "0.75", "0.75"),
        ("#### 12\nwait, no\n#### 13", "13", "13"),  # the last marker wins
        ("#### 12\n#### none", "12", "12"),  # the last "#### N" counts, as in verl
        ("######5#", None, "5"),  # not the marker: exactly four "#"
        ("#### 5 apples, 7 pears", "5", "7"),
        ("She makes 9 * 2 = $18 a day.", None, "18"),
        ("A: 1,234,567", None, "1234567"),
        ("16-3-4 = 9, then 10-3", None, "3"),  # a minus after a number is not a sign
        ("It dropped by -3.5 degrees.", None, "-3.5"),
        ("costs $.50", None, "0.5"),
        ("1, 2, 3", None, "3"),
        ("007 agents", None, "7"),
        ("no number here", None, None),
        ("", None, None),
    ],
)
def test_extract_answer_normalized(text, strict, flexible):
    """unirl's normalising extraction (verl's own strict/flexible: tests/test_gsm8k_verl.py)."""
    assert extract_answer(text, "strict_normalized") == strict
    assert extract_answer(text, "flexible_normalized") == flexible


def test_extract_answer_rejects_unknown_method():
    with pytest.raises(ValueError, match="one of strict, flexible, strict_normalized, flexible_normalized; got 'loose'"):
        extract_answer("#### 1", "loose")


def test_gold_answer():
    gold = "Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 eggs.\n#### 1,800"
    # verl's methods: the string its preprocessing stores.
    assert gold_answer(gold) == gold_answer(gold, "flexible") == "1800"
    assert gold_answer(" 72 ") == gold_answer(72) == "72" and gold_answer("72.0") == "72.0"
    assert gold_answer("seventy-two") == "seventy-two"  # never equal to an extracted number, as in verl
    with pytest.raises(ValueError, match="must have '#### N'"):
        gold_answer("so ####72")
    # The normalising methods normalise the gold too.
    assert gold_answer(gold, "strict_normalized") == "1800"
    assert gold_answer("72", "flexible_normalized") == gold_answer(72, "strict_normalized") == "72"
    assert gold_answer("72.0", "strict_normalized") == "72"
    with pytest.raises(ValueError, match="must be a number or end in '#### N'"):
        gold_answer("seventy-two", "strict_normalized")


def test_gsm8k_reward_semantics_normalized():
    samples = ["#### 72", "#### 71", "the answer is 72", "#### $72.00", "no idea"]
    gold = ["Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72"] * 4 + ["72"]
    assert gsm8k(samples, answer=gold, method="strict_normalized") == [1.0, 0.0, 0.0, 1.0, 0.0]
    assert gsm8k(samples, answer=gold, method="flexible_normalized", format_score=0.1, correct_score=2.0,
                 prompts=["q"] * 5) == [2.0, 0.1, 2.0, 2.0, 0.0]
    # verl's methods on the same samples: "#### $72.00" has no strict answer and a flexible "72.00" != "72".
    assert gsm8k(samples, answer=gold) == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert gsm8k(samples, answer=gold, method="flexible", format_score=0.1, correct_score=2.0) == [
        2.0, 0.1, 2.0, 0.1, 0.0
    ]
    with pytest.raises(ValueError, match="2 samples but 1 gold"):
        gsm8k(["#### 1", "#### 2"], answer=["1"])


def test_gsm8k_doctests():
    result = doctest.testmod(unirl.rewards.gsm8k)
    assert result.attempted >= 5 and result.failed == 0


# ----------------------------------------------------------------------------------------------
# Registry and loading
# ----------------------------------------------------------------------------------------------




def test_builtin_is_found_by_name():
    assert load_reward("gsm8k") is gsm8k
    info = reward_info("gsm8k")
    assert info.modality == "text" and info.description.startswith("GSM8K exact match")


def test_register_and_duplicate(isolated_registry):
    @register_reward("length", modality="text")
    def length(samples, **kwargs):
        """Characters per sample.

        More text that is not the description.
        """
        return [float(len(s)) for s in samples]

    assert reward_info("length").description == "Characters per sample."
    with pytest.raises(ValueError, match="'length' is already registered"):
        register_reward("length")(lambda samples, **kwargs: [0.0] * len(samples))
    with pytest.raises(ValueError, match="modality must be 'text' or 'image'"):
        register_reward("x", modality="audio")


def test_unknown_name_lists_available():
    with pytest.raises(RewardError) as info:
        load_reward("gsm8")
    message = str(info.value)
    assert "unknown reward 'gsm8'" in message and "Did you mean 'gsm8k'?" in message
    available = message.split("Available: ")[1].split(". Or give")[0].split(", ")
    assert available == sorted(available)  # every registered name, sorted
    assert {"aesthetic", "clip_score", "gsm8k", "math_verify", "pickscore"} <= set(available)


def test_load_from_file_binds_kwargs(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(
        "def contains(samples, *, word='cat', bonus=1.0, **kwargs):\n"
        "    return [bonus if word in s else 0.0 for s in samples]\n"
        "LIMIT = 3\n"
    )
    fn = load_reward(f"{path}:contains", word="dog", bonus=2.0)
    assert fn(["a dog", "a cat"], prompts=["p", "p"]) == [2.0, 0.0]
    assert fn.__name__ == "contains"
    assert load_reward(f"{path}:contains")(["a cat"]) == [1.0]  # imported once, same module

    with pytest.raises(RewardError, match=r"has no parameter 'wrod'. Did you mean 'word'\?"):
        load_reward(f"{path}:contains", wrod="dog")
    with pytest.raises(RewardError, match=r"file not found: .*missing\.py"):
        load_reward(f"{tmp_path}/missing.py:contains")
    with pytest.raises(RewardError, match=r"my_reward\.py has no function 'contain'. Did you mean 'contains'\?"):
        load_reward(f"{path}:contain")
    with pytest.raises(RewardError, match="'LIMIT' in file .* is a int, not a function"):
        load_reward(f"{path}:LIMIT")
    with pytest.raises(RewardError, match=r"name the function too, as .*my_reward\.py:function"):
        load_reward(str(path))


def test_load_from_module_binds_kwargs():
    fn = load_reward("unirl.rewards.gsm8k:gsm8k", method="flexible")
    assert fn(["it is 72"], answer=["72"]) == [1.0]
    with pytest.raises(RewardError, match="cannot import module 'unirl.rewards.nope'"):
        load_reward("unirl.rewards.nope:gsm8k")
    with pytest.raises(RewardError, match="module unirl.rewards.gsm8k has no function 'gsm9k'. Did you mean 'gsm8k'"):
        load_reward("unirl.rewards.gsm8k:gsm9k")


def test_builtin_with_missing_dependency(isolated_registry, tmp_path, monkeypatch):
    # A built-in module whose optional package is missing: its rewards are reported with what to
    # install, the other built-ins still load.
    (tmp_path / "unirl_test_ocr_reward.py").write_text(
        "import unirl_surely_missing_package\n"
        "from unirl.rewards.registry import register_reward\n"
        "@register_reward('ocr_test', modality='image')\n"
        "def ocr_test(samples, **kwargs):\n"
        "    return [0.0] * len(samples)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    isolated_registry.BUILTIN_MODULES.append("unirl_test_ocr_reward")
    with pytest.raises(RewardError, match="unirl_test_ocr_reward needs 'unirl_surely_missing_package': pip install"):
        load_reward("ocr_test")
    assert load_reward("gsm8k") is gsm8k
    assert "unirl_test_ocr_reward" in isolated_registry.unavailable_builtins()


def test_builtin_whose_dependency_crashes_on_import(isolated_registry, tmp_path, monkeypatch):
    # E.g. a torchvision built for another torch raises RuntimeError on import: that module's
    # rewards are unavailable, with the error; the others still load.
    (tmp_path / "unirl_test_crashing_dep.py").write_text("raise RuntimeError('operator torchvision::nms does not exist')\n")
    (tmp_path / "unirl_test_uses_crashing_dep.py").write_text("import unirl_test_crashing_dep\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    isolated_registry.BUILTIN_MODULES.append("unirl_test_uses_crashing_dep")
    assert load_reward("gsm8k") is gsm8k
    assert isolated_registry.unavailable_builtins()["unirl_test_uses_crashing_dep"] == (
        "unirl_test_uses_crashing_dep failed to import: RuntimeError: operator torchvision::nms does not exist")


def test_a_bug_in_our_own_reward_module_is_raised_not_hidden():
    # Only a dependency's failure makes a built-in "unavailable"; a bug in rewards/ must surface.
    ours = str(Path(registry.__file__).parent / "imaginary.py")
    assert registry._raised_in_rewards_package(SyntaxError("invalid syntax", (ours, 1, 1, "def (")))
    with pytest.raises(NameError) as info:
        exec(compile("undefined_name", ours, "exec"))
    assert registry._raised_in_rewards_package(info.value)
    with pytest.raises(NameError) as info:
        exec(compile("undefined_name", "/elsewhere/torchvision/__init__.py", "exec"))
    assert not registry._raised_in_rewards_package(info.value)


# ----------------------------------------------------------------------------------------------
# score_batch
# ----------------------------------------------------------------------------------------------


def test_score_batch_accepts_lists_and_arrays():
    import numpy as np
    import torch

    assert score_batch(gsm8k, ["#### 1", "#### 2"], name="gsm8k", answer=["1", "1"], prompts=["a", "b"]) == [1.0, 0.0]
    assert score_batch(lambda s, **kw: np.array([0.5, 1]), ["a", "b"], name="np") == [0.5, 1.0]
    assert score_batch(lambda s, **kw: torch.tensor([0.25, 1.0], requires_grad=True), ["a", "b"], name="t") == [0.25, 1.0]
    # None: "does not apply", passed through for RewardSet to leave out.
    assert score_batch(lambda s, **kw: [None, 2], ["a", "b"], name="none") == [None, 2.0]
    with pytest.raises(RewardError, match=r"reward 'arr' returned an array of shape \(2, 1\), expected \(2,\)"):
        score_batch(lambda s, **kw: np.zeros((2, 1)), ["a", "b"], name="arr")


@pytest.mark.parametrize(
    "returned, expected",
    [
        ([1.0], "reward 'bad' returned 1 scores for 2 samples"),
        ([1.0, math.nan], "reward 'bad' returned nan for sample 1 (prompt 'q1'); scores must be finite"),
        ([math.inf, 1.0], "reward 'bad' returned inf for sample 0"),
        ([1.0, "1"], "reward 'bad' returned '1' for sample 1 (prompt 'q1'); scores must be floats (or None"),
        ([[1.0], [2.0]], "reward 'bad' returned [1.0] for sample 0 (prompt 'q0')"),
        (0.5, "reward 'bad' returned float, expected a list of 2 floats"),
    ],
)
def test_score_batch_errors(returned, expected):
    with pytest.raises(RewardError) as info:
        score_batch(lambda samples, **kwargs: returned, ["x", "y"], name="bad", prompts=["q0", "q1"])
    assert str(info.value).startswith(expected)


def test_score_batch_checks_column_length():
    with pytest.raises(RewardError, match="reward 'gsm8k': column 'answer' has 1 values for 2 samples"):
        score_batch(gsm8k, ["#### 1", "#### 2"], name="gsm8k", answer=["1"])


# ----------------------------------------------------------------------------------------------
# Real GSM8K data
# ----------------------------------------------------------------------------------------------


def read_jsonl(name: str) -> list[dict]:
    path = DATA / name
    if not path.is_file():
        pytest.skip(f"GSM8K data not found at {path} (expected ../shared/data/gsm8k beside the repository)")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_reference_solutions_score_one():
    rows = read_jsonl("test.jsonl")
    answers = [row["answer"] for row in rows]
    scores = score_batch(gsm8k, answers, name="gsm8k", answer=answers, prompts=[row["question"] for row in rows])
    assert len(scores) == 1319
    assert [i for i, s in enumerate(scores) if s != 1.0] == []


def test_flexible_normalized_extraction_agrees_with_labels():
    rows = read_jsonl("example_model_solutions.jsonl")
    models = sorted(key for key, value in rows[0].items() if isinstance(value, dict) and "is_correct" in value)
    assert models == ["175b_finetuning", "175b_verification", "6b_finetuning", "6b_verification"]
    agree = total = 0
    for row in rows:
        last_line = row["ground_truth"].strip().splitlines()[-1]
        assert last_line.startswith("A: ")
        gold = extract_answer(last_line, "flexible_normalized")
        for model in models:
            predicted = extract_answer(row[model]["solution"], "flexible_normalized")
            agree += (predicted == gold) == row[model]["is_correct"]
            total += 1
    rate = agree / total
    print(f"flexible_normalized extraction agrees with is_correct on {agree}/{total} = {rate:.4f} of GSM8K model solutions")
    assert total == 4 * 1319
    assert rate >= 0.99
