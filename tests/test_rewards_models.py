"""Model-based rewards end to end on CPU with a toy CLIP built locally (no downloads): PickScore and
clip_score against CLIPModel's own forward, the aesthetic head against its collapsed affine map,
lazy loading, batching, config kwargs, and serving a model reward over HTTP. Also math_verify."""

from __future__ import annotations

import importlib.util
import json
import threading

import pytest
import torch

from unirl.rewards.registry import RewardError, load_reward, score_batch
from unirl.config.schema import RewardConfig
from unirl.reward_set import RewardSet

PROMPTS = ["a red square", "a blue square", "green", "a cat 12"]


@pytest.fixture(scope="module")
def toy_clip(tmp_path_factory):
    """A CLIPModel with 32-wide layers on 32x32 images, 16-d embeddings, and a character-level
    CLIP tokenizer (vocab.json + an empty merges.txt) with its image processor: what
    ``CLIPModel.from_pretrained`` / ``CLIPProcessor.from_pretrained`` read from a hub id."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor, CLIPTokenizer

    root = tmp_path_factory.mktemp("toy_clip")
    chars = "abcdefghijklmnopqrstuvwxyz0123456789"
    vocab = {c: i for i, c in enumerate(chars)}
    vocab.update({c + "</w>": len(chars) + i for i, c in enumerate(chars)})
    vocab.update({"<|startoftext|>": len(vocab), "<|endoftext|>": len(vocab) + 1})
    (root / "vocab.json").write_text(json.dumps(vocab))
    (root / "merges.txt").write_text("#version: 0.2\n")
    tokenizer = CLIPTokenizer(str(root / "vocab.json"), str(root / "merges.txt"))
    images = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    eos = vocab["<|endoftext|>"]
    config = CLIPConfig(
        text_config=dict(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, max_position_embeddings=77, bos_token_id=vocab["<|startoftext|>"],
                         eos_token_id=eos, pad_token_id=eos),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=32, patch_size=8),
        projection_dim=16,
    )
    torch.manual_seed(0)
    model = CLIPModel(config)
    with torch.no_grad():
        model.logit_scale.fill_(3.0)  # exp(3) ~ 20.1, a PickScore-like scale
    path = root / "model"
    model.save_pretrained(path)
    CLIPProcessor(image_processor=images, tokenizer=tokenizer).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def images():
    from PIL import Image

    return [Image.new("RGB", (40, 30), (255, 0, 0)), Image.new("RGB", (32, 48), (0, 0, 255)),
            Image.effect_noise((36, 36), 60).convert("RGB"), Image.linear_gradient("L").convert("RGB")]


def reference_logits(path, images, prompts):
    """CLIPModel's own forward: logits_per_image = exp(logit_scale) * cos(image_i, text_j)."""
    from transformers import CLIPModel, CLIPProcessor

    model, processor = CLIPModel.from_pretrained(path).eval(), CLIPProcessor.from_pretrained(path)
    inputs = processor(text=prompts, images=images, padding=True, return_tensors="pt")
    with torch.no_grad():
        out = model(**inputs)
    return out, model


def test_pickscore_matches_the_formula(toy_clip, images):
    fn = load_reward("pickscore", model=str(toy_clip), processor=str(toy_clip), batch_size=3, device="cpu")
    assert not fn._loaded  # lazily: nothing loaded before the first batch
    scores = score_batch(fn, images, name="pickscore", prompts=PROMPTS)
    out, model = reference_logits(toy_clip, images, PROMPTS)
    # FlowGRPO: logit_scale.exp() * (text_embs @ image_embs.T).diag() / 26
    expected = out.logits_per_image.diagonal() / 26
    assert torch.allclose(torch.tensor(scores), expected, rtol=1e-5, atol=1e-6)
    # By hand for sample 0: exp(3) * <img_0, txt_0> / 26 with the normalised embeddings.
    cos0 = (out.image_embeds[0] * out.text_embeds[0]).sum().item()
    assert scores[0] == pytest.approx(torch.tensor(3.0).exp().item() * cos0 / 26, rel=1e-5)
    assert len(set(scores)) == 4  # the toy model tells the pairs apart
    raw = score_batch(load_reward("pickscore", model=str(toy_clip), processor=str(toy_clip), divisor=1.0),
                      images, name="pickscore", prompts=PROMPTS)
    assert raw == pytest.approx([26 * s for s in scores], rel=1e-5)


def test_clip_score_is_the_cosine(toy_clip, images):
    fn = load_reward("clip_score", model=str(toy_clip), batch_size=4)
    scores = score_batch(fn, images, name="clip_score", prompts=PROMPTS)
    out, _ = reference_logits(toy_clip, images, PROMPTS)
    cos = out.logits_per_image.diagonal() / torch.tensor(3.0).exp()  # logits / exp(logit_scale)
    assert torch.allclose(torch.tensor(scores), cos, rtol=1e-5, atol=1e-6)
    assert all(-1 <= s <= 1 for s in scores)
    # Batch size does not change the scores: 1 x 4 == 4 x 1.
    one_by_one = score_batch(load_reward("clip_score", model=str(toy_clip), batch_size=1), images,
                             name="clip_score", prompts=PROMPTS)
    assert one_by_one == pytest.approx(scores, abs=1e-6)
    # No device given: this process's CUDA device, else the CPU.
    assert fn.device == (f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu")
    half = score_batch(load_reward("clip_score", model=str(toy_clip), dtype="bfloat16"), images,
                       name="clip_score", prompts=PROMPTS)
    assert half == pytest.approx(scores, abs=3e-2)  # bfloat16 keeps ~3 significant digits


def test_aesthetic_head_shape_and_collapsed_affine_map(toy_clip, images, tmp_path):
    from unirl.rewards.aesthetic_head import AestheticHead

    torch.manual_seed(1)
    head = AestheticHead(16)
    assert head(torch.randn(5, 16)).shape == (5, 1)
    assert [k for k in head.state_dict()][::2] == [f"layers.{i}.weight" for i in (0, 2, 4, 6, 7)]
    torch.save(head.state_dict(), tmp_path / "head.pth")

    fn = load_reward("aesthetic", model=str(toy_clip), head=str(tmp_path / "head.pth"), batch_size=3)
    scores = score_batch(fn, images, name="aesthetic", prompts=PROMPTS)
    assert len(scores) == 4

    # The head has no nonlinearity (and dropout is off in eval): it is one affine map e -> e . w + b,
    # w = W1^T W2^T W3^T W4^T W5^T, b = (((b1 W2^T + b2) W3^T + b3) W4^T + b4) W5^T + b5.
    layers = [head.layers[i] for i in (0, 2, 4, 6, 7)]
    w = torch.eye(16)
    b = torch.zeros(16)
    for layer in layers:
        w, b = w @ layer.weight.T, b @ layer.weight.T + layer.bias
    out, _ = reference_logits(toy_clip, images, PROMPTS)  # image_embeds are L2-normalised
    expected = (out.image_embeds @ w + b).squeeze(-1)
    assert torch.allclose(torch.tensor(scores), expected, rtol=1e-4, atol=1e-5)

    # The published file's keys may lack the "layers." prefix (nn.Sequential saved directly).
    torch.save(head.layers.state_dict(), tmp_path / "bare.pth")
    bare = score_batch(load_reward("aesthetic", model=str(toy_clip), head=str(tmp_path / "bare.pth")), images,
                       name="aesthetic", prompts=PROMPTS)
    assert bare == pytest.approx(scores, abs=1e-6)


def test_model_load_failures_are_named(toy_clip, tmp_path):
    from unirl.rewards.aesthetic_head import AestheticHead

    torch.save(AestheticHead(768).state_dict(), tmp_path / "l14.pth")
    with pytest.raises(RewardError, match=r"Aesthetic could not load its model: .*takes 768-d embeddings.*makes 16-d"):
        load_reward("aesthetic", model=str(toy_clip), head=str(tmp_path / "l14.pth"))(["x"], prompts=["p"])
    with pytest.raises(RewardError, match="PickScore could not load its model: OSError"):
        load_reward("pickscore", model=str(tmp_path / "no_model"), processor=str(toy_clip))(["x"], prompts=["p"])
    with pytest.raises(RewardError, match=r"pickscore.*has no parameter 'modle'. Did you mean 'model'"):
        load_reward("pickscore", modle="x")
    with pytest.raises(RewardError, match="batch_size must be a positive integer"):
        load_reward("clip_score", batch_size=0)


def test_model_reward_in_a_reward_set_and_over_http(toy_clip, images):
    from unirl.rewards.remote import make_server

    kwargs = {"model": str(toy_clip), "processor": str(toy_clip), "batch_size": 2}
    rs = RewardSet([RewardConfig("pickscore", kwargs=kwargs), RewardConfig("clip_score", weight=2.0, kwargs=kwargs)],
                   workers=2)
    groups = torch.tensor([0, 0, 1, 1])
    comp = rs.submit(images, prompts=PROMPTS, columns={}).result(timeout=60)
    total, metrics = rs.combine(comp, groups)
    assert torch.allclose(total, (comp["pickscore"] + 2 * comp["clip_score"]).float())  # scores float64, total float32
    assert metrics["reward/pickscore"] == pytest.approx(comp["pickscore"].mean().item())
    rs.close()

    server = make_server("pickscore", "127.0.0.1", 0, kwargs)  # loads the model before serving
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        remote = score_batch(load_reward(url, timeout=30), images, name=url, prompts=PROMPTS)
        assert remote == pytest.approx(comp["pickscore"].tolist(), abs=1e-6)
    finally:
        server.shutdown()
        server.server_close()


def test_hpsv2_needs_open_clip():
    pytest.importorskip(
        "open_clip",
        reason="hpsv2 needs open-clip-torch, which imports torchvision; PyPI's torchvision does not import beside "
               "the CPU torch on this machine, so hpsv2 is not installable or testable here",
    )
    from unirl.rewards.registry import reward_info

    assert reward_info("hpsv2").modality == "image"


def test_hpsv2_is_listed_as_unavailable_without_open_clip():
    from unirl.rewards.registry import unavailable_builtins

    if importlib.util.find_spec("open_clip") is not None:
        pytest.skip("open_clip is installed here")
    assert unavailable_builtins()["unirl.rewards.hpsv2"] == "unirl.rewards.hpsv2 needs 'open_clip': pip install open-clip-torch"
    with pytest.raises(RewardError, match="unknown reward 'hpsv2'.*unirl.rewards.hpsv2 needs 'open_clip': pip install open-clip-torch"):
        load_reward("hpsv2")


# ----------------------------------------------------------------------------------------------
# math_verify
# ----------------------------------------------------------------------------------------------


def test_math_verify_reward():
    import doctest

    import unirl.rewards.mathverify

    assert doctest.testmod(unirl.rewards.mathverify).failed == 0
    samples = [r"The answer is $\boxed{\frac{3}{4}}$.", r"$\boxed{0.75}$", r"$\boxed{\{1, 2\}}$", r"The final answer is $3$",
               r"so $3$", r"I get $x = 3$", "#### 3"]
    gold = ["$0.75$", r"$\frac34$", r"$\{2, 1\}$", "$3$", "$3$", "$3$", "$3$"]
    fn = load_reward("math_verify", wrong_score=-1.0)
    # Equivalent forms match; a set matches in any order; without \boxed the LaTeX must follow an
    # anchor ("final answer is"): a bare "so $3$" is not read; "x = 3" is an equation, which strict
    # verification does not equate with 3; "#### 3" has no LaTeX (TRL's choice: no bare-number fallback).
    assert score_batch(fn, samples, name="math_verify", prompts=["q"] * 7, answer=gold) == [
        1.0, 1.0, 1.0, 1.0, -1.0, -1.0, -1.0]


def test_math_verify_in_worker_threads_matches_inline():
    samples = [r"$\boxed{2}$", r"$\boxed{3}$"] * 2
    columns = {"answer": ["$2$"] * 4}
    inline = RewardSet([RewardConfig("math_verify")]).components(samples, prompts=["q"] * 4, columns=columns)
    with RewardSet([RewardConfig("math_verify")], workers=2) as rs:  # signal-based timeouts are off in threads
        pooled = rs.submit(samples, prompts=["q"] * 4, columns=columns).result(timeout=60)
    assert inline["math_verify"].tolist() == pooled["math_verify"].tolist() == [1.0, 0.0, 1.0, 0.0]


@pytest.fixture
def hpsv2_stand_in(monkeypatch):
    """rewards/hpsv2.py imported against tests/fixtures/fake_open_clip (open_clip's API, a toy model);
    yields (open_clip, registry), and the rest of the session never sees the stand-in."""
    import sys
    from pathlib import Path

    from unirl.rewards import registry

    if importlib.util.find_spec("open_clip") is not None:
        pytest.skip("the real open_clip is installed: test_hpsv2_needs_open_clip covers it")
    registry._ensure_builtins()
    monkeypatch.setattr(registry.REWARDS, "_items", dict(registry.REWARDS._items))
    monkeypatch.setattr(registry.REWARDS, "info", dict(registry.REWARDS.info))
    monkeypatch.syspath_prepend(str(Path(__file__).parent / "fixtures" / "fake_open_clip"))
    monkeypatch.delitem(sys.modules, "unirl.rewards.hpsv2", raising=False)
    try:
        open_clip = importlib.import_module("open_clip")
        importlib.import_module("unirl.rewards.hpsv2")
        yield open_clip, registry
    finally:  # the rest of the session must not see the stand-in or the reward it registered
        sys.modules.pop("open_clip", None)
        sys.modules.pop("unirl.rewards.hpsv2", None)
        import unirl.rewards

        unirl.rewards.__dict__.pop("hpsv2", None)


_HPS_PROMPTS = ("red", "blue sky", "a gradient")


def _hps_images():
    from PIL import Image

    return [Image.new("RGB", (16, 16), (255, 0, 0)), Image.new("RGB", (9, 9), (0, 90, 255)),
            Image.linear_gradient("L").convert("RGB")]


def _hps_expected(open_clip, trained, images, prompts):
    import torch.nn.functional as F

    _, preprocess, _ = open_clip.create_model_and_transforms("ViT-H-14")
    with torch.no_grad():
        img = F.normalize(trained.encode_image(torch.stack([preprocess(i) for i in images])), dim=-1)
        txt = F.normalize(trained.encode_text(open_clip.get_tokenizer("ViT-H-14")(prompts)), dim=-1)
    return (img * txt).sum(-1).tolist()


def test_hpsv2_glue_with_a_stand_in_open_clip(hpsv2_stand_in, tmp_path):
    """The checkpoint's ``state_dict`` is loaded, and the score is the cosine of the normalised embeddings."""
    open_clip, registry = hpsv2_stand_in
    torch.manual_seed(3)
    trained, _, _ = open_clip.create_model_and_transforms("ViT-H-14")
    torch.save({"state_dict": trained.state_dict(), "epoch": 1}, tmp_path / "HPS_v2.1_compressed.pt")
    fn = load_reward("hpsv2", checkpoint=str(tmp_path / "HPS_v2.1_compressed.pt"), batch_size=2, device="cpu")
    images, prompts = _hps_images(), list(_HPS_PROMPTS)
    scores = score_batch(fn, images, name="hpsv2", prompts=prompts)
    assert scores == pytest.approx(_hps_expected(open_clip, trained, images, prompts), abs=1e-6)
    assert registry.reward_info("hpsv2").modality == "image"


def test_hpsv2_loads_a_safetensors_checkpoint(hpsv2_stand_in, tmp_path):
    from safetensors.torch import save_file

    open_clip, _ = hpsv2_stand_in
    torch.manual_seed(4)
    trained, _, _ = open_clip.create_model_and_transforms("ViT-H-14")
    save_file(trained.state_dict(), str(tmp_path / "hps.safetensors"))
    fn = load_reward("hpsv2", checkpoint=str(tmp_path / "hps.safetensors"), device="cpu")
    images, prompts = _hps_images(), list(_HPS_PROMPTS)
    scores = score_batch(fn, images, name="hpsv2", prompts=prompts)
    assert scores == pytest.approx(_hps_expected(open_clip, trained, images, prompts), abs=1e-6)


def _leave_a_mark(path: str) -> str:
    """What a malicious checkpoint's pickle runs on load (here: writes a file)."""
    with open(path, "w") as f:
        f.write("code from the checkpoint ran")
    return path


class _RunsCodeOnLoad:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return _leave_a_mark, (self.marker,)


def test_hpsv2_refuses_a_checkpoint_with_pickled_objects(hpsv2_stand_in, tmp_path):
    """A checkpoint whose pickle calls a function on load is refused before the call happens."""
    open_clip, _ = hpsv2_stand_in
    trained, _, _ = open_clip.create_model_and_transforms("ViT-H-14")
    marker = tmp_path / "marker"
    path = tmp_path / "HPS_v2.1_compressed.pt"
    torch.save({"state_dict": trained.state_dict(), "payload": _RunsCodeOnLoad(str(marker))}, path)
    # The file does run code under a full unpickle (what the reward did before), so the test can fail:
    torch.load(path, weights_only=False)
    assert marker.read_text() == "code from the checkpoint ran"
    marker.unlink()

    fn = load_reward("hpsv2", checkpoint=str(path), device="cpu")
    with pytest.raises(RewardError, match="HPSv2 could not load its model: ValueError: hpsv2: .*HPS_v2.1_compressed.pt "
                                          "holds pickled objects besides tensors; refused"):
        fn(_hps_images()[:1], prompts=["red"])
    assert not marker.exists()



def test_image_similarity_is_the_cosine_of_the_two_images_embeddings(toy_clip, images, tmp_path):
    """FlowGRPO's image_similarity (ClipScorer.image_similarity): cos(CLIP image(x), CLIP image(input)),
    the input image read from the ``image`` column's paths."""
    from transformers import CLIPModel, CLIPProcessor

    paths = []
    for i, image in enumerate(reversed(images)):  # each sample's input is another picture
        paths.append(str(tmp_path / f"in{i}.png"))
        image.save(paths[-1])
    fn = load_reward("image_similarity", model=str(toy_clip), batch_size=3)
    scores = score_batch(fn, images, name="image_similarity", prompts=PROMPTS, image=paths)
    model, processor = CLIPModel.from_pretrained(toy_clip).eval(), CLIPProcessor.from_pretrained(toy_clip)
    with torch.no_grad():
        def embed(pictures):
            e = model(**processor(text=["a"] * len(pictures), images=pictures, return_tensors="pt", padding=True)).image_embeds
            return e / e.norm(dim=-1, keepdim=True)
        from PIL import Image
        expected = (embed(images) * embed([Image.open(p).convert("RGB") for p in paths])).sum(-1)
    assert torch.allclose(torch.tensor(scores), expected, rtol=1e-5, atol=1e-6)
    same = score_batch(fn, images[:1], name="image_similarity", prompts=PROMPTS[:1], image=[paths[-1]])
    assert same[0] == pytest.approx(1.0, abs=1e-5)  # an image and itself (saved as PNG, lossless)
    with pytest.raises(Exception, match="needs the 'image' column"):
        score_batch(fn, images, name="image_similarity", prompts=PROMPTS)
