"""runtime/checkpoint/processor.py: chat messages + images -> prompt ids and vision inputs.

Qwen VL: pixel values and grids must equal transformers' ``Qwen2VLImageProcessorPil`` loaded by
transformers itself from the same ``preprocessor_config.json`` (hub Qwen2-VL, Qwen2.5-VL and
Qwen3-VL layouts, and a file with only sizes, where patch sizes come from config.json), and the
ids must equal the rendered chat template with each ``<|image_pad|>`` expanded in the text, as
``Qwen2VLProcessor`` does (it cannot be built without torchvision, neither can
``PixtralProcessor``). Pixtral: the integration of ``pixtral_preprocess`` (tested against
transformers in test_pixtral.py). Only config.json, tokenizer and processor files here: no
weights (models run in test_generate_images.py).
"""

from __future__ import annotations

import io
import json
import shutil
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import transformers
from PIL import Image
from test_qwen_vision import CONFIGS as QWEN_VISION_CONFIGS
from test_qwen_vision import TEXT as QWEN_TEXT

from bench.models import (
    CLIP_MEAN,
    CLIP_STD,
    MISTRAL_SPECIALS,
    MISTRAL_TEMPLATE,
    QWEN_IDS,
    QWEN_SPECIALS,
    QWEN_TEMPLATE,
    qwen_preprocessor,
    write_pixtral_processor,
)
from mlxc.runtime.checkpoint import pixtral_preprocess as pp
from mlxc.runtime.checkpoint import processor as proc
from mlxc.runtime.checkpoint.tokenizer import load_tokenizer

VOCAB = 288  # >= 8 specials + 256 bytes + a few merges

# --- tokenizers -----------------------------------------------------------------------------
# The Qwen2-VL and Mistral-Small-3.1 (image part) chat templates and special tokens are the
# benchmark checkpoints' (bench/models.py).

IMG, IMG_BREAK, IMG_END = 5, 6, 7
PATCH, MERGE = 4, 2  # pixtral test tower


def write_tokenizer(path, specials, template, **named):
    """A byte-level BPE tokenizer whose specials get ids 0, 1, ... in order; with a
    ``bos_token``, encoding with special tokens prepends it (as Mistral's tokenizer does)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=len(specials) + 256 + 16,
        special_tokens=list(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(["describe the images, then compare them."] * 4, trainer)
    if "bos_token" in named:
        bos = named["bos_token"]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", special_tokens=[(bos, specials.index(bos))]
        )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=template, **named)
    assert len(fast) <= VOCAB
    fast.save_pretrained(str(path))


def write_qwen_tokenizer(path, template=QWEN_TEMPLATE):
    write_tokenizer(
        path, QWEN_SPECIALS, template, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )


def write_mistral_tokenizer(path, template=MISTRAL_TEMPLATE):
    write_tokenizer(
        path, MISTRAL_SPECIALS, template, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


# --- checkpoint files (no weights) ----------------------------------------------------------

QWEN_CONFIG_CLASSES = {name: spec[0] for name, spec in QWEN_VISION_CONFIGS.items()}
QWEN_CONFIG_CLASSES["qwen3_vl_moe"] = "Qwen3VLMoeConfig"
QWEN_TOWER = {
    "qwen2_vl": "qwen2_vit",
    "qwen2_5_vl": "qwen2_5_vit",
    "qwen3_vl": "qwen3_vit",
    "qwen3_vl_moe": "qwen3_vit",
}
_SIZES = {"min_pixels": 16 * 16, "max_pixels": 128 * 128}
# preprocessor_config.json as the hub ships it per family (patch sizes scaled down to the tiny
# towers), plus one holding only the sizes.
QWEN_PREPROCESSOR = {
    "qwen2_vl": qwen_preprocessor("qwen2_vl", 8, **_SIZES),  # Qwen/Qwen2-VL-*
    "qwen2_5_vl": {  # Qwen/Qwen2.5-VL-*: both forms, as transformers 4.5x wrote them
        **_SIZES,
        "size": {"shortest_edge": _SIZES["min_pixels"], "longest_edge": _SIZES["max_pixels"]},
        "patch_size": 8,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "resample": 3,
        "rescale_factor": 1 / 255,
        "do_convert_rgb": True,
        "image_mean": CLIP_MEAN,
        "image_std": CLIP_STD,
        "image_processor_type": "Qwen2VLImageProcessorFast",
        "processor_class": "Qwen2_5_VLProcessor",
    },
    "qwen3_vl": qwen_preprocessor("qwen3_vl", 8, **_SIZES),  # Qwen/Qwen3-VL-*
    "qwen3_vl_moe": {  # sizes only: patch sizes from config.json, Qwen3-VL mean/std
        "size": {"shortest_edge": _SIZES["min_pixels"], "longest_edge": _SIZES["max_pixels"]},
    },
}


def qwen_config(arch: str, **text):
    name = QWEN_CONFIG_CLASSES[arch]
    vision_arch = "qwen3_vl" if arch == "qwen3_vl_moe" else arch
    _, _, vision, text_extra = QWEN_VISION_CONFIGS[vision_arch]
    return getattr(transformers, name)(
        vision_config=dict(vision),
        text_config={
            **QWEN_TEXT,
            **text_extra,
            "vocab_size": VOCAB,
            "bos_token_id": None,
            "eos_token_id": 2,  # <|im_end|>
            **text,
        },
        tie_word_embeddings=False,
        **QWEN_IDS,
    )


def write_qwen_files(path, arch: str):
    """Tokenizer, chat template and preprocessor_config.json for a Qwen VL checkpoint dir."""
    write_qwen_tokenizer(path)
    (path / "preprocessor_config.json").write_text(json.dumps(QWEN_PREPROCESSOR[arch]))


# Qwen/Qwen2.5-VL-3B-Instruct's own files: a text-only chat template in tokenizer_config.json and
# the VL one in chat_template.json (test_processor_chat_template.py says where they come from).
QWEN2_5_VL_3B = Path(__file__).parent / "fixtures" / "qwen2_5_vl_3b_instruct"


def write_qwen2_5_vl_3b_files(path):
    """write_qwen_files, then the tokenizer and template files as Qwen2.5-VL-3B-Instruct ships
    them: its tokenizer_config.json and chat_template.json byte for byte (the tiny tokenizer.json
    stands in for the 151k vocabulary; the special tokens map onto it by name)."""
    write_qwen_files(path, "qwen2_5_vl")
    (path / "chat_template.jinja").unlink()  # written by transformers 5; the hub repo has none
    for name in ("tokenizer_config.json", "chat_template.json"):
        shutil.copyfile(QWEN2_5_VL_3B / name, path / name)


def write_mistral_files(path):
    """Tokenizer, chat template and the hub's two pixtral processor files."""
    write_mistral_tokenizer(path)
    write_pixtral_processor(path, PATCH, MERGE, longest_edge=40)


def mistral_config():
    return transformers.Mistral3Config(
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
        text_config={"model_type": "mistral", "vocab_size": VOCAB, "hidden_size": 64},
        image_token_index=IMG,
        spatial_merge_size=MERGE,
        tie_word_embeddings=False,
    )


@pytest.fixture(scope="module")
def qwen_dirs(tmp_path_factory):
    dirs = {}
    for arch in QWEN_TOWER:
        path = tmp_path_factory.mktemp(arch)
        qwen_config(arch).save_pretrained(path)
        write_qwen_files(path, arch)
        dirs[arch] = path
    return dirs


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("mistral3")
    mistral_config().save_pretrained(path)
    write_mistral_files(path)
    return path


def images(*sizes, seed=0, mode="RGB"):
    rng = np.random.default_rng(seed)
    out = []
    for h, w in sizes:
        channels = {"RGB": 3, "RGBA": 4}.get(mode)
        shape = (h, w, channels) if channels else (h, w)
        out.append(Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8), mode=mode))
    return out


def user(n_images, text="describe the images", part="image"):
    img = {"type": "image"} if part == "image" else {"type": "image_url", "image_url": {"url": "x"}}
    return [
        {
            "role": "user",
            "content": [dict(img) for _ in range(n_images)] + [{"type": "text", "text": text}],
        }
    ]


# --- Qwen VL --------------------------------------------------------------------------------


def hf_qwen_reference(path, arch, tokenizer, messages, imgs):
    """What Qwen2VLProcessor would produce: transformers' PIL image processor loaded from the
    checkpoint's files, the text-level <|image_pad|> expansion, then tokenization."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    if "patch_size" in QWEN_PREPROCESSOR[arch]:
        image_processor = Qwen2VLImageProcessorPil.from_pretrained(str(path))
    else:  # what the checkpoint means: config.json's patch sizes, Qwen3-VL's mean/std
        image_processor = Qwen2VLImageProcessorPil(
            size=QWEN_PREPROCESSOR[arch]["size"],
            patch_size=8,
            merge_size=2,
            temporal_patch_size=2,
            image_mean=[0.5] * 3,
            image_std=[0.5] * 3,
        )
    out = image_processor(images=imgs, return_tensors="np")
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    merge = image_processor.merge_size**2
    for grid in out["image_grid_thw"]:
        text = text.replace("<|image_pad|>", "<|placeholder|>" * int(grid.prod() // merge), 1)
    text = text.replace("<|placeholder|>", "<|image_pad|>")
    ids = tokenizer(text)["input_ids"]
    return ids, out["pixel_values"], out["image_grid_thw"]


@pytest.mark.parametrize("arch", list(QWEN_TOWER))
def test_qwen_matches_transformers_image_processor(qwen_dirs, arch):
    path = qwen_dirs[arch]
    tokenizer = load_tokenizer(path)
    processor = proc.load_processor(path, tokenizer, QWEN_TOWER[arch])
    imgs = images((50, 70), (90, 40)) + images((33, 20), mode="RGBA", seed=1)
    messages = [
        *user(2, "first two"),
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [{"type": "text", "text": "and"}, {"type": "image"}]},
    ]
    prompt = processor.encode(messages, imgs)
    ids, pv, grid = hf_qwen_reference(path, arch, tokenizer, messages, imgs)
    assert prompt.ids == ids
    assert set(prompt.vision) == {"pixel_values", "image_grid_thw"}
    got_pv = np.array(prompt.vision["pixel_values"])
    assert got_pv.dtype == np.float32 and got_pv.shape == pv.shape
    np.testing.assert_array_equal(got_pv, pv)
    np.testing.assert_array_equal(np.array(prompt.vision["image_grid_thw"]), grid)
    assert prompt.ids.count(QWEN_IDS["image_token_id"]) == int(grid.prod(axis=1).sum()) // 4
    # Each image's run of tokens sits between <|vision_start|> and <|vision_end|>.
    runs = "".join("I" if t == 5 else "S" if t == 3 else "E" if t == 4 else "." for t in ids)
    assert runs.count("S") == 3 and all(
        run == "I" * (int(g.prod()) // 4)
        for run, g in zip([r.split("E")[0] for r in runs.split("S")[1:]], grid)
    )


def test_qwen_image_url_parts_and_text_helper(qwen_dirs):
    path = qwen_dirs["qwen2_vl"]
    processor = proc.load_processor(path, load_tokenizer(path), "qwen2_vit")
    imgs = images((50, 70), (90, 40))
    a = processor.encode(user(2, "hi", part="image_url"), imgs)
    b = processor.encode_text_and_images("hi", imgs)
    assert a.ids == b.ids
    assert np.array_equal(np.array(a.vision["pixel_values"]), np.array(b.vision["pixel_values"]))


def test_qwen_without_chat_template_puts_images_first(qwen_dirs, tmp_path):
    src = qwen_dirs["qwen3_vl"]
    for name in ("config.json", "preprocessor_config.json"):
        (tmp_path / name).write_text((src / name).read_text())
    write_qwen_tokenizer(tmp_path, template=None)
    tokenizer = load_tokenizer(tmp_path)
    processor = proc.load_processor(tmp_path, tokenizer, "qwen3_vit")
    prompt = processor.encode_text_and_images("hi", images((50, 70)))
    n = int(np.array(prompt.vision["image_grid_thw"]).prod()) // 4
    assert prompt.ids == [3] + [5] * n + [4] + tokenizer.encode("hi")
    # The same prompt through encode(chat_template=False) on a tokenizer that has one.
    templated = proc.load_processor(src, load_tokenizer(src), "qwen3_vit")
    raw = templated.encode_text_and_images("hi", images((50, 70)), chat_template=False)
    assert raw.ids == prompt.ids


def test_qwen_preprocessor_kwargs(tmp_path):
    config = qwen_config("qwen3_vl")
    config.save_pretrained(tmp_path)
    # No preprocessor files: Qwen3-VL's hub values, patch sizes from config.json.
    kwargs = proc.qwen_image_processor_kwargs(tmp_path, "qwen3_vit")
    assert kwargs == {
        "size": {"shortest_edge": 65536, "longest_edge": 16777216},
        "image_mean": [0.5] * 3,
        "image_std": [0.5] * 3,
        "patch_size": 8,
        "merge_size": 2,
        "temporal_patch_size": 2,
    }
    # Qwen2 family without files: transformers' class defaults (only patch sizes filled in).
    assert set(proc.qwen_image_processor_kwargs(tmp_path, "qwen2_vit")) == {
        "patch_size",
        "merge_size",
        "temporal_patch_size",
    }
    # Nested under processor_config.json's image_processor (transformers 5 may write that).
    (tmp_path / "processor_config.json").write_text(
        json.dumps({"image_processor": {"size": {"min_pixels": 100, "max_pixels": 900}}})
    )
    kwargs = proc.qwen_image_processor_kwargs(tmp_path, "qwen3_vit")
    assert kwargs["size"] == {"shortest_edge": 100, "longest_edge": 900}
    # A patch size the tower does not have is caught at load, not as a shape error later.
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"patch_size": 16}))
    with pytest.raises(ValueError, match="patch_size 16 != config.json vision_config"):
        proc.qwen_image_processor_kwargs(tmp_path, "qwen3_vit")


# --- Pixtral --------------------------------------------------------------------------------


def test_pixtral_integration(mistral_dir):
    tokenizer = load_tokenizer(mistral_dir)
    processor = proc.load_processor(mistral_dir, tokenizer, "pixtral")
    imgs = images((30, 22), (17, 40)) + images((12, 9), mode="RGBA", seed=2)
    messages = user(2, "two") + [
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [{"type": "image_url", "image_url": {}}]},
    ]
    prompt = processor.encode(messages, imgs)
    cfg = pp.PixtralProcessorConfig.from_pretrained(mistral_dir)
    assert (cfg.patch_size, cfg.spatial_merge_size, cfg.longest_edge) == (PATCH, MERGE, 40)
    pv, sizes = pp.preprocess_images(imgs, cfg)
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.count("[IMG]") == 3 and text.startswith("<s>[INST][IMG][IMG]two[/INST]ok</s>")
    # PixtralProcessor expands the text, then tokenizes; the ids must agree.
    expanded = pp.expand_image_tokens(text, sizes, PATCH, MERGE, *MISTRAL_SPECIALS[5:])
    assert prompt.ids == tokenizer.encode(expanded, add_special_tokens=False)
    assert prompt.ids[0] == 1 and prompt.ids.count(1) == 1  # one BOS
    np.testing.assert_array_equal(np.array(prompt.vision["pixel_values"]), pv)
    np.testing.assert_array_equal(np.array(prompt.vision["image_sizes"]), sizes)
    assert np.array(prompt.vision["pixel_values"]).dtype == np.float32
    # rows x cols [IMG] per image: 30x22 -> 32x24 -> 4 rows of 3.
    assert prompt.ids.count(IMG) == sum((h // 8) * (w // 8) for h, w in sizes.tolist())
    assert prompt.ids.count(IMG_END) == 3
    assert prompt.ids.count(IMG_BREAK) == sum(h // 8 - 1 for h, _ in sizes.tolist())


def test_pixtral_without_chat_template(mistral_dir, tmp_path):
    for name in ("config.json", "preprocessor_config.json", "processor_config.json"):
        (tmp_path / name).write_text((mistral_dir / name).read_text())
    write_mistral_tokenizer(tmp_path, template=None)
    tokenizer = load_tokenizer(tmp_path)
    processor = proc.load_processor(tmp_path, tokenizer, "pixtral")
    prompt = processor.encode_text_and_images("hi", images((16, 8)))
    # BOS, then the image (2 rows of 1: [IMG] [IMG_BREAK] [IMG] [IMG_END]), then the text.
    assert prompt.ids[:5] == [1, IMG, IMG_BREAK, IMG, IMG_END]
    assert tokenizer.decode(prompt.ids[5:]) == "hi"


# --- errors and other models ----------------------------------------------------------------


def test_placeholder_and_image_count_mismatch(qwen_dirs, mistral_dir):
    for path, tower in ((qwen_dirs["qwen2_5_vl"], "qwen2_5_vit"), (mistral_dir, "pixtral")):
        processor = proc.load_processor(path, load_tokenizer(path), tower)
        with pytest.raises(proc.ImageInputError, match="2 image part"):
            processor.encode(user(2), images((20, 20)))
        with pytest.raises(proc.ImageInputError, match="1 image part"):
            processor.encode(user(1), [])
    # A template that drops image parts: a clear error, not a shape error in the model.
    processor = proc.load_processor(
        qwen_dirs["qwen2_vl"],
        load_tokenizer(qwen_dirs["qwen2_vl"]),
        "qwen2_vit",
        chat_template="{% for m in messages %}{{ m['role'] }}{% endfor %}",
    )
    with pytest.raises(proc.ImageInputError, match="does not render image parts"):
        processor.encode(user(1), images((20, 20)))
    with pytest.raises(ValueError, match="unsupported content part 'audio'"):
        processor.encode([{"role": "user", "content": [{"type": "audio"}]}], [])


def test_text_model_processor(qwen_dirs):
    tokenizer = load_tokenizer(qwen_dirs["qwen2_vl"])
    processor = proc.load_processor(qwen_dirs["qwen2_vl"], tokenizer, None)
    assert processor.encode_text_and_images("hi").ids == tokenizer.encode(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
        ),
        add_special_tokens=False,
    )
    with pytest.raises(proc.ImageInputError, match="takes no images"):
        processor.encode_text_and_images("hi", images((20, 20)))


def test_processor_for_a_model_or_module(qwen_dirs):
    import importlib

    module = importlib.import_module("mlxc.generated.qwen2_vl")
    assert proc.vision_tower(module) == "qwen2_vit"
    assert proc.vision_tower(importlib.import_module("mlxc.generated.llama")) is None
    assert proc.vision_tower("pixtral") == "pixtral"
    # A model built from a generated module carries its tower as a class attribute.
    assert proc.vision_tower(module.Model.__new__(module.Model)) == "qwen2_vit"
    with pytest.raises(ValueError, match="no image preprocessing"):
        proc.load_processor(qwen_dirs["qwen2_vl"], None, "siglip")


def test_tokenizer_without_the_config_image_tokens(qwen_dirs, tmp_path):
    config = json.loads((qwen_dirs["qwen2_vl"] / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "image_token_id": 999}))
    write_qwen_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="lacks the image tokens"):
        proc.load_processor(tmp_path, load_tokenizer(tmp_path), "qwen2_vit")


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims ``width`` x ``height`` (no pixel data worth the name)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b""))
        + (chunk(b"IEND", b""))
    )


def test_load_image(tmp_path):
    good = tmp_path / "a.png"
    images((5, 7), mode="RGBA")[0].save(good)
    image = proc.load_image(good)
    assert image.size == (7, 5) and image.mode == "RGBA"
    buf = io.BytesIO()
    images((4, 4))[0].save(buf, format="JPEG")
    assert proc.load_image(buf.getvalue()).size == (4, 4)

    with pytest.raises(proc.ImageInputError, match="no such file"):
        proc.load_image(tmp_path / "missing.png")
    with pytest.raises(proc.ImageInputError, match="directory"):
        proc.load_image(tmp_path)
    (tmp_path / "text.png").write_text("not an image")
    with pytest.raises(proc.ImageInputError, match="cannot decode"):
        proc.load_image(tmp_path / "text.png")
    truncated = tmp_path / "truncated.png"
    truncated.write_bytes(good.read_bytes()[:60])
    with pytest.raises(proc.ImageInputError, match="cannot decode"):
        proc.load_image(truncated)
    # Decompression bombs: refused from the header, before any pixel is decoded.
    with pytest.raises(proc.ImageInputError, match="too large"):
        proc.load_image(png_header_only(20_000, 20_000))  # 400 MP: PIL's own error
    with pytest.raises(proc.ImageInputError, match="too large: 10000x10000"):
        proc.load_image(png_header_only(10_000, 10_000))  # 100 MP: above our limit
    with pytest.raises(proc.ImageInputError, match="too large: 7x5 = 35 pixels"):
        proc.load_image(good, max_pixels=34)


def test_extreme_aspect_ratio_is_an_image_error(qwen_dirs):
    processor = proc.load_processor(
        qwen_dirs["qwen2_vl"], load_tokenizer(qwen_dirs["qwen2_vl"]), "qwen2_vit"
    )
    with pytest.raises(proc.ImageInputError, match="aspect ratio"):
        processor.encode_text_and_images("hi", images((1, 300)))


# --- vision inputs stay numpy (MLX belongs to the scheduler thread) --------------------------


def test_vision_inputs_are_numpy(qwen_dirs, mistral_dir):
    for path, tower, keys in (
        (
            qwen_dirs["qwen2_5_vl"],
            "qwen2_5_vit",
            {"pixel_values": "float32", "image_grid_thw": "int64"},
        ),
        (mistral_dir, "pixtral", {"pixel_values": "float32", "image_sizes": "int64"}),
    ):
        processor = proc.load_processor(path, load_tokenizer(path), tower)
        vision = processor.encode_text_and_images("hi", images((20, 28))).vision
        assert {k: (type(v), str(v.dtype)) for k, v in vision.items()} == {
            k: (np.ndarray, dtype) for k, dtype in keys.items()
        }


def test_prompt_building_never_imports_mlx(qwen_dirs, mistral_dir):
    # What the server runs on its event loop: load the tokenizer and processor, encode an image.
    code = f"""
import sys
import numpy as np
from PIL import Image
from mlxc.runtime.checkpoint.processor import load_processor
from mlxc.runtime.checkpoint.tokenizer import load_tokenizer, encode_prompt
image = Image.fromarray(np.zeros((20, 28, 3), np.uint8))
for path, tower in [({str(qwen_dirs["qwen2_5_vl"])!r}, "qwen2_5_vit"), ({str(mistral_dir)!r}, "pixtral")]:
    tokenizer = load_tokenizer(path)
    encode_prompt(tokenizer, "hi")
    load_processor(path, tokenizer, tower).encode_text_and_images("hi", [image])
loaded = sorted(m for m in sys.modules if m == "mlx" or m.startswith("mlx."))
assert not loaded, loaded
"""
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr


# --- image_size: the header only -------------------------------------------------------------


def test_image_size_reads_the_header_only(tmp_path, monkeypatch):
    good = tmp_path / "a.png"
    images((5, 7))[0].save(good)
    assert proc.image_size(good) == (7, 5)
    assert proc.image_size(good.read_bytes()) == (7, 5)
    with open(good, "rb") as f:
        assert proc.image_size(f) == (7, 5)
    # No pixel is decoded: a header claiming 9000x9000 (81 MP, no pixel data) answers at once.
    from PIL import ImageFile

    def no_decoding(self):
        raise AssertionError("image_size decoded pixels")

    monkeypatch.setattr(ImageFile.ImageFile, "load", no_decoding)
    assert proc.image_size(png_header_only(9_000, 9_000)) == (9_000, 9_000)
    # The errors are load_image's.
    with pytest.raises(proc.ImageInputError, match="cannot decode image image data: not an image"):
        proc.image_size(b"not an image")
    with pytest.raises(proc.ImageInputError, match="no such file"):
        proc.image_size(tmp_path / "missing.png")
    with pytest.raises(proc.ImageInputError, match="is too large"):
        proc.image_size(png_header_only(20_000, 20_000))  # PIL refuses above 2x its limit


def test_every_vision_tower_has_a_processor():
    """The compiler's towers (what specs may name) and the runtime's processors agree."""
    from mlxc.compiler.vision import TOWERS
    from mlxc.runtime.checkpoint.processor import PROCESSORS

    assert set(PROCESSORS) == set(TOWERS)
