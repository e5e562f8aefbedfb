"""Packed rows (``model.share_prompt``) for a vision-language policy: each token keeps the 3-D rotary
position, the picture features and the attention it has in its own unpacked row (issue 35)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import text_env
from PIL import Image

from unirl.text.packing import check_packable, pack_shared_prompts
from unirl.text.vlm import vision_inputs

#: (text, pictures as (colour, size)) per row. Rows 0 and 1 have the same text and one picture of the
#: same size, so the same token ids: only their pictures tell them apart. Row 2 has two pictures of
#: different shapes (4 and 8 image tokens), row 3 none.
ROWS = [("count?", [("red", (64, 48))]),
        ("count?", [("blue", (64, 48))]),
        ("how many?", [("green", (64, 48)), ("yellow", (30, 90))]),
        ("no picture, count?", [])]


def _rows_file(tmp_path):
    lines = []
    for i, (text, pictures) in enumerate(ROWS):
        names = []
        for k, (colour, size) in enumerate(pictures):
            Image.new("RGB", size, colour).save(tmp_path / f"r{i}_{k}.png")
            names.append(f"r{i}_{k}.png")
        lines.append(json.dumps({"question": text, "answer": "#### 1", "images": names}))
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def packed_env(tmp_path_factory):
    """The tiny VLM's environment with share_prompt on, and a rollout of the four rows, two samples each,
    whose responses are cut to different lengths (1 to 6 tokens, one sample's to none); the vision tower
    trains (tiny_vlm.yaml's setting), so that its gradients are compared too."""
    tmp_path = tmp_path_factory.mktemp("vlmpack")
    rows = _rows_file(tmp_path)
    env = text_env(tmp_path, "model.name_or_path=tiny_vlm", "model.share_prompt=true", f"data.train={rows}",
                   f"data.test={rows}", "rollout.max_new_tokens=6", "data.max_prompt_length=64",
                   "model.logprob_chunk_size=null", "model.freeze_vision_tower=false")
    torch.manual_seed(0)
    batch = env.sampler.rollout(env.train_rows, group_size=2)
    t = batch.tensors
    lengths = torch.tensor([6, 3, 1, 5, 4, 2, 0, 6])  # [n]
    keep = torch.arange(t["response_ids"].shape[1])[None] < lengths[:, None]
    t["response_mask"] = t["response_mask"] * keep
    t["response_ids"] = t["response_ids"].masked_fill(~keep, env.tokenizer.pad_token_id)
    return env, batch


def _alone(env, batch, i):
    """Sample i's response log-probs from a forward over its own real tokens, with its own pictures and
    the positions the model derives itself (transformers' get_rope_index), no unirl code in between."""
    t = batch.tensors
    prompt = t["prompt_ids"][i][t["prompt_mask"][i].bool()]
    length = int(t["response_mask"][i].sum())
    ids = torch.cat([prompt, t["response_ids"][i, :length]])[None]  # [1, p + length]
    pictures = batch.columns["images"][i]
    extra = {}
    if pictures:
        pixels = env.processor.image_processor(images=pictures, return_tensors="pt")
        extra = vision_inputs(ids, pixels["pixel_values"], pixels["image_grid_thw"], env.processor.image_token_id)
    logits = env.model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False, **extra).logits[0].float()
    logp = torch.log_softmax(logits[len(prompt) - 1:-1], -1)  # [length, V]
    return logp.gather(-1, ids[0, len(prompt):, None])[:, 0]


def test_packed_vlm_logprobs_equal_each_sample_alone_and_the_unpacked_rows(packed_env):
    """Eight samples of four prompts (two with the same tokens and different pictures, one with two
    pictures of different shapes, one without) in one packed row: every response token's log-prob is
    what the sample alone gives (its own forward, positions from the model itself) and what the padded
    unpacked batch gives; the row holds each prompt once, and the pictures enter the tower once each."""
    env, batch = packed_env
    t = batch.tensors
    mask = t["response_mask"].bool()
    seen = []
    hook = env.model.model.visual.register_forward_hook(lambda m, args, kwargs, out: seen.append(
        kwargs["grid_thw"].tolist()), with_kwargs=True)
    try:
        with torch.no_grad():
            packed = env.actions.score_actions(env.model, batch)["logp"]
            env.cfg.model.share_prompt = False
            try:
                unpacked = env.actions.score_actions(env.model, batch)["logp"]
            finally:
                env.cfg.model.share_prompt = True
            alone = [_alone(env, batch, i) for i in range(len(ROWS) * 2)]
    finally:
        hook.remove()
    # The packed forward's tower saw each row's pictures once, in the row's order: grids (t, h, w) in patches.
    assert seen[0] == [[1, 4, 4], [1, 4, 4], [1, 4, 4], [1, 8, 4]]
    for i, reference in enumerate(alone):
        torch.testing.assert_close(packed[i, :len(reference)], reference, atol=1e-5, rtol=0)
    torch.testing.assert_close(packed[mask], unpacked[mask], atol=1e-5, rtol=0)


def test_packed_vlm_rows_place_prompts_by_the_models_own_rope_index(packed_env):
    """The packed row's 3-D positions: a prompt's are get_rope_index's on it alone (image tokens on a
    height x width grid), its responses continue at the prompt's largest position + 1 on all three axes."""
    env, batch = packed_env
    t = batch.tensors
    captured = {}
    original = env.actions._packed_row

    def spy(*args):
        captured["packed"], captured["extra"] = out = original(*args)
        return out

    env.actions._packed_row = spy
    try:
        with torch.no_grad():
            env.actions.score_actions(env.model, batch)
    finally:
        del env.actions._packed_row
    packed = captured["packed"]
    assert packed.position_ids.shape == (3, 1, packed.input_ids.shape[1])
    assert packed.prompt_samples == [0, 2, 4, 6]  # four distinct prompts (rows 0 and 1 kept apart)
    pos = packed.position_ids[:, 0]  # [3, T]
    prompt = t["prompt_ids"][4][t["prompt_mask"][4].bool()].tolist()  # row 2: two pictures
    prompt_len, resp_len = t["prompt_mask"].sum(-1).long().tolist(), t["response_mask"].sum(-1).long().tolist()
    start = prompt_len[0] + resp_len[0] + resp_len[1] + prompt_len[2] + resp_len[2] + resp_len[3]  # row 2's prompt
    assert packed.input_ids[0, start:start + len(prompt)].tolist() == prompt
    image = env.processor.image_token_id
    first = prompt.index(image)
    # First picture: 4 tokens on a 2x2 grid at (first, first + h, first + w); text after it resumes at first + 2.
    grid = pos[:, start + first:start + first + 4] - first
    assert grid.tolist() == [[0, 0, 0, 0], [0, 0, 1, 1], [0, 1, 0, 1]]
    second = first + 4 + 2  # <|vision_end|><|vision_start|> between the pictures, at first + 2 and first + 3
    assert pos[:, start + first + 4].tolist() == [first + 2] * 3
    # Second picture: 8 tokens on a 4 (high) x 2 (wide) grid, from first + 4.
    grid = pos[:, start + second:start + second + 8] - (first + 4)
    assert grid.tolist() == [[0] * 8, [0, 0, 1, 1, 2, 2, 3, 3], [0, 1] * 4]
    last = int(pos[0, start + len(prompt) - 1])
    assert last == len(prompt) - 1 - (4 - 2) - (8 - 4)  # each picture takes max(h, w) positions for its tokens
    responses = pos[:, start + len(prompt):start + len(prompt) + resp_len[4]]  # sample 4's tokens
    assert resp_len[4] > 1 and responses.tolist() == [list(range(last + 1, last + 1 + resp_len[4]))] * 3
    assert captured["extra"]["image_grid_thw"].tolist() == [[1, 4, 4], [1, 4, 4], [1, 4, 4], [1, 8, 4]]


def test_packed_vlm_gradients_equal_the_unpacked_rows(packed_env):
    """The backward through a packed row gives the unpacked batch's gradients, vision tower included."""
    env, batch = packed_env
    params = [p for p in env.model.parameters() if p.requires_grad]
    grads = []
    for share in (True, False):
        env.cfg.model.share_prompt = share
        try:
            env.model.zero_grad()
            scored = env.actions.score_actions(env.model, batch)
            (scored["logp"] * scored["mask"]).sum().backward()
            grads.append([p.grad.clone() for p in params])
        finally:
            env.cfg.model.share_prompt = True
    env.model.zero_grad()
    visual = set(env.model.model.visual.parameters())
    assert any(g.abs().sum() > 0 for g, p in zip(grads[0], params) if p in visual)
    for packed, unpacked in zip(*grads):
        torch.testing.assert_close(packed, unpacked, atol=1e-5, rtol=1e-4)


def test_packing_refuses_other_multimodal_models_and_keys_must_match_the_samples(packed_env):
    env, _ = packed_env
    config = type(env.model.config).from_dict(env.model.config.to_dict())
    config._attn_implementation = "sdpa"
    check_packable(config)  # Qwen2-VL: packed
    config.model_type = "llava"
    with pytest.raises(ValueError, match="qwen2_vl, qwen2_5_vl only; llava.*share_prompt=false"):
        check_packable(config)
    ids = torch.ones((2, 3), dtype=torch.long)
    with pytest.raises(ValueError, match="1 keys for 2 samples"):
        pack_shared_prompts(ids, ids, ids, ids, keys=["a"])
    with pytest.raises(ValueError, match=r"prompt_positions for sample 0: expected integer positions \[axes, 3\]"):
        pack_shared_prompts(ids, ids, ids, ids, prompt_positions=lambda i, p: torch.zeros(3, 2, dtype=torch.long))


def test_the_load_time_prompt_length_counts_each_rows_picture_tokens(packed_env):
    """``data.max_prompt_length`` is checked at load with the pictures' tokens (from their sizes): the
    count is what encoding the row gives, and a row over the limit only with its pictures stops the run
    there, named."""
    env, _ = packed_env
    rows = env.train_rows
    lengths = [env._prompt_length(row) for row in rows]
    assert lengths == [len(env.encode_prompt(row)) for row in rows]
    text_alone = len(env.processor.tokenizer(env.processor.prompt_text(rows[2]["prompt"], 2)).input_ids)
    assert lengths[2] == text_alone - 2 + 4 + 8  # two placeholders become 4 + 8 picture tokens
    limit = env.cfg.data.max_prompt_length
    env.cfg.data.max_prompt_length = lengths[2] - 1  # the text alone fits, not with its pictures
    try:
        with pytest.raises(ValueError, match=rf"1 prompt\(s\) longer than data.max_prompt_length={lengths[2] - 1} "
                                             rf"tokens, first rows\.jsonl \(row 2, {lengths[2]} tokens\)"):
            env._within_prompt_length(rows, "rows.jsonl", "train")
    finally:
        env.cfg.data.max_prompt_length = limit


def test_a_qwen2_5_vl_packs_as_each_sample_alone(packed_env):
    """Qwen2.5-VL (its own rope index and windowed vision tower), randomly initialised at toy size over
    the tiny VLM's tokenizer: a packed row's log-probs equal each sample's own forward."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from unirl.text.packing import use_packed_attention
    from unirl.text.vlm_env import pack_with_pictures

    env, _ = packed_env
    processor, base = env.processor, env.model.config
    text = {k: v for k, v in base.text_config.to_dict().items() if k not in ("model_type", "architectures")}
    vision = dict(depth=2, hidden_size=128, out_hidden_size=base.text_config.hidden_size, intermediate_size=256,
                  num_heads=2, window_size=56, fullatt_block_indexes=[1])
    ids = {k: getattr(base, k) for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                                         "vision_end_token_id")}
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(text_config=text, vision_config=vision, **ids)).eval()
    check_packable(model.config)
    use_packed_attention(model)
    assert model.model.visual.config._attn_implementation == "sdpa"  # the tower keeps its own
    pictures = [[Image.new("RGB", (64, 48), "red")]] * 2 + [[Image.new("RGB", (90, 30), "blue"),
                                                            Image.new("RGB", (64, 64), "green")], []]
    prompts = [processor.encode(processor.prompt_text(q, len(p)), p)["input_ids"]
               for q, p in zip(["count?", "count?", "which?", "none?"], pictures)]
    responses = [processor.tokenizer(r, add_special_tokens=False).input_ids for r in ("two", "on", "#### 3", "0")]
    P, R = max(map(len, prompts)), max(map(len, responses))
    prompt_ids = torch.tensor([[0] * (P - len(p)) + p for p in prompts])  # left-padded
    prompt_mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts])
    response_ids = torch.tensor([r + [0] * (R - len(r)) for r in responses])
    response_mask = torch.tensor([[1] * len(r) + [0] * (R - len(r)) for r in responses])
    packed, extra = pack_with_pictures(model, processor, prompt_ids, prompt_mask, response_ids, response_mask, pictures)
    assert packed.prompt_samples == [0, 2, 3]
    with torch.no_grad():
        logits = model(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False,
                       attention_mask=torch.ones((1, 1, 1, 1), dtype=torch.bool), **extra).logits[0]
        logp = torch.log_softmax(logits.float(), -1)[packed.source]  # [n, R, V]
        for i, (prompt, response) in enumerate(zip(prompts, responses)):
            row = torch.tensor([prompt + response])
            inputs = {}
            if pictures[i]:
                pixels = processor.image_processor(images=pictures[i], return_tensors="pt")
                inputs = vision_inputs(row, pixels["pixel_values"], pixels["image_grid_thw"], processor.image_token_id)
            alone = torch.log_softmax(model(input_ids=row, use_cache=False, **inputs).logits[0].float(), -1)
            alone = alone[len(prompt) - 1:-1].gather(-1, torch.tensor(response)[:, None])[:, 0]
            packed_i = logp[i, :len(response)].gather(-1, torch.tensor(response)[:, None])[:, 0]
            torch.testing.assert_close(packed_i, alone, atol=1e-5, rtol=0)


def test_a_batch_without_pictures_scores_as_each_sample_alone_unpacked_too(packed_env):
    """No picture in the whole batch (no pixel inputs at all) and left-padded prompts of different
    lengths: packed and unpacked rows give each sample's own log-probs."""
    env, batch = packed_env
    pair = batch.select([6, 7])  # row 3, no picture
    t = pair.tensors
    t["prompt_ids"], t["prompt_mask"] = t["prompt_ids"].clone(), t["prompt_mask"].clone()
    first = int(t["prompt_mask"][1].argmax())
    t["prompt_ids"][1, first:first + 3], t["prompt_mask"][1, first:first + 3] = env.tokenizer.pad_token_id, 0
    with torch.no_grad():
        alone = _alone(env, pair, 1)
        for share in (True, False):
            env.cfg.model.share_prompt = share
            try:
                logp = env.actions.score_actions(env.model, pair)["logp"]
            finally:
                env.cfg.model.share_prompt = True
            torch.testing.assert_close(logp[1, :len(alone)], alone, atol=1e-5, rtol=0)


def test_a_tiny_vlm_training_step_is_the_same_packed_and_unpacked(tmp_path):
    """``unirl train text --config tiny_vlm`` (one step, 3 prompts x 4, two micro-batches) with ``model.share_prompt`` on and
    off: the same samples and rewards, and the same loss, ratio, entropy, gradient norm and
    sampler-vs-trainer log-prob figures to float rounding."""
    import unirl

    metrics = {}
    for share in (True, False):
        overrides = {"model.share_prompt": share, "trainer.total_steps": 1, "trainer.prompts_per_step": 3,
                     "trainer.group_size": 4, "trainer.mini_batch_size": 12, "trainer.micro_batch_size": 6,
                     "trainer.eval_every": 0, "trainer.save_every": 0}
        run = tmp_path / f"share_{share}"
        unirl.train("text", "tiny_vlm", overrides, output_dir=run, progress=False)
        metrics[share] = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    figures = [k for k in metrics[False] if not k.startswith(("time/", "perf/"))]
    for key in ("loss/policy", "actor/entropy", "actor/grad_norm", "actor/ratio_max", "rollout/logprob_diff_max",
                "rollout/training_ppl", "reward/mean"):
        assert key in figures
    for key in figures:
        assert metrics[True][key] == pytest.approx(metrics[False][key], rel=1e-5, abs=1e-6), key
