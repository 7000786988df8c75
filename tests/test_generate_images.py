"""Images end to end on each vision-language architecture: processor output -> logits against
transformers, and ``mlxc generate --image PATH`` (streamed text, greedy tokens equal to a manual
greedy loop over the model; gemma3's also to transformers' generate on its processor's prompt)
and its errors.

Tiny re-randomised float32 checkpoints (qwen2_vl, qwen2_5_vl, qwen3_vl, qwen3_vl_moe,
mistral3 with a mistral and with a mistral4 text backbone, and gemma3) with the tokenizers, chat
templates and processor files of test_processor.py (gemma3: google/gemma-3-4b-it's, from
test_gemma3_vision.py); atol 1e-4 as in test_qwen_vl.py / test_mistral3.py / test_gemma3_vlm.py.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import torch
import transformers
from click.testing import CliRunner
from PIL import Image
from test_gemma3_vision import BOI, EOI, GEMMA3_FILES, SOFT, write_gemma_tokenizer
from test_gemma3_vlm import randomise as randomise_gemma3
from test_gemma3_vlm import save_hub
from test_mistral3 import TEXT_CONFIGS as MISTRAL_TEXT
from test_mistral3 import rerandomise
from test_processor import (
    IMG,
    MERGE,
    PATCH,
    QWEN_IDS,
    VOCAB,
    png_header_only,
    qwen_config,
    write_mistral_files,
    write_qwen2_5_vl_3b_files,
    write_qwen_files,
)
from test_qwen_vision import randomise
from test_qwen_vl import MOE_TEXT

sys.path.insert(0, str(Path(__file__).parent))
import checkpoints as ck

import mlxc
from mlxc.cli import main
from mlxc.runtime.checkpoint import processor as proc
from mlxc.runtime.checkpoint.tokenizer import eos_token_ids, load_tokenizer
from mlxc.runtime.serving import generate as generate_mod

ATOL = 1e-4
QWEN_MODEL_CLASS = {
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
    "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration",
}
ARCHS = [*QWEN_MODEL_CLASS, "mistral3:mistral", "mistral3:mistral4", "gemma3"]
IMAGE_SIZES = [(50, 70), (30, 44)]  # (height, width): two images of different sizes

# google/gemma-3-4b-it's config.json key for key, sizes shrunk; text_config adds the sizes the
# hub leaves to Gemma3TextConfig's defaults. The token ids are the tiny tokenizer's (hub 106,
# <end_of_turn>, is 6 there). A 32x32 image is 8x8 patches, pooled to 4x4 = 16 tokens, longer
# than the sliding window (8): prompts run past the window, inside an image too.
GEMMA3_CONFIG = {
    "architectures": ["Gemma3ForConditionalGeneration"],
    "boi_token_index": BOI,
    "eoi_token_index": EOI,
    "eos_token_id": [1, 6],
    "image_token_index": SOFT,
    "initializer_range": 0.02,
    "mm_tokens_per_image": 16,
    "model_type": "gemma3",
    "text_config": {
        "hidden_size": 64,
        "intermediate_size": 96,
        "model_type": "gemma3_text",
        "num_hidden_layers": 3,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 8,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "query_pre_attn_scalar": 24,
        "sliding_window_pattern": 3,  # layers 0, 1 sliding, 2 full
        "vocab_size": 300,  # the tokenizer's 299 tokens
    },
    "torch_dtype": "float32",
    "transformers_version": "4.50.0.dev0",
    "vision_config": {
        "hidden_size": 32,
        "image_size": 32,
        "intermediate_size": 48,
        "model_type": "siglip_vision_model",
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "patch_size": 4,
        "vision_use_head": False,
    },
}


def build_gemma3(path):
    """Hub layout (config.json, tensor names) with the hub's tokenizer_config.json,
    chat_template.json and processor files, their sizes shrunk to the tiny tower's."""
    config = transformers.Gemma3Config(**GEMMA3_CONFIG)
    config._attn_implementation = "eager"
    model = transformers.Gemma3ForConditionalGeneration(config).float().eval()
    randomise_gemma3(model, 7)
    save_hub(model, path)
    (path / "config.json").write_text(json.dumps(GEMMA3_CONFIG, indent=2))
    write_gemma_tokenizer(path)
    size = GEMMA3_CONFIG["vision_config"]["image_size"]
    tokens = GEMMA3_CONFIG["mm_tokens_per_image"]
    for name, shrunk in (
        ("preprocessor_config.json", {"size": {"height": size, "width": size}}),
        ("processor_config.json", {}),
    ):
        files = json.loads((GEMMA3_FILES / name).read_text())
        (path / name).write_text(json.dumps(files | shrunk | {"image_seq_length": tokens}))
    return model


def build(arch, path):
    """A re-randomised transformers model saved to ``path`` with its tokenizer and processor
    files; returns the transformers model (float32, eval)."""
    if arch == "gemma3":
        return build_gemma3(path)
    if arch in QWEN_MODEL_CLASS:
        extra = {"num_hidden_layers": 2, **(MOE_TEXT if arch == "qwen3_vl_moe" else {})}
        config = qwen_config(arch, **extra)
        model = getattr(transformers, QWEN_MODEL_CLASS[arch])(config).float().eval()
        randomise(model, 1)
        model.save_pretrained(path)
        write_qwen_files(path, arch)
        return model
    text = {**MISTRAL_TEXT[arch.split(":")[1]], "vocab_size": VOCAB}
    config = transformers.Mistral3Config(
        vision_config={
            "model_type": "pixtral",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "patch_size": PATCH,
            "image_size": 64,
            "hidden_act": "silu",
            "rope_parameters": {"rope_type": "default", "rope_theta": 100.0},
        },
        text_config=text,
        image_token_index=IMG,
        spatial_merge_size=MERGE,
        projector_hidden_act="gelu",
        tie_word_embeddings=False,
    )
    model = transformers.Mistral3ForConditionalGeneration(config).eval()
    rerandomise(model, 3)
    model.save_pretrained(path)
    write_mistral_files(path)
    return model


@pytest.fixture(scope="module", params=ARCHS)
def checkpoint(request, tmp_path_factory):
    arch = request.param
    path = tmp_path_factory.mktemp(arch.replace(":", "-"))
    hf = build(arch, path)
    rng = np.random.default_rng(11)
    files = []
    for i, (h, w) in enumerate(IMAGE_SIZES):
        f = path.parent / f"{path.name}-{'ab'[i]}.png"
        pixels = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(f)
        files.append(f)
    return arch, path, hf, files


def hf_logits(arch, hf, ids, vision):
    kwargs = {k: torch.from_numpy(v) for k, v in vision.items()}
    if arch in QWEN_MODEL_CLASS:
        # What the processor returns; without it transformers 5 skips MRoPE positions.
        kwargs["mm_token_type_ids"] = torch.from_numpy(
            (ids == QWEN_IDS["image_token_id"]).astype(np.int64)
        )
    if arch == "gemma3":
        # What Gemma3Processor returns: image tokens attend to their whole image.
        kwargs["token_type_ids"] = torch.from_numpy((ids == SOFT).astype(np.int64))
    with torch.no_grad():
        return hf(input_ids=torch.from_numpy(ids), **kwargs).logits.numpy()


def encode(path, files, text="describe both images"):
    model = mlxc.load_model(path)
    processor = proc.load_processor(path, load_tokenizer(path), model)
    prompt = processor.encode_text_and_images(text, [proc.load_image(f) for f in files])
    return model, processor, prompt


def test_processor_output_logits_match_transformers(checkpoint):
    arch, path, hf, files = checkpoint
    model, _, prompt = encode(path, files)
    ids = np.array([prompt.ids])
    vision = {k: np.array(v) for k, v in prompt.vision.items()}
    inputs = generate_mod.as_model_inputs(prompt.vision)
    ours = np.array(model(mx.array(ids), cache=model.make_cache(), **inputs))
    np.testing.assert_allclose(ours, hf_logits(arch, hf, ids, vision), atol=ATOL, rtol=0)


def greedy(model, prompt, n, eos):
    """Greedy tokens: the whole prompt in one forward (images included), then one cached step
    per token. A generated image placeholder is plain text here, as in transformers."""
    cache, out = model.make_cache(), []
    logits = model(
        mx.array([prompt.ids]), cache=cache, **generate_mod.as_model_inputs(prompt.vision)
    )
    for _ in range(n):
        token = int(np.argmax(np.array(logits[0, -1])))
        if token in eos:
            break
        out.append(token)
        logits = model(mx.array([[token]]), cache=cache)
    return out


def test_vision_inputs_go_with_the_first_chunk_only():
    calls = []

    class Recorder:
        def __call__(self, ids, cache=None, last_only=False, **kwargs):
            calls.append((ids.shape[1], sorted(kwargs)))
            return mx.zeros((1, 1 if last_only else ids.shape[1], 8))

        def make_cache(self):
            return []

    vision = {"pixel_values": mx.zeros((4, 3)), "image_grid_thw": mx.array([[1, 2, 2]])}
    tokens = generate_mod.generate_tokens(
        Recorder(), list(range(10)), max_tokens=3, prefill_chunk_size=4, vision_inputs=vision
    )
    assert list(tokens) == [0, 0, 0]
    assert calls[0] == (4, ["image_grid_thw", "pixel_values"])
    chunks = [b - a for a, b in generate_mod.prefill_chunks(10, 4)]
    assert [c[0] for c in calls] == [*chunks, 1, 1] and all(not k for _, k in calls[1:])
    calls.clear()  # a prompt that fits one chunk: the images go with its first forward
    list(generate_mod.generate_tokens(Recorder(), [1, 2], max_tokens=2, vision_inputs=vision))
    chunks = [b - a for a, b in generate_mod.prefill_chunks(2, 2048)]
    assert calls[0] == (chunks[0], ["image_grid_thw", "pixel_values"])
    assert [c[0] for c in calls] == [*chunks, 1] and all(not k for _, k in calls[1:])


def test_numpy_vision_inputs_reach_the_model_as_mlx_arrays():
    # The processor hands numpy (MLX is made on the thread that runs the model): generate_tokens
    # converts it, as the scheduler does.
    seen = {}

    class Recorder:
        def __call__(self, ids, cache=None, last_only=False, **kwargs):
            seen.update(kwargs)
            return mx.zeros((1, 1 if last_only else ids.shape[1], 8))

        def make_cache(self):
            return []

    vision = {"pixel_values": np.ones((4, 3), np.float32), "image_grid_thw": np.array([[1, 2, 2]])}
    list(generate_mod.generate_tokens(Recorder(), [1, 2, 3], max_tokens=1, vision_inputs=vision))
    assert {k: (type(v), v.dtype) for k, v in seen.items()} == {
        "pixel_values": (mx.array, mx.float32),
        "image_grid_thw": (mx.array, mx.int64),
    }
    np.testing.assert_array_equal(np.array(seen["pixel_values"]), vision["pixel_values"])
    # MLX arrays and other values pass through as they are.
    grid = mx.array([[1, 2, 2]])
    assert generate_mod.as_model_inputs({"g": grid, "n": 3}) == {"g": grid, "n": 3}
    assert generate_mod.as_model_inputs(None) == {}


def run_cli(*args):
    return CliRunner().invoke(main, ["generate", *map(str, args)])


def test_cli_generates_with_images(checkpoint, monkeypatch):
    _, path, _, files = checkpoint
    recorded = []
    real = generate_mod.generate_tokens

    def recording(*args, **kwargs):
        for token in real(*args, **kwargs):
            recorded.append(token)
            yield token

    monkeypatch.setattr(generate_mod, "generate_tokens", recording)
    text = "describe both images"
    args = ["--model", path, "--image", files[0], "--image", files[1], "--prompt", text]
    # A small prefill chunk: chunk boundaries fall inside the images' tokens (gemma3's move to
    # the image's end: its prefill_spans).
    result = run_cli(*args, "--max-tokens", 5, "--prefill-chunk-size", 16)
    assert result.exit_code == 0, result.output

    model, _, prompt = encode(path, files, text)
    tokenizer = load_tokenizer(path)
    expected = greedy(model, prompt, 5, eos_token_ids(tokenizer, path))
    assert recorded == expected
    assert result.stdout == tokenizer.decode(expected, skip_special_tokens=True) + "\n"
    stats = result.stderr.strip().splitlines()
    assert len(stats) == 1 and f"prompt: {len(prompt.ids)} tokens" in stats[0]
    assert len(prompt.ids) > 40  # the images' tokens are in the prompt


def hf_generate(hf, path, files, text, n):
    """(prompt ids, greedy tokens, their logits) of transformers' ``generate`` on the prompt its
    own processor builds from the checkpoint's files (chat template, prompt expansion, pixel
    values and ``token_type_ids``), cut at the first end-of-sequence token."""
    processor = transformers.AutoProcessor.from_pretrained(str(path))
    images = [{"type": "image", "image": Image.open(f).convert("RGB")} for f in files]
    messages = [{"role": "user", "content": [*images, {"type": "text", "text": text}]}]
    inputs = processor.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
    )
    eos = sorted(eos_token_ids(load_tokenizer(path), path))
    with torch.no_grad():
        out = hf.generate(
            **inputs,
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=eos,
            output_logits=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, inputs["input_ids"].shape[1] :].tolist()
    cut = next((i for i, t in enumerate(tokens) if t in eos), len(tokens))
    logits = np.concatenate([step.numpy() for step in out.logits[:cut]])
    return inputs["input_ids"][0].tolist(), tokens[:cut], logits


# transformers' Qwen-VL and Pixtral processors need torchvision (not installed): their
# AutoProcessor cannot load, so only gemma3 is checked against transformers' generate here.
@pytest.mark.parametrize("checkpoint", ["gemma3"], indirect=True)
@pytest.mark.parametrize("n_images", [1, 2])
def test_cli_greedy_equals_transformers_generate(checkpoint, n_images, monkeypatch):
    """``mlxc generate --image`` token for token as transformers' greedy ``generate`` given
    Gemma3Processor's prompt, and the logits each token was picked from: 16 image tokens each,
    a window of 8, prefill chunks of 6 (a boundary would cut each image: prefill_spans moves it
    to the image's end; cut, the logits move by ~0.2)."""
    from mlxc.runtime.serving import sample as sample_mod

    _, path, hf, files = checkpoint
    files = files[:n_images]
    recorded, seen = [], []
    real_generate, real_sampler = generate_mod.generate_tokens, sample_mod.make_sampler

    def recording(*args, **kwargs):
        for token in real_generate(*args, **kwargs):
            recorded.append(token)
            yield token

    def recording_sampler(**kwargs):
        sampler = real_sampler(**kwargs)
        return lambda logits: seen.append(logits) or sampler(logits)

    monkeypatch.setattr(generate_mod, "generate_tokens", recording)
    monkeypatch.setattr(sample_mod, "make_sampler", recording_sampler)
    text = "describe the images"
    images = [a for f in files for a in ("--image", f)]
    args = ["--model", path, *images, "--prompt", text, "--max-tokens", 8]
    result = run_cli(*args, "--prefill-chunk-size", 6)
    assert result.exit_code == 0, result.output
    want_ids, want, want_logits = hf_generate(hf, path, files, text, 8)
    assert encode(path, files, text)[2].ids == want_ids
    assert f"prompt: {len(want_ids)} tokens" in result.stderr
    assert want_ids.count(SOFT) == 16 * n_images and len(want_ids) > 2 * 8
    assert recorded == want and len(want) > 1
    got = np.concatenate([np.array(x) for x in seen[: len(want)]])
    np.testing.assert_allclose(got, want_logits, atol=ATOL, rtol=0)


def assert_one_error_line(result, *needles):
    assert result.exit_code != 0, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output and not result.stdout
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.fixture(scope="module")
def text_checkpoint(tmp_path_factory):
    return ck.make_llama(tmp_path_factory.mktemp("llama"), num_hidden_layers=1)


def test_cli_image_errors(checkpoint, text_checkpoint, tmp_path, monkeypatch):
    _, path, _, files = checkpoint

    def gen(model, *images):
        image_args = [a for f in images for a in ("--image", f)]
        return run_cli("--model", model, *image_args, "--prompt", "hi", "--max-tokens", 2)

    assert_one_error_line(gen(text_checkpoint, files[0]), "--image", "llama", "takes no images")
    assert_one_error_line(gen(path, tmp_path / "nope.png"), "--image", "nope.png", "no such file")
    corrupt = tmp_path / "corrupt.png"
    corrupt.write_bytes(files[0].read_bytes()[:80])
    assert_one_error_line(gen(path, files[0], corrupt), "corrupt.png", "cannot decode")
    (tmp_path / "text.jpg").write_text("hello")
    assert_one_error_line(gen(path, tmp_path / "text.jpg"), "text.jpg", "cannot decode")
    bomb = tmp_path / "bomb.png"
    bomb.write_bytes(png_header_only(12_000, 9_000))
    assert_one_error_line(gen(path, bomb), "bomb.png", "too large")
    monkeypatch.setattr(proc, "MAX_IMAGE_PIXELS", 1000)
    assert_one_error_line(gen(path, files[0]), "too large", "70x50")
    assert_one_error_line(gen(path, tmp_path), "directory")


def test_cli_a_checkpoint_saved_without_its_tower_generates_text(checkpoint, tmp_path):
    """As mlx-lm converts a VL model (the text model only; its save_config drops
    vision_config): text generates, and an image is refused before the weights load."""
    from safetensors.numpy import load_file, save_file

    _, path, _, files = checkpoint
    text_only = tmp_path / "text-only"
    shutil.copytree(path, text_only, ignore=shutil.ignore_patterns("*.safetensors*"))
    weights = {k: v for f in path.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    vision = ("visual.", "vision_tower.", "multi_modal_projector.")
    text = {k: v for k, v in weights.items() if not any(p in k for p in vision)}
    assert len(text) < len(weights)
    save_file(text, str(text_only / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    del config["vision_config"]
    (text_only / "config.json").write_text(json.dumps(config))
    run = run_cli("--model", text_only, "--prompt", "hi", "--max-tokens", 2)
    assert run.exit_code == 0, run.output
    refused = run_cli("--model", text_only, "--image", files[0], "--prompt", "hi")
    assert_one_error_line(refused, "--image", "takes no images", "saved without one")


def make_qwen2_5_vl_3b(path):
    """A tiny qwen2_5_vl with Qwen2.5-VL-3B-Instruct's own tokenizer_config.json (a text-only
    chat template) and chat_template.json (the VL one), and an image: (path, image path)."""
    build("qwen2_5_vl", path)
    write_qwen2_5_vl_3b_files(path)
    image = path.parent / f"{path.name}.png"
    h, w = IMAGE_SIZES[0]
    Image.fromarray(np.random.default_rng(5).integers(0, 256, (h, w, 3), np.uint8)).save(image)
    return path, image


@pytest.fixture(scope="module")
def qwen2_5_vl_3b(tmp_path_factory):
    return make_qwen2_5_vl_3b(tmp_path_factory.mktemp("qwen2_5_vl-3b-files"))


def test_cli_images_with_the_qwen2_5_vl_3b_templates(qwen2_5_vl_3b, tmp_path):
    path, image = qwen2_5_vl_3b
    # The processor's template (chat_template.json) renders the image: this was a TypeError
    # traceback from the tokenizer's text-only one.
    result = run_cli("--model", path, "--image", image, "--prompt", "describe", "--max-tokens", 3)
    assert result.exit_code == 0, result.output
    _, _, prompt = encode(path, [image], "describe")
    assert f"prompt: {len(prompt.ids)} tokens" in result.stderr
    assert prompt.ids.count(QWEN_IDS["image_token_id"]) > 1  # the placeholder was expanded

    # Without chat_template.json only the tokenizer's text-only template is left: one error line
    # that names it, no traceback.
    bare = tmp_path / "no-processor-template"
    shutil.copytree(path, bare)
    (bare / "chat_template.json").unlink()
    result = run_cli("--model", bare, "--image", image, "--prompt", "describe", "--max-tokens", 3)
    assert_one_error_line(
        result,
        "the chat template from tokenizer_config.json failed",
        'can only concatenate str (not "list") to str',
    )
