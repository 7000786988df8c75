"""bench/vl_compare.py's mlxc side on tiny checkpoints (no mlx-vlm needed): the numbers it
reports agree with the processor's output and with a plain greedy run, and a peer that cannot
load is reported as failing, not dropped."""

from __future__ import annotations

import json
import math

import pytest
from safetensors import safe_open

from bench import models, vl_compare
from mlxc.runtime.serving.generate import generate_tokens

DECODE = 5  # tokens after the first; the harness keeps the first 8 of each run


@pytest.fixture(scope="module", params=models.VL_ARCHS)
def measured(request, tmp_path_factory):
    arch = request.param
    tmp = tmp_path_factory.mktemp(arch)
    path = models.write_vl_checkpoint(tmp / "ckpt", arch, "tiny")
    image = str(vl_compare.write_image(tmp / "image.png", 56, 84))
    result = vl_compare.measure_arch(
        str(path),
        image,
        device="cpu",
        decode_tokens=DECODE,
        repeats=2,
        budget_s=600,
        peer=False,
        log=lambda msg: None,
    )
    return arch, path, image, result["sides"]["mlxc"]


def test_hub_layout(measured):
    arch, path, _, _ = measured
    index = json.loads((path / "model.safetensors.index.json").read_text())
    names = set(index["weight_map"])
    prefixes = {
        "qwen2_vl": ("visual.", "model.layers."),
        "qwen3_vl": ("model.visual.", "model.language_model."),
        "mistral3": ("vision_tower.", "multi_modal_projector.", "language_model.model."),
    }[arch]
    assert {n.split(".")[0] for n in names} == {p.split(".")[0] for p in prefixes}
    for p in prefixes:
        assert any(n.startswith(p) for n in names), p
    with safe_open(path / index["weight_map"][min(names)], "np") as f:
        assert f.metadata() == {"format": "pt"}


def test_counts_equal_what_the_processor_made(measured):
    arch, path, image, r = measured
    side = vl_compare.load_ours(str(path), image)
    prompt = side.encode()
    assert r["prompt_tokens"] == len(prompt.ids)
    assert r["image_tokens"] == prompt.ids.count(side.processor.image_token_id)
    cfg = json.loads((path / "config.json").read_text())
    if arch == "mistral3":  # one token per merged 2x2 patch of the resized image
        h, w = (int(x) for x in prompt.vision["image_sizes"][0])
        cell = cfg["vision_config"]["patch_size"] * cfg["spatial_merge_size"]
        assert r["image_tokens"] == math.ceil(h / cell) * math.ceil(w / cell)
    else:  # the grid of patches over merge**2
        t, gh, gw = (int(x) for x in prompt.vision["image_grid_thw"][0])
        assert r["image_tokens"] == t * gh * gw // cfg["vision_config"]["spatial_merge_size"] ** 2
    assert r["image_tokens"] > 1 and r["prompt_tokens"] > r["image_tokens"]


def test_tokens_and_rates_are_the_runs(measured):
    _, path, image, r = measured
    side = vl_compare.load_ours(str(path), image)
    prompt = side.encode()
    greedy = list(
        generate_tokens(side.model, prompt.ids, max_tokens=DECODE + 1, vision_inputs=prompt.vision)
    )
    assert r["tokens"] == greedy and len(greedy) == DECODE + 1  # EOS never cuts a run short
    assert r["repeats"] == 2 and len(r["first_token_s_all"]) == len(r["decode_tps_all"]) == 2
    assert r["prefill_tps"] == pytest.approx(r["prompt_tokens"] / r["first_token_s"])
    assert min(r["decode_tps_all"]) <= r["decode_tps"] <= max(r["decode_tps_all"])
    assert r["peak_bytes"] >= side.weight_bytes > 0 and r["dtype"] == "float32"


def test_a_peer_that_cannot_load_is_reported(tmp_path, monkeypatch):
    def fail(*a, **k):
        raise ValueError("no such model type")

    monkeypatch.setattr(vl_compare, "load_peer", fail)
    path = models.write_vl_checkpoint(tmp_path / "ckpt", "mistral3", "tiny")
    image = str(vl_compare.write_image(tmp_path / "image.png", 28, 28))
    sides = vl_compare.measure_arch(
        str(path), image, device="cpu", decode_tokens=1, repeats=1, budget_s=60, log=print
    )["sides"]
    assert sides["mlx-vlm"] == {"error": "ValueError: no such model type"}
    result = {
        "command": "x",
        "machine": {"device": "cpu", "cpus": 2},
        "size": "tiny",
        "settings": {"image": [28, 28], "decode_tokens": 1},
        "archs": {"mistral3": {"params": 1e6, "sides": sides}},
        "versions": {"mlx": "0", "mlx-vlm": "0", "transformers": "0", "mlxc": "0"},
        "wall_s": 1.0,
    }
    row = next(line for line in vl_compare.markdown(result).splitlines() if "| mistral3" in line)
    assert "fails: ValueError: no such model type" in row
