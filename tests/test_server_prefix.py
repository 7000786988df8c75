"""The prefix cache through `mlxc serve`: a request that resumes from cached chunks reports them
in `usage.prompt_tokens_details.cached_tokens` and answers exactly what it answers without the
hit (greedy), on a full-KV model under a bounded cache (llama), a sliding-window model
(gemma3_text, window 16) and a VL model with MRoPE and an image (qwen2_vl).

Every comparison is against a miss of the same request: its first send on a fresh server, a
server with the cache off, or `mlxc generate` (which the other server tests hold equal to the
server's miss)."""

from __future__ import annotations

import concurrent.futures
import re

import pytest
from test_generate_images import IMAGE_SIZES, build
from test_server import ARCHS, LONG, Server, mlxc_generate
from test_server_vision import image_message

CHUNK = 16
LLAMA_ARGS = ["--max-kv-size", 64, "--prefill-chunk-size", CHUNK]
SYSTEM = "You are a terse assistant. " * 6


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return tmp_path_factory.mktemp("serve-prefix-logs")


def ask(client, messages, max_tokens=12, **body):
    r = client.post(
        "/v1/chat/completions", json={"messages": messages, "max_tokens": max_tokens, **body}
    )
    assert r.status_code == 200, r.text
    out = r.json()
    return out["choices"][0]["message"]["content"], out["usage"]


def user(text):
    return {"role": "user", "content": text}


# --- a full-KV model under --max-kv-size -----------------------------------------------------


@pytest.fixture(scope="module")
def llama(tmp_path_factory, logs):
    path = ARCHS["llama"](tmp_path_factory.mktemp("llama"))
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # both start at once
        on, off = pool.map(
            lambda extra: Server(["--model", path, *LLAMA_ARGS, *extra], logs),
            [[], ["--prefix-cache-bytes", 0]],
        )
    yield path, on, off
    on.close()
    off.close()


def test_repeated_prompt_is_cached_up_to_the_first_trim_and_answers_the_same(llama):
    """LONG is far past --max-kv-size 64: chunks are snapshotted until the first trim (after
    the chunk ending at 64), so a repeat resumes at 64 tokens and prefills the rest."""
    _, on, _ = llama
    with on.client() as c:
        first, u1 = ask(c, [user(LONG)])
        again, u2 = ask(c, [user(LONG)])
    assert u1["prompt_tokens_details"]["cached_tokens"] == 0
    assert u2["prompt_tokens_details"]["cached_tokens"] == 64
    assert again == first


def test_multi_turn_prefills_only_the_new_turn(llama):
    _, on, off = llama
    turn1 = [{"role": "system", "content": SYSTEM}, user("Name three colours.")]
    with on.client() as c:
        answer, u1 = ask(c, turn1)
        turn2 = [*turn1, {"role": "assistant", "content": answer}, user("And three fruits?")]
        hit, u2 = ask(c, turn2)
    with off.client() as c:
        miss, u3 = ask(c, turn2)
    cached = u2["prompt_tokens_details"]["cached_tokens"]
    # Whole chunks of turn 1's prompt; never the chunk holding turn 2's last token.
    assert cached > 0 and cached % CHUNK == 0 and cached <= u1["prompt_tokens"]
    assert u3["prompt_tokens_details"]["cached_tokens"] == 0
    assert hit == miss


def test_hits_decode_in_the_batch_as_alone(llama):
    """Requests resuming from the cache join the decode batch like any other."""
    _, on, _ = llama
    prompts = [[{"role": "system", "content": SYSTEM}, user(f"Question {i}?")] for i in range(3)]
    with on.client() as c:
        alone = [ask(c, m, max_tokens=24, ignore_eos=True)[0] for m in prompts]
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            together = list(pool.map(lambda m: ask(c, m, max_tokens=24, ignore_eos=True), prompts))
    for want, (text, usage) in zip(alone, together):
        assert usage["prompt_tokens_details"]["cached_tokens"] > 0
        assert text == want
    health = on.wait_idle()
    assert health["requests"]["failed"] == 0 and health["pool"]["peak_batched"] >= 2
    assert health["prefix_cache"]["hits"] >= 4 and health["prefix_cache"]["bytes"] > 0
    with on.client() as c:
        text = c.get("/metrics").text
    counted = {
        name: float(value)
        for name, value in re.findall(
            r"^(mlxc_prefix_cache_hit\w*_total) (\S+)$", text, re.MULTILINE
        )
    }
    assert counted["mlxc_prefix_cache_hits_total"] == health["prefix_cache"]["hits"]
    assert counted["mlxc_prefix_cache_hit_tokens_total"] == health["prefix_cache"]["hit_tokens"]


# --- a sliding-window model ----------------------------------------------------------------------


def test_windowed_layers_resume_from_their_window(tmp_path_factory, logs):
    """gemma3_text (window 16, chunks of 16): a windowed layer's snapshot holds the last 15
    keys; a prompt sharing the first chunks of another resumes there."""
    path = ARCHS["gemma3_text"](tmp_path_factory.mktemp("gemma3_text"))
    args = ["--prefill-chunk-size", CHUNK]
    shorter = LONG[: len(LONG) // 2] + " A different ending."
    server = Server(["--model", path, *args], logs)
    try:
        with server.client() as c:
            first, u1 = ask(c, [user(LONG)])
            again, u2 = ask(c, [user(LONG)])
            partial, u3 = ask(c, [user(shorter)])
    finally:
        server.close()
    assert u1["prompt_tokens_details"]["cached_tokens"] == 0
    assert u2["prompt_tokens_details"]["cached_tokens"] >= u2["prompt_tokens"] - CHUNK
    assert again == first
    assert 0 < u3["prompt_tokens_details"]["cached_tokens"] < u3["prompt_tokens"] - CHUNK
    assert partial == mlxc_generate(path, shorter, "--max-tokens", 12, *args)[0]


def first_image_token(path, image) -> int:
    from PIL import Image

    from mlxc.runtime.checkpoint.loading import load_checkpoint

    processor = load_checkpoint(path).processor
    ids = processor.encode_text_and_images(LONG, [Image.open(image).convert("RGB")]).ids
    return ids.index(processor.image_token_id)


# --- a VL model with MRoPE -------------------------------------------------------------------------


def test_images_are_part_of_the_key(tmp_path_factory, logs):
    """qwen2_vl: a repeat of an image chat resumes past the image (MRoPE state restored,
    the vision tower not run again) and answers as its first send; the same text with another
    image reuses nothing past the text before its image and answers as `mlxc generate`."""
    import numpy as np
    from PIL import Image

    path = tmp_path_factory.mktemp("qwen2_vl")
    build("qwen2_vl", path)
    images = []
    for seed in (2, 3):
        image = path.parent / f"{path.name}-{seed}.png"
        h, w = IMAGE_SIZES[0]
        pixels = np.random.default_rng(seed).integers(0, 256, (h, w, 3), np.uint8)
        Image.fromarray(pixels).save(image)
        images.append(image)
    args = ["--prefill-chunk-size", CHUNK]
    server = Server(["--model", path, *args], logs)
    try:
        with server.client() as c:
            first, u1 = ask(c, [image_message(images[0], LONG)])
            again, u2 = ask(c, [image_message(images[0], LONG)])
            other, u3 = ask(c, [image_message(images[1], LONG)])
    finally:
        server.close()
    assert u1["prompt_tokens_details"]["cached_tokens"] == 0
    assert u2["prompt_tokens_details"]["cached_tokens"] >= u2["prompt_tokens"] - CHUNK
    assert again == first
    # Another image: only the whole chunks before its first image token are reused.
    first_image = first_image_token(path, images[1])
    assert first_image >= CHUNK
    assert u3["prompt_tokens_details"]["cached_tokens"] == first_image // CHUNK * CHUNK
    assert other == mlxc_generate(path, LONG, "--image", images[1], "--max-tokens", 12, *args)[0]
