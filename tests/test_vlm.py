"""The tiny vision-language model, image rows and the image path of the log-prob recompute (issue 35)."""

from __future__ import annotations

import io
import json

import pytest
import torch
from conftest import text_env
from PIL import Image

from unirl.text.logprobs import response_logprobs
from unirl.text.tiny_vlm import build_tiny_vlm
from unirl.text.vlm import VLMProcessor, image_token_mask, row_images, vision_inputs


@pytest.fixture(scope="module")
def vlm():
    from transformers import AutoModelForImageTextToText

    path = build_tiny_vlm()
    model = AutoModelForImageTextToText.from_pretrained(path).eval()
    return path, model, VLMProcessor.from_pretrained(path)


def _picture(colour, size=(64, 48)):
    return Image.new("RGB", size, colour)


def test_tiny_vlm_is_a_real_qwen2_vl_directory(vlm):
    path, model, processor = vlm
    assert type(model).__name__ == "Qwen2VLForConditionalGeneration"
    assert model.config.vision_config.embed_dim // model.config.vision_config.num_heads == 64  # vLLM CPU floor
    text = processor.prompt_text("what colour?", 2)
    assert text.count("<|vision_start|><|image_pad|><|vision_end|>") == 2 and text.endswith("<|im_start|>assistant\n")
    enc = processor.encode(text, [_picture("red"), _picture("blue", (30, 90))])
    # About 56*56 pixels each, aspect kept in multiples of 28: 64x48 -> 56x56, a 4x4 grid of 14-pixel
    # patches merged 2x2 into 4 image tokens; 30x90 -> 56 wide x 112 high, 4x8 patches, 8 tokens.
    assert enc["image_grid_thw"].tolist() == [[1, 4, 4], [1, 8, 4]]
    assert enc["pixel_values"].shape == (16 + 32, 3 * 2 * 14 * 14)
    ids = torch.tensor(enc["input_ids"])
    assert int(image_token_mask(ids, model.config.image_token_id).sum()) == 4 + 8


def test_processor_matches_transformers_qwen2_vl_processor(vlm):
    pytest.importorskip("torchvision")  # transformers 5 builds Qwen2VLProcessor only with torchvision
    from transformers import AutoProcessor

    path, _, processor = vlm
    text = processor.prompt_text("what colour?", 2)
    enc = processor.encode(text, [_picture("red"), _picture("blue", (30, 90))])
    reference = AutoProcessor.from_pretrained(path)(text=[text], images=[_picture("red"), _picture("blue", (30, 90))],
                                                    return_tensors="pt")  # transformers 5.17 answers lists without it
    assert reference["input_ids"][0].tolist() == enc["input_ids"]
    torch.testing.assert_close(reference["pixel_values"], enc["pixel_values"])


def test_row_images_accepts_paths_pil_bytes_and_dicts_and_names_the_bad_row(tmp_path):
    _picture("green").save(tmp_path / "a.png")
    buffer = io.BytesIO()
    _picture("red").save(buffer, format="PNG")
    row = {"prompt": "x", "images": ["a.png", _picture("blue"), buffer.getvalue(), {"bytes": buffer.getvalue(), "path": None}]}
    images = row_images(row, 0, base_dir=tmp_path)
    assert [im.getpixel((0, 0)) for im in images] == [(0, 128, 0), (0, 0, 255), (255, 0, 0), (255, 0, 0)]
    assert row_images({"prompt": "x"}, 0) == []
    assert len(row_images({"images": str(tmp_path / "a.png")}, 0)) == 1  # one image, not in a list
    with pytest.raises(FileNotFoundError, match=r"row 7: images\[0\]: image file .*missing.png"):
        row_images({"images": ["missing.png"]}, 7, base_dir=tmp_path)
    with pytest.raises(ValueError, match=r"row 3: images\[1\]: 5 bytes is not a readable image"):
        row_images({"images": [buffer.getvalue(), b"hello"]}, 3)
    with pytest.raises(TypeError, match=r"row 2: images\[0\]: expected an image path.*got int"):
        row_images({"images": [5]}, 2)


def test_processor_refuses_a_prompt_whose_images_do_not_match(vlm):
    _, _, processor = vlm
    with pytest.raises(ValueError, match="places 1 image.*row has 2"):
        processor.encode(processor.prompt_text("q", 1), [_picture("red"), _picture("red")])


def test_recomputed_logprobs_with_images_equal_the_samplers_and_use_the_image(vlm):
    """The trainer's path (``response_logprobs`` with the pixel values as model kwargs and Qwen2-VL's own
    3-D positions) gives the log-probs the HF sampler drew with; another picture changes them."""
    _, model, processor = vlm
    text = processor.prompt_text("what colour?", 1)
    enc = processor.encode(text, [_picture("red")])
    ids = torch.tensor([enc["input_ids"]])
    image_id = model.config.image_token_id
    # The sampler must get mm_token_type_ids too: without them transformers' generate silently gives the
    # prompt 1-D text positions (its log-probs then differ from the 3-D ones by ~3e-3 on this model).
    pixels = vision_inputs(ids, enc["pixel_values"], enc["image_grid_thw"], image_id)
    torch.manual_seed(0)
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **pixels, max_new_tokens=6,
                         do_sample=True, min_new_tokens=6, output_logits=True, return_dict_in_generate=True)
    response = out.sequences[:, ids.shape[1]:]  # [1, R]
    sampler = torch.stack([torch.log_softmax(s.float(), -1) for s in out.logits], 1)  # [1, R, V]
    sampler = sampler.gather(-1, response.unsqueeze(-1)).squeeze(-1)
    full = out.sequences
    pixels = vision_inputs(full, enc["pixel_values"], enc["image_grid_thw"], image_id)
    head = model.get_output_embeddings()
    for chunk in (None, 4):
        logp, _ = response_logprobs(model, head, full, torch.ones_like(full), None, response, temperature=1.0,
                                    chunk_size=chunk, model_kwargs=pixels)
        torch.testing.assert_close(logp, sampler, atol=1e-4, rtol=0)
    other = processor.encode(text, [_picture("blue")])
    logp_blue, _ = response_logprobs(model, head, full, torch.ones_like(full), None, response, temperature=1.0,
                                     chunk_size=None, model_kwargs=vision_inputs(
                                         full, other["pixel_values"], other["image_grid_thw"], image_id))
    assert (logp_blue - sampler).abs().max() > 1e-3


def test_text_trainer_refuses_rows_with_images_instead_of_dropping_them(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("\n".join(json.dumps({"question": "1+1=?", "answer": "#### 2", **extra})
                              for extra in ({}, {"images": ["a.png"]})) + "\n")
    with pytest.raises(ValueError, match=r"rows.jsonl: row 1 carries 'images'.*reads text only"):
        text_env(tmp_path, f"data.train={rows}", f"data.test={rows}")


def _image_rows(tmp_path, n=4):
    colours = ["red", "green", "blue", "yellow"]
    lines = []
    for i in range(n):
        _picture(colours[i % 4]).save(tmp_path / f"p{i}.png")
        lines.append(json.dumps({"question": "count?", "answer": f"#### {i % 3}", "images": [f"p{i}.png"]}))
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("override,message", [
    ("distill.teacher=tiny_teacher", r"distill.teacher=tiny_teacher: on-policy distillation of a vision-language policy"),
    ("algo.adv_estimator=gae", r"algo.adv_estimator=gae trains a critic, which a vision-language policy does not have")])
def test_a_teacher_or_a_critic_beside_a_vlm_is_refused_before_anything_loads(tmp_path, override, message):
    with pytest.raises(ValueError, match=message):
        text_env(tmp_path, "model.name_or_path=tiny_vlm", override)


def test_build_environment_picks_the_vlm_environment_and_the_text_one_refuses_a_vlm(tmp_path):
    """``unirl.text.build_environment`` (what ``unirl train text`` and ``unirl eval`` construct) gives a
    ``VLMEnvironment`` for a vision-language model and a ``TextEnvironment`` otherwise; a
    ``TextEnvironment`` built directly for a VLM is refused, naming the field, rather than loading the
    VLM as a causal LM."""
    from unirl.cli import load_run_config
    from unirl.config.environments import ENVIRONMENTS, import_object
    from unirl.text import build_environment
    from unirl.text.env import TextEnvironment
    from unirl.text.vlm_env import VLMEnvironment

    def cfg(model):
        return load_run_config("text", "tiny", ["rollout.engine=hf", f"model.name_or_path={model}"],
                               output_dir=str(tmp_path / "run"))

    assert import_object(ENVIRONMENTS["text"][1]) is build_environment
    assert type(build_environment(cfg("tiny"))) is TextEnvironment
    assert type(build_environment(cfg("tiny_vlm"))) is VLMEnvironment
    directory = tmp_path / "a-vlm"  # a local directory whose config has a vision_config
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"model_type": "qwen2_vl", "vision_config": {}}))
    assert type(build_environment(cfg(str(directory)))) is VLMEnvironment
    with pytest.raises(ValueError, match=r"model.name_or_path='tiny_vlm' is a vision-language model.*build_environment"):
        TextEnvironment(cfg("tiny_vlm"))


def test_vlm_environment_rollout_logprobs_equal_the_trainers_and_image_tokens_are_not_trained(tmp_path):
    """Through the text environment: the HF engine samples with the rows' images, the trainer's
    recompute (score_actions) gives the engine's log-probs, no trained token is an image token, the
    vision tower is frozen, and rewards receive the opened images."""
    from unirl.text.vlm_env import VLMEnvironment

    rows = _image_rows(tmp_path)
    env = text_env(tmp_path, "model.name_or_path=tiny_vlm", "model.share_prompt=false", f"data.train={rows}",
                   f"data.test={rows}", "rollout.max_new_tokens=5", "data.max_prompt_length=64")
    assert isinstance(env, VLMEnvironment)
    assert not any(p.requires_grad for p in env.model.model.visual.parameters())
    assert any(p.requires_grad for p in env.model.model.language_model.parameters())
    torch.manual_seed(0)
    batch = env.sampler.rollout(env.train_rows[:2], group_size=2)
    assert [len(v) for v in batch.columns["images"]] == [1, 1, 1, 1]
    assert isinstance(batch.columns["images"][0][0], Image.Image)
    with torch.no_grad():
        scored = env.actions.score_actions(env.model, batch)
        t = batch.tensors  # the model's own full distribution, to check the engine's renormalisation
        ids = torch.cat([t["prompt_ids"], t["response_ids"]], 1)
        _, vision = env.actions._model_inputs(batch, ids, None, None)
        attn = torch.cat([t["prompt_mask"], t["response_mask"].long()], 1)
        logits = env.model(input_ids=ids, attention_mask=attn, **vision).logits[:, -t["response_ids"].shape[1] - 1:-1]
    p_vision = torch.softmax(logits.float(), -1)[..., env.processor.vision_token_ids].sum(-1)  # [n, R]
    mask = scored["mask"].bool()
    # The engine never samples a vision token: its log-probs are the policy's renormalised without them.
    correction = -torch.log1p(-p_vision)
    assert mask.any() and (correction[mask] > 2e-4).float().mean() > 0.5, correction[mask]  # larger than atol
    torch.testing.assert_close(batch.engine_logp[mask], (scored["logp"] + correction)[mask], atol=1e-4, rtol=0)
    image_id = env.processor.image_token_id
    assert image_token_mask(batch.tensors["prompt_ids"], image_id).sum() == 4 * 4  # 4 samples x 4 tokens
    assert not image_token_mask(batch.tensors["response_ids"], image_id)[mask].any()


@pytest.mark.slow
def test_tiny_vlm_demo_learns_to_count(tmp_path):
    """``unirl train text --config tiny_vlm`` for 80 steps: the sampled reward and the held-out greedy
    accuracy (100 pictures the policy never trained on) both rise by at least 0.2 (measured: reward
    0.28 -> 0.80 first vs last 10 steps, held-out 0.60 -> 0.92 at step 75; benchmarks/README.md)."""
    import subprocess
    import sys

    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "unirl.cli", "train", "text", "--config", "tiny_vlm", "--output-dir",
                           str(run), "trainer.total_steps=80", "trainer.eval_every=80", "trainer.save_every=0",
                           "trainer.progress=false"], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rewards = [m["reward/mean"] for m in metrics if "reward/mean" in m]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last >= first + 0.2, f"reward did not rise enough: first-10 {first:.3f}, last-10 {last:.3f}"
    held_out = [m["eval/accuracy"] for m in metrics if "eval/accuracy" in m]  # steps 0 and 80
    assert len(held_out) == 2 and held_out[1] >= held_out[0] + 0.2, f"held-out accuracy {held_out}"


def test_a_vlm_lora_adapter_alone_is_merged_into_the_image_text_model_for_eval(vlm, tmp_path):
    """``unirl eval --checkpoint step_N/adapter`` of a VLM run: the adapter merges into its base loaded with
    the image-text class (the causal-LM class cannot load Qwen2-VL), and the processor's files come along."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText

    from unirl.evaluation import resolve_text_checkpoint

    path = vlm[0]
    torch.manual_seed(0)  # B initialised at random (not peft's zeros): the merge changes the weights
    peft = get_peft_model(AutoModelForImageTextToText.from_pretrained(path),
                          LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    peft.save_pretrained(tmp_path / "adapter")
    expected = {name: t.clone() for name, t in peft.merge_and_unload().state_dict().items()}
    (tmp_path / "work").mkdir()
    merged = resolve_text_checkpoint(str(tmp_path / "adapter"), str(path), tmp_path / "work")
    loaded = AutoModelForImageTextToText.from_pretrained(merged).state_dict()
    assert set(loaded) == set(expected)
    changed = [name for name in expected if not torch.equal(expected[name], vlm[1].state_dict()[name])]
    assert changed and all("q_proj" in n or "v_proj" in n for n in changed)  # the adapted layers moved
    for name, tensor in expected.items():
        torch.testing.assert_close(loaded[name], tensor, rtol=0, atol=0)
    processor = VLMProcessor.from_pretrained(merged)  # the processor loads from the merged directory
    assert processor.prompt_text("How many?", 1) == vlm[2].prompt_text("How many?", 1)


def test_lora_on_the_language_model_of_a_vlm_trains_only_the_adapters(tmp_path):
    rows = _image_rows(tmp_path)
    env = text_env(tmp_path, "model.name_or_path=tiny_vlm", "model.share_prompt=false", f"data.train={rows}",
                   f"data.test={rows}", "rollout.max_new_tokens=4", "data.max_prompt_length=64",
                   "model.lora.enabled=true", "model.lora.target_modules=[q_proj,v_proj]")
    batch = env.sampler.rollout(env.train_rows[:2], group_size=2)
    scored = env.actions.score_actions(env.model, batch)
    (scored["logp"] * scored["mask"]).sum().backward()
    trained = {name for name, p in env.model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert trained and all("lora_" in name and "language_model" in name for name in trained), sorted(trained)[:4]


def test_python_api_trains_on_image_rows_rewards_get_the_pictures_and_eval_writes_them(tmp_path):
    """``unirl.train`` takes rows whose ``images`` are PIL pictures, bytes or paths (written as files beside
    the run's data); each reward call gets every sample's own pictures as ``images``; ``unirl.evaluate``
    writes the held-out pictures beside the answers (``images/``, ``samples.jsonl``, ``samples.md``)."""
    import unirl

    colours = {"red": (255, 0, 0), "green": (0, 128, 0), "blue": (0, 0, 255)}
    _picture("blue").save(tmp_path / "blue.png")
    buffer = io.BytesIO()
    _picture("green").save(buffer, format="PNG")
    sources = {"red": _picture("red"), "green": buffer.getvalue(), "blue": str(tmp_path / "blue.png")}
    rows = [{"prompt": f"colour {name}?", "colour": name, "images": [sources[name]]} for name in colours]
    seen = []

    def colour_seen(samples, *, images, colour, **kwargs):
        # The picture each sample was answered from is its own row's, as an opened PIL image.
        seen.extend((imgs[0].getpixel((5, 5)), c) for imgs, c in zip(images, colour))
        return [float(imgs[0].getpixel((5, 5)) == colours[c]) for imgs, c in zip(images, colour)]

    overrides = {"model.share_prompt": False, "trainer.total_steps": 1, "trainer.prompts_per_step": 3,
                 "trainer.group_size": 2, "trainer.mini_batch_size": 6, "trainer.micro_batch_size": 6,
                 "trainer.eval_every": 0, "trainer.save_every": 1, "rollout.max_new_tokens": 3, "overlong.buffer": None}
    result = unirl.train("text", "tiny_vlm", overrides, rewards=[colour_seen], train_data=rows, test_data=rows,
                         output_dir=tmp_path / "run", progress=False)
    assert result.rewards == [1.0] and len(seen) == 6 and {c for _, c in seen} == set(colours)
    written = [json.loads(line) for line in (result.run_dir / "data" / "train.jsonl").read_text().splitlines()]
    assert written[0]["images"] == ["train_images/row00000_0.png"] and written[2]["images"] == [str(tmp_path / "blue.png")]

    summary = unirl.evaluate("text", checkpoint=result.checkpoint, rewards=[colour_seen], output_dir=tmp_path / "eval")
    assert summary["reward"] == 1.0
    out = tmp_path / "eval"
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [s["images"] for s in samples] == [["images/0000_0.png"], ["images/0001_0.png"], ["images/0002_0.png"]]
    assert [Image.open(out / s["images"][0]).getpixel((5, 5)) for s in samples] == list(colours.values())
    table = (out / "samples.md").read_text()
    assert table.count("![") == 3 and "(images/0001_0.png)" in table and "| colour green? |" in table
