"""MRoPE (runtime/model/mrope.py) against transformers 5: get_rope_index, decode positions, rotation."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import torch
from test_qwen_vision import CONFIGS, build

from mlxc.runtime.model import mrope

IMAGE, VIDEO, START, END = 120, 121, 122, 123  # token ids set by build()
MERGE = 2


class _Prompt:
    """A prompt assembled piece by piece: text runs, images and videos with their grids."""

    def __init__(self, rng):
        self.rng, self.ids, self.images, self.videos = rng, [], [], []

    def text(self, n):
        self.ids += self.rng.integers(3, 100, n).tolist()
        return self

    def image(self, t, h, w):
        self.images.append((t, h, w))
        self.ids += [START] + [IMAGE] * (t * h * w // MERGE**2) + [END]
        return self

    def video(self, t, h, w, per_frame=False):
        self.videos.append((t, h, w))
        if not per_frame:
            self.ids += [START] + [VIDEO] * (t * h * w // MERGE**2) + [END]
            return self
        for _ in range(t):  # qwen3: "<timestamp> <vision_start> frame <vision_end>" per frame
            self.text(2)
            self.ids += [START] + [VIDEO] * (h * w // MERGE**2) + [END]
        return self


def _batch(prompts):
    """[B, L] ids of prompts of one length, plus all grids in batch order (None when empty)."""
    ids = np.array([p.ids for p in prompts], np.int64)
    images = [g for p in prompts for g in p.images] or None
    videos = [g for p in prompts for g in p.videos] or None
    return ids, images, videos


def _cases(model_type):
    rng = np.random.default_rng(7)
    qwen3 = model_type == "qwen3_vl"
    P = lambda: _Prompt(rng)
    return {
        "text_only": [P().text(9)],
        "one_image": [P().text(3).image(1, 6, 8).text(4)],
        "two_images": [P().text(2).image(1, 6, 8).text(3).image(1, 12, 4).text(2)],
        "batch": [  # two prompts of 18 tokens
            P().text(2).image(1, 6, 8).text(2),
            P().text(5).image(1, 4, 4).text(7),
        ],
        "batch_text_and_image": [P().text(18), P().text(1).image(1, 6, 8).text(3)],
        # a long video (temporal row outgrows h, w) then text; and an image after a video
        "video": [P().text(2).video(4, 4, 6, per_frame=qwen3).text(3)],
        "video_then_image": [P().text(1).video(2, 4, 4, per_frame=qwen3).text(2).image(1, 6, 8)],
        # ends in video tokens: qwen2.5's rope delta then comes from the temporal row
        "video_last": [P().text(2).video(4, 4, 6, per_frame=qwen3)],
    }


def _index_kwargs(model, model_type):
    vision = model.config.vision_config
    return {
        "spatial_merge_size": vision.spatial_merge_size,
        "image_token_id": model.config.image_token_id,
        "video_token_id": model.config.video_token_id,
        "vision_start_token_id": model.config.vision_start_token_id,
        "tokens_per_second": vision.tokens_per_second if model_type == "qwen2_5_vl" else None,
        "frames_as_images": model_type == "qwen3_vl",
    }


def _ours(model, model_type, ids, images, videos, seconds=None):
    return mrope.rope_index(
        ids, images, videos, second_per_grid_ts=seconds, **_index_kwargs(model, model_type)
    )


def _theirs(model, model_type, ids, images, videos, seconds=None):
    t = lambda a: None if a is None else torch.tensor(np.asarray(a))
    extra = {"second_per_grid_ts": t(seconds)} if model_type == "qwen2_5_vl" else {}
    types = np.where(ids == IMAGE, 1, np.where(ids == VIDEO, 2, 0))
    pos, deltas = model.model.get_rope_index(
        input_ids=t(ids),
        mm_token_type_ids=t(types),
        image_grid_thw=t(images),
        video_grid_thw=t(videos),
        **extra,
    )
    return pos.numpy(), deltas.numpy().reshape(-1)


@pytest.fixture(scope="module", params=list(CONFIGS))
def model_type_and_model(request):
    return request.param, build(request.param)


@pytest.mark.parametrize(
    "case",
    [
        "text_only",
        "one_image",
        "two_images",
        "batch",
        "batch_text_and_image",
        "video",
        "video_then_image",
        "video_last",
    ],
)
def test_rope_index_matches_transformers(model_type_and_model, case):
    model_type, model = model_type_and_model
    ids, images, videos = _batch(_cases(model_type)[case])
    seconds = [0.5] if videos and model_type == "qwen2_5_vl" else None
    ours = _ours(model, model_type, ids, images, videos, seconds)
    theirs = _theirs(model, model_type, ids, images, videos, seconds)
    np.testing.assert_array_equal(ours[0], theirs[0])
    np.testing.assert_array_equal(ours[1], theirs[1])
    assert ours[0].shape == (3,) + ids.shape and ours[1].shape == (ids.shape[0],)


def test_qwen25_video_timing_default_seconds():
    model = build("qwen2_5_vl")
    ids, images, videos = _batch([_Prompt(np.random.default_rng(0)).text(2).video(3, 4, 4).text(1)])
    ours = _ours(model, "qwen2_5_vl", ids, images, videos)
    np.testing.assert_array_equal(ours[0], _theirs(model, "qwen2_5_vl", ids, images, videos)[0])
    # tokens_per_second (4) x 1 s per temporal patch: frames at p, p+4, p+8
    assert sorted(set(ours[0][0, 0, 3:15].tolist())) == [3, 7, 11]


def test_rope_index_back_to_back_images_and_errors():
    """Extension: two images with no token between them still take one grid each (transformers
    5 groups the run as one image and fails); placeholder/grid mismatches raise."""
    kw = {"spatial_merge_size": 2, "image_token_id": IMAGE, "video_token_id": VIDEO}
    ids = np.array([[5] + [IMAGE] * 4 + [IMAGE] * 2 + [6]])
    pos, deltas = mrope.rope_index(ids, [(1, 4, 4), (1, 2, 4)], **kw)
    np.testing.assert_array_equal(
        pos[:, 0], [[0, 1, 1, 1, 1, 3, 3, 5], [0, 1, 1, 2, 2, 3, 3, 5], [0, 1, 2, 1, 2, 3, 4, 5]]
    )
    assert deltas.tolist() == [6 - 8]  # max 5, plus 1, minus 8 tokens
    with pytest.raises(ValueError):
        mrope.rope_index(ids, [(1, 4, 4), (1, 4, 4)], **kw)  # 8 tokens wanted, 6 present
    with pytest.raises(ValueError):
        mrope.rope_index(ids, [(1, 4, 4)], **kw)  # too few grids


class _Cache:
    def __init__(self, n):
        self.n = n

    def get_seq_length(self, *args):
        return self.n


def _text_positions(start, deltas, L):
    """``[3, B, L]``: ``start + i + delta`` on all three rows, as a numpy array."""
    pos = start + np.arange(L)[None, :] + np.asarray(deltas).reshape(-1, 1)
    return np.broadcast_to(pos, (3, *pos.shape)).copy()


@pytest.mark.parametrize("batched", [False, True])
def test_decode_positions_match_transformers(model_type_and_model, batched):
    """The token after the prompt: ``PromptPositions`` against transformers' decode branch
    (cache filled, rope_deltas set)."""
    model_type, model = model_type_and_model
    cases = _cases(model_type)
    prompts = cases["batch"] if batched else cases["two_images"]
    ids, images, videos = _batch(prompts)
    base, deltas = _ours(model, model_type, ids, images, videos)
    B, L = ids.shape
    hidden = model.config.text_config.hidden_size

    model.model.rope_deltas = torch.tensor(deltas).reshape(B, 1)
    theirs = model.model.compute_3d_position_ids(
        input_ids=torch.zeros(B, 1, dtype=torch.long),
        inputs_embeds=torch.zeros(B, 1, hidden),
        attention_mask=None,
        cache=_Cache(L),
        image_grid_thw=None,
        video_grid_thw=None,
    )[..., -1:].numpy()
    state = mrope.PromptPositions(**_index_kwargs(model, model_type))
    state.add_images(images)
    np.testing.assert_array_equal(state(ids, 0), base)  # the prompt, in one chunk
    ours = state(np.zeros((B, 1), ids.dtype), L)
    assert isinstance(ours, mrope.TextPositions)
    np.testing.assert_array_equal(np.array(ours.ids()), theirs)
    # and the continuation follows the prompt's largest position on each row
    assert (np.array(ours.start) == base.max(axis=(0, 2)) + 1).all()


def test_prompt_positions_in_chunks_slice_the_whole_prompts():
    """A prompt in chunks whose boundaries fall inside images: each chunk's positions are the
    whole prompt's, sliced; then text at ``offset + delta``; a text-only sequence at its
    offsets."""
    model = build("qwen2_vl")
    ids, images, videos = _batch(_cases("qwen2_vl")["two_images"])
    base, deltas = _ours(model, "qwen2_vl", ids, images, videos)
    L = ids.shape[1]
    image = np.flatnonzero(ids[0] == _index_kwargs(model, "qwen2_vl")["image_token_id"])
    cut = int(image[-4])  # inside the last image (5 is inside the first)
    assert image[0] < 5 < image[-1] and cut - 1 in image
    state = mrope.PromptPositions(**_index_kwargs(model, "qwen2_vl"))
    state.add_images(images)
    for start, end in [(0, 5), (5, cut), (cut, L)]:
        np.testing.assert_array_equal(state(ids[:, start:end], start), base[..., start:end])
    after = state(np.zeros((1, 3), ids.dtype), L)
    np.testing.assert_array_equal(np.array(after.ids()), _text_positions(L, deltas, 3))
    assert after.start.item() == base.max() + 1
    text_only = mrope.PromptPositions(**_index_kwargs(model, "qwen2_vl"))(np.zeros((2, 3)), 4)
    np.testing.assert_array_equal(np.array(text_only.ids()), _text_positions(4, [0, 0], 3))


def _turned_by_transformers(model_type, model, pos, seed):
    """Random q [B, 4, L, D] and k [B, 2, L, D], transformers' MRoPE of them at ``pos``, its
    cos/sin tables, and the rotation's settings as ``mrope`` takes them."""
    import importlib

    modeling = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    text = model.config.text_config
    rope = text.rope_parameters
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    _, B, L = pos.shape
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, 4, L, head_dim)).astype(np.float32)
    k = rng.standard_normal((B, 2, L, head_dim)).astype(np.float32)
    with torch.no_grad():
        cos, sin = model.model.language_model.rotary_emb(torch.from_numpy(q), torch.from_numpy(pos))
        q_ref, k_ref = modeling.apply_rotary_pos_emb(
            torch.from_numpy(q), torch.from_numpy(k), cos, sin
        )
    kwargs = {
        "theta": rope["rope_theta"],
        "mrope_section": rope["mrope_section"],
        "interleaved": model_type == "qwen3_vl",
    }
    return q, k, q_ref.numpy(), k_ref.numpy(), (cos.numpy(), sin.numpy()), kwargs


@pytest.mark.parametrize("offset", [0, 3000])
def test_rotation_matches_transformers(model_type_and_model, offset):
    model_type, model = model_type_and_model
    ids, images, videos = _batch(_cases(model_type)["batch"])
    pos, _ = _ours(model, model_type, ids, images, videos)
    pos = pos + offset  # absolute positions deep into a sequence
    q, k, q_ref, k_ref, (cos, sin), kwargs = _turned_by_transformers(model_type, model, pos, 3)
    head_dim = q.shape[-1]

    our_cos, our_sin = mrope.cos_sin(pos, head_dim, **kwargs)
    np.testing.assert_allclose(np.array(our_cos), cos, atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.array(our_sin), sin, atol=1e-5, rtol=0)
    q_out, k_out = mrope.apply(mx.array(q), mx.array(k), pos, **kwargs)
    np.testing.assert_allclose(np.array(q_out), q_ref, atol=1e-4, rtol=0)
    np.testing.assert_allclose(np.array(k_out), k_ref, atol=1e-4, rtol=0)
    # the three rows really differ here, so a wrong section layout cannot pass
    other = mrope.apply(
        mx.array(q), mx.array(k), pos, **{**kwargs, "interleaved": not kwargs["interleaved"]}
    )
    assert np.abs(np.array(other[0]) - q_ref).max() > 1e-2


@pytest.mark.parametrize("offset", [0, 3000])
def test_text_after_the_images_turns_as_transformers(model_type_and_model, offset, monkeypatch):
    """Tokens after every image (decode, a verification of 3): on a GPU ``rotation`` gives
    plain RoPE from each row's start, on the CPU the tables; both must turn q and k as
    transformers' MRoPE at those positions."""
    model_type, model = model_type_and_model
    ids, images, videos = _batch(_cases(model_type)["batch"])
    _, deltas = _ours(model, model_type, ids, images, videos)
    assert len(set(deltas.tolist())) > 1  # rows whose starts differ
    L = 3
    pos = _text_positions(ids.shape[1] + offset, deltas, L)
    q, k, q_ref, k_ref, _, kwargs = _turned_by_transformers(model_type, model, pos, 5)
    head_dim = q.shape[-1]

    text = mrope.TextPositions(mx.array(pos[0, :, 0], mx.int32), L)
    np.testing.assert_array_equal(np.array(text.ids()), pos)
    on_cpu = mrope.rotation(text, head_dim, dtype=mx.float32, **kwargs)
    assert len(on_cpu) == 2  # the tables
    with monkeypatch.context() as m:
        m.setattr(mx, "default_device", lambda: mx.gpu)
        on_gpu = mrope.rotation(text, head_dim, dtype=mx.float32, **kwargs)
    assert len(on_gpu) == 1 and on_gpu[0] is text.start  # plain RoPE from each row's start
    # Deep in a sequence a float32 angle (position x frequency) is off the exact one by up to
    # ~2e-4 at position 3,000 (both sides, measured against float64), in other frequencies' last
    # bits on each side (MLX's kernel makes its own frequencies): twice that bound there.
    for rotation, atol in [(on_cpu, 1e-4), (on_gpu, 1e-4 if offset == 0 else 5e-4)]:
        q_out, k_out = mrope.turn(mx.array(q), mx.array(k), *rotation, theta=kwargs["theta"])
        np.testing.assert_allclose(np.array(q_out), q_ref, atol=atol, rtol=0)
        np.testing.assert_allclose(np.array(k_out), k_ref, atol=atol, rtol=0)


def test_prompt_positions_turn_to_text_once_the_images_are_seen(model_type_and_model):
    model_type, model = model_type_and_model
    ids, images, videos = _batch(_cases(model_type)["two_images"])
    base, deltas = _ours(model, model_type, ids, images, videos)
    state = mrope.PromptPositions(**_index_kwargs(model, model_type))
    state.add_images(images)
    L = ids.shape[1]
    np.testing.assert_array_equal(state(ids, 0), base)  # the prompt: every row its own
    after = state(np.zeros((1, 2), ids.dtype), L)
    assert isinstance(after, mrope.TextPositions)
    np.testing.assert_array_equal(np.array(after.start), L + deltas)


def test_bad_section_is_refused():
    with pytest.raises(ValueError):
        mrope.cos_sin(
            np.zeros((3, 1, 2)), 16, theta=1e4, mrope_section=[2, 2, 2], interleaved=False
        )
