"""`mlxc serve` on every vision architecture: images as data URLs, the mlxcel #421 crash
scenario with an image before the trims, parity with `mlxc generate --image`, bad images."""

from __future__ import annotations

import base64
import threading

import numpy as np
import pytest
from test_generate_images import ARCHS, IMAGE_SIZES, build
from test_server import LONG, SHORT, Server, mlxc_generate

BOUNDED = ["--max-kv-size", 64, "--prefill-chunk-size", 32]


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return tmp_path_factory.mktemp("serve-vision-logs")


@pytest.fixture(scope="module", params=ARCHS)
def served(request, tmp_path_factory, logs):
    """(checkpoint, an image file, a server with a bounded cache) per VL architecture."""
    import numpy as np
    from PIL import Image

    path = tmp_path_factory.mktemp(request.param.replace(":", "-"))
    build(request.param, path)
    image = path.parent / f"{path.name}.png"
    h, w = IMAGE_SIZES[0]
    Image.fromarray(np.random.default_rng(2).integers(0, 256, (h, w, 3), np.uint8)).save(image)
    server = Server(["--model", path, *BOUNDED], logs)
    yield path, image, server
    server.close()


def image_message(image_path, text: str, url: str | None = None) -> dict:
    data = base64.b64encode(image_path.read_bytes()).decode()
    part = {"type": "image_url", "image_url": {"url": url or f"data:image/png;base64,{data}"}}
    return {"role": "user", "content": [part, {"type": "text", "text": text}]}


def test_crash_scenario_421_with_an_image_before_the_trims(served):
    _, image, server = served
    with server.client() as c:
        body = {"messages": [image_message(image, LONG)], "max_tokens": 24, "ignore_eos": True}
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        assert usage["prompt_tokens"] > 4 * 64 and usage["completion_tokens"] == 24
        assert (
            c.post(
                "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": SHORT}], "max_tokens": 4},
            ).status_code
            == 200
        )
    h = server.wait_idle()
    assert h["requests"]["failed"] == 0 and h["pool"]["bytes"] == 0


def test_greedy_matches_mlxc_generate_with_an_image(served):
    path, image, server = served
    want, n = mlxc_generate(path, LONG, "--image", image, "--max-tokens", 12, *BOUNDED)
    with server.client() as c:
        r = c.post(
            "/v1/chat/completions",
            json={"messages": [image_message(image, LONG)], "max_tokens": 12},
        )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == want
    assert r.json()["usage"]["completion_tokens"] == n


def test_concurrent_image_requests_decode_batched_as_alone(served):
    """Two image chats of different lengths (one trimmed, past any sliding window) and a text
    chat at once: they decode as rows of one batch (32 tokens: the short ones still decode
    while the long one prefills), each answer the one it gets alone."""
    import concurrent.futures

    _, image, server = served
    messages = [[image_message(image, LONG)], [{"role": "user", "content": SHORT}]]
    messages.append([image_message(image, " ".join(LONG.split()[:12]))])

    def chat(c, m):
        body = {"messages": m, "max_tokens": 32, "ignore_eos": True}
        return c.post("/v1/chat/completions", json=body)

    with server.client() as c:
        alone = [chat(c, m).json()["choices"][0]["message"]["content"] for m in messages]
        with concurrent.futures.ThreadPoolExecutor(len(messages)) as pool:
            together = list(pool.map(lambda m: chat(c, m), messages))
    for want, r in zip(alone, together):
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == want
    health = server.wait_idle()
    assert health["requests"]["failed"] == 0 and health["pool"]["peak_batched"] >= 2


@pytest.mark.parametrize(
    "url, words",
    [
        ("https://example.com/cat.png", "not fetched"),
        ("data:image/png;base64,###", "not valid base64"),
        ("data:image/png;base64," + base64.b64encode(b"not an image").decode(), "cannot be used"),
    ],
)
def test_bad_images_get_400_and_the_server_keeps_serving(served, url, words):
    _, image, server = served
    with server.client() as c:
        r = c.post(
            "/v1/chat/completions",
            json={"messages": [image_message(image, "hi", url=url)], "max_tokens": 2},
        )
        assert r.status_code == 400, r.text
        assert words in r.json()["error"]["message"]
        good = c.post(
            "/v1/chat/completions",
            json={"messages": [image_message(image, SHORT)], "max_tokens": 2},
        )
        assert good.status_code == 200, good.text


def test_image_count_and_pixels_are_bounded_before_decoding(served):
    """More images than --max-images-per-request, or headers whose pixels exceed
    --max-request-pixels (12 PNG headers of 9000x9000: 4.8 GB and 60 s of decoding before),
    are refused from the request and the headers alone; the server keeps serving."""
    from test_processor import png_header_only

    _, image, server = served
    small = base64.b64encode(image.read_bytes()).decode()
    huge = base64.b64encode(png_header_only(9000, 9000)).decode()

    def parts(data: str, n: int) -> list[dict]:
        url = f"data:image/png;base64,{data}"
        return [{"type": "image_url", "image_url": {"url": url}}] * n

    with server.client() as c:
        for content, words in (
            (parts(small, 9), "at most 8 per request (--max-images-per-request)"),
            (parts(huge, 2), "162000000 pixels; this server takes at most 67108864"),
        ):
            r = c.post(
                "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": content}], "max_tokens": 2},
            )
            assert r.status_code == 400, r.text
            assert words in r.json()["error"]["message"]
        good = c.post(
            "/v1/chat/completions",
            json={"messages": [image_message(image, SHORT)], "max_tokens": 2},
        )
        assert good.status_code == 200, good.text


def test_qwen2_5_vl_3b_templates_through_the_server(tmp_path_factory, logs):
    """Qwen2.5-VL-3B-Instruct's own files: the text-only template in tokenizer_config.json and
    the VL one in chat_template.json. The server renders chats (with an image or without) with
    the processor's; before, every image chat was a 500 (TypeError in the text template). With
    only the text template left, an image chat is a 400 that names the template."""
    from test_generate_images import make_qwen2_5_vl_3b

    path, image = make_qwen2_5_vl_3b(tmp_path_factory.mktemp("qwen2_5_vl-3b-files"))
    bare = path.parent / f"{path.name}-no-processor-template"
    bare.mkdir()
    for f in path.iterdir():
        if f.name != "chat_template.json":
            (bare / f.name).write_bytes(f.read_bytes())
    for model, status, words in (
        (path, 200, None),
        (bare, 400, "the chat template from tokenizer_config.json failed"),
    ):
        server = Server(["--model", model], logs)
        try:
            with server.client() as c:
                body = {"messages": [image_message(image, "describe")], "max_tokens": 2}
                r = c.post("/v1/chat/completions", json=body)
                assert r.status_code == status, r.text
                if words:
                    assert words in r.json()["error"]["message"]
                text = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
                assert c.post("/v1/chat/completions", json=text).status_code == 200
        finally:
            server.close()


@pytest.mark.parametrize("arch", ["qwen2_vl", "gemma3"])
def test_the_warm_up_runs_the_vision_tower(tmp_path, monkeypatch, arch):
    """On CUDA a VL server's throwaway requests include one with an image (the engine makes
    it through its processor), so the tower's kernels compile before the first real image.
    CUDA is stood in for (``available`` says yes, the attention kernel's own warm-up is
    skipped); the warm-up runs as it would. It leaves no trace, and an image chat afterwards
    answers as on a server that did not warm up."""
    from PIL import Image

    from mlxc.runtime.model import cuda_attention
    from mlxc.runtime.serving.admission import Delta, SamplingParams
    from mlxc.runtime.serving.engine import Engine
    from mlxc.runtime.serving.scheduler import Scheduler

    build(arch, tmp_path / arch)
    monkeypatch.setattr(cuda_attention, "available", lambda: True)
    monkeypatch.setattr(cuda_attention, "warm", lambda *args, **kwargs: None)
    towers = []  # image batches the vision tower saw while warming up
    real = Scheduler._warm_serving

    def counting(self):
        vlm = self.model.model  # the generated VisionLanguageModel
        features = vlm.image_features

        def image_features(*args, **kwargs):
            towers.append(args[0].shape)
            return features(*args, **kwargs)

        object.__setattr__(vlm, "image_features", image_features)
        try:
            real(self)
        finally:
            del vars(vlm)["image_features"]

    monkeypatch.setattr(Scheduler, "_warm_serving", counting)
    image = Image.fromarray(np.random.default_rng(3).integers(0, 256, (40, 56, 3), np.uint8))
    content = [{"type": "image"}, {"type": "text", "text": "What is this?"}]
    answers = []
    for warm in (True, False):
        engine = Engine.from_path(tmp_path / arch, warm_up=warm, max_concurrency=4)
        try:
            stats = engine.scheduler.stats()
            assert stats["running"] == 0 and not any(stats["requests"].values())
            assert len(engine.scheduler.pool) == 0
            prompt = engine.encode_chat_with_images([{"role": "user", "content": content}], [image])
            tokens, done = [], threading.Event()

            def emit(event, tokens=tokens, done=done):
                if isinstance(event, Delta):
                    tokens.append(event.token)
                else:
                    done.set()

            params = SamplingParams(max_tokens=8, ignore_eos=True)
            engine.scheduler.submit(prompt.ids, params, emit, model_inputs=prompt.vision)
            assert done.wait(120)
            answers.append(tokens)
        finally:
            engine.stop()
        assert len(towers) == 1  # the first engine warmed up, the second did not
    assert answers[0] == answers[1] and len(answers[0]) == 8
