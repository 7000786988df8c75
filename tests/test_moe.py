"""runtime/model/moe.py against transformers' own MoE blocks on re-randomised float32 weights."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx import nn

from mlxc.runtime.model import cuda_attention, dequantized
from mlxc.runtime.model.moe import COMPILED_TOKENS, Experts, MoE, convert_expert_weights, route

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

H, I, E, K = 32, 24, 8, 2  # H != I and H != 2I: every fused layout is unambiguous
ATOL = 1e-4


def randomize(module, seed: int, std: float = 0.3) -> None:
    """Overwrite every parameter and buffer: transformers' near-zero init hides bugs."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in module.state_dict().values():
            if t.is_floating_point():
                t.copy_(torch.randn(t.shape, generator=g) * std)


def to_mx(state_dict, prefix: str = "") -> dict[str, mx.array]:
    return {prefix + k: mx.array(v.detach().float().numpy()) for k, v in state_dict.items()}


def load_block(moe: MoE, weights: dict[str, mx.array], prefix: str = "mlp.") -> MoE:
    """Strictly load converted ``prefix*`` weights into ``moe`` (as a model's loader would)."""
    conv = convert_expert_weights(weights, hidden=H, intermediate=I, num_experts=E)
    moe.load_weights([(k[len(prefix) :], v) for k, v in conv.items()], strict=True)
    return moe


def _input(shape, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def assert_grouping_matters(moe: MoE, shape=(2, 7, H)) -> None:
    """Group-limited routing picks other experts than plain top-k for some of these tokens."""
    logits = moe.gate(mx.array(_input(shape)).reshape(-1, H))
    bias = moe.gate.e_score_correction_bias if moe.scoring == "sigmoid" else None
    common = {"scoring": moe.scoring, "bias": bias}
    grouped, _ = route(
        logits,
        K,
        n_group=moe.n_group,
        topk_group=moe.topk_group,
        group_score=moe.group_score,
        **common,
    )
    plain, _ = route(logits, K, **common)
    assert (mx.sort(grouped, -1) != mx.sort(plain, -1)).any().item()


def compare(block, moe: MoE, shape=(2, 7, H), seed: int = 0) -> None:
    x = _input(shape, seed)
    with torch.no_grad():
        want = block(torch.from_numpy(x)).numpy()
    got = np.array(moe(mx.array(x)))
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)
    assert np.abs(want).mean() > 0.1  # the comparison is not between two near-zero tensors


@pytest.mark.parametrize("hub_layout", [False, True], ids=["tf5-[E,2I,H]", "hub-[E,H,2I]"])
def test_qwen3_vl_moe_block(hub_layout):
    from transformers.models.qwen3_vl_moe.configuration_qwen3_vl_moe import Qwen3VLMoeTextConfig
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import (
        Qwen3VLMoeTextSparseMoeBlock,
    )

    cfg = Qwen3VLMoeTextConfig(
        hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=K
    )
    block = Qwen3VLMoeTextSparseMoeBlock(cfg).eval()
    randomize(block, 1)
    w = to_mx(block.state_dict(), "mlp.")
    assert w["mlp.experts.gate_up_proj"].shape == (E, 2 * I, H)
    if hub_layout:  # as the hub checkpoints store it (transformers transposes on load)
        for k in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):
            w[k] = w[k].swapaxes(1, 2)
    # transformers always renormalises the top-k for qwen3_vl_moe
    moe = load_block(MoE(H, I, E, K, norm_topk_prob=True), w)
    compare(block, moe)


@pytest.mark.parametrize(
    "groups,tokens",
    [((1, 1), (2, 7)), ((4, 1), (2, 7)), ((4, 1), (2, 40))],
    ids=["plain", "grouped", "grouped-sorted"],
)
def test_mistral4_moe(groups, tokens):
    from transformers import Mistral4Config
    from transformers.models.mistral4.modeling_mistral4 import Mistral4MoE

    n_group, topk_group = groups
    cfg = Mistral4Config(
        hidden_size=H,
        moe_intermediate_size=I,
        n_routed_experts=E,
        num_experts_per_tok=K,
        n_shared_experts=2,
        n_group=n_group,
        topk_group=topk_group,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
    )
    block = Mistral4MoE(cfg).eval()
    randomize(block, 2)
    moe = MoE(
        H,
        I,
        E,
        K,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        n_group=n_group,
        topk_group=topk_group,
        group_score="top2",
        shared_hidden=2 * I,
    )
    load_block(moe, to_mx(block.state_dict(), "mlp."))
    if n_group > 1:
        assert_grouping_matters(moe, (*tokens, H))
    compare(block, moe, (*tokens, H))


@pytest.mark.parametrize("topk_method", ["greedy", "group_limited_greedy"])
def test_deepseek_v2_moe(topk_method):
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe

    cfg = DeepseekV2Config(
        hidden_size=H,
        moe_intermediate_size=I,
        n_routed_experts=E,
        num_experts_per_tok=K,
        n_shared_experts=1,
        topk_method=topk_method,
        n_group=4,
        topk_group=1,  # with K=2 and max-scored groups, keeping 2 groups never changes the pick
        routed_scaling_factor=1.7,
    )
    block = DeepseekV2Moe(cfg).eval()
    randomize(block, 3)
    grouped = topk_method == "group_limited_greedy"
    moe = MoE(
        H,
        I,
        E,
        K,
        norm_topk_prob=False,  # transformers' DeepseekV2 router never renormalises
        routed_scaling_factor=1.7,
        n_group=4 if grouped else 1,
        topk_group=1,
        group_score="max",
        shared_hidden=I,
    )
    load_block(moe, to_mx(block.state_dict(), "mlp."))
    if grouped:
        assert_grouping_matters(moe)
    compare(block, moe)


def test_deepseek_v2_saved_checkpoint(tmp_path):
    """The per-expert tensors transformers 5 writes, read back through the conversion."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    cfg = DeepseekV2Config(
        vocab_size=64,
        hidden_size=H,
        intermediate_size=48,
        moe_intermediate_size=I,
        num_hidden_layers=2,
        num_attention_heads=2,
        n_routed_experts=E,
        num_experts_per_tok=K,
        n_shared_experts=1,
        kv_lora_rank=8,
        q_lora_rank=None,
        qk_rope_head_dim=4,
        qk_nope_head_dim=4,
        v_head_dim=4,
        first_k_dense_replace=1,
    )
    model = DeepseekV2ForCausalLM(cfg).eval()
    randomize(model, 4)
    model.save_pretrained(tmp_path)
    saved = mx.load(str(tmp_path / "model.safetensors"))
    assert "model.layers.1.mlp.experts.3.gate_proj.weight" in saved  # per-expert on disk
    prefix = "model.layers.1.mlp."
    mlp = {k: v for k, v in saved.items() if k.startswith(prefix)}
    moe = load_block(MoE(H, I, E, K, shared_hidden=I), mlp, prefix)
    compare(model.model.layers[1].mlp, moe)


@pytest.mark.parametrize("cls_name", ["DeepseekV3", "Glm4MoeLite"])
def test_sigmoid_router_moe(cls_name):
    import importlib

    mod_name = {"DeepseekV3": "deepseek_v3", "Glm4MoeLite": "glm4_moe_lite"}[cls_name]
    module = importlib.import_module(f"transformers.models.{mod_name}.modeling_{mod_name}")
    cfg = getattr(transformers, f"{cls_name}Config")(
        hidden_size=H,
        moe_intermediate_size=I,
        n_routed_experts=E,
        num_experts_per_tok=K,
        n_shared_experts=1,
        n_group=4,
        topk_group=2,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
    )
    block = getattr(module, f"{cls_name}MoE")(cfg).eval()
    randomize(block, 5)  # includes the e_score_correction_bias buffer
    moe = MoE(
        H,
        I,
        E,
        K,
        scoring="sigmoid",
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        n_group=4,
        topk_group=2,
        shared_hidden=I,
    )
    load_block(moe, to_mx(block.state_dict(), "mlp."))
    assert_grouping_matters(moe)
    compare(block, moe)
    compare(block, moe, (9, 1, H))  # one token a row: the compiled step
    assert "_step" in moe.__dict__


def test_sigmoid_router_casts_its_weights_once():
    """The router scores in float32 from bf16 weights; the float32 copies are made once per
    loaded weight (a cast per step is two kernels a layer on a GPU), and weights loaded later
    are used, not the old copies."""
    from mlxc.runtime.model.moe import SigmoidRouter

    router = SigmoidRouter(H, E)
    mx.random.seed(3)
    w = (mx.random.normal((E, H)) * 0.5).astype(mx.bfloat16)
    bias = mx.random.normal((E,)).astype(mx.bfloat16)
    router.update({"weight": w, "e_score_correction_bias": bias})
    x = mx.random.normal((5, H)).astype(mx.bfloat16)
    want = x.astype(mx.float32) @ w.astype(mx.float32).T
    got = router(x)
    assert got.dtype == mx.float32 and mx.array_equal(got, want)
    first = router.float32()
    assert all(a is b for a, b in zip(first, router.float32()))  # no new cast
    assert mx.array_equal(first[1], bias.astype(mx.float32))
    router.update({"weight": w * 2})
    assert mx.array_equal(router(x), x.astype(mx.float32) @ (w * 2).astype(mx.float32).T)
    assert router.float32()[0] is not first[0]


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_a_few_tokens_a_row_take_the_block_compiled(scoring):
    """Inputs of up to ``COMPILED_TOKENS`` tokens a row (a decode step, a verification) take
    the block compiled (``MoE._compiled_step``), longer ones the block as written; the two
    agree to the bit, at every batch size and token count, and weights loaded after the step
    was traced are the ones it uses."""
    mx.random.seed(4)
    moe = MoE(H, I, E, K, scoring=scoring, n_group=4, topk_group=2, shared_hidden=I)
    params = nn.utils.tree_flatten(moe.parameters())
    moe.update(nn.utils.tree_unflatten([(k, mx.random.normal(v.shape) * 0.3) for k, v in params]))
    step, compiled = moe._compiled_step(), []
    moe.__dict__["_step"] = lambda x, *router: compiled.append(x.shape) or step(x, *router)

    def as_written(x):
        return moe._forward(x, *(moe.gate.float32() if scoring == "sigmoid" else ()))

    shapes = [(1, 1), (3, 1), (8, 1), (2, 4), (1, COMPILED_TOKENS), (1, COMPILED_TOKENS + 1)]
    for batch, tokens in shapes:
        x = mx.array(_input((batch, tokens, H), batch + tokens))
        assert mx.array_equal(moe(x), as_written(x))
    assert compiled == [(b, t, H) for b, t in shapes[:-1]]  # the longest ran as written
    x = mx.array(_input((2, 4, H), 9))
    got = moe(x)
    moe.update(
        nn.utils.tree_unflatten([(k, v * 2) for k, v in nn.utils.tree_flatten(moe.parameters())])
    )
    again = moe(x)
    assert not mx.allclose(again, got)
    assert mx.array_equal(again, as_written(x))


def test_qwen2_moe_shared_expert_gate():
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    cfg = Qwen2MoeConfig(
        hidden_size=H,
        moe_intermediate_size=I,
        shared_expert_intermediate_size=40,
        num_experts=E,
        num_experts_per_tok=K,
        norm_topk_prob=False,
    )
    block = Qwen2MoeSparseMoeBlock(cfg).eval()
    randomize(block, 6)
    moe = MoE(H, I, E, K, shared_hidden=40, shared_gate=True)
    compare(block, load_block(moe, to_mx(block.state_dict(), "mlp.")))


def _random_moe(seed: int, hidden: int = H, inter: int = I, **kw) -> MoE:
    mx.random.seed(seed)
    moe = MoE(hidden, inter, E, K, shared_hidden=inter, **kw)
    moe.update(nn.utils.tree_map(lambda p: mx.random.normal(p.shape) * 0.3, moe.parameters()))
    return moe


def test_sorted_and_unsorted_gather_agree():
    x = mx.random.normal((3, 50, H), key=mx.random.key(7))
    unsorted = _random_moe(8, sort_threshold=10**9)
    sorted_ = _random_moe(8, sort_threshold=0)
    a, b = unsorted(x), sorted_(x)
    np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-5, rtol=0)
    # a single decode token takes the unsorted path by default and matches too
    np.testing.assert_allclose(
        np.array(_random_moe(8)(x[:, -1:])), np.array(a[:, -1:]), atol=1e-5, rtol=0
    )


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("quantized", [False, True])
def test_the_three_expert_paths_agree(quantized, bias):
    """The gather matmuls unsorted (decode) and sorted by expert (a prefill on a GPU), and one
    plain matmul per expert's run of rows (a prefill on the CPU: ``by_expert``), with gate and
    up fused or not: the same numbers. Experts 3 and 7 are chosen by no token: runs skip them."""
    from mlxc.runtime.model.moe import ExpertLinear

    x = mx.random.normal((45, 64), key=mx.random.key(21))
    indices = mx.random.randint(0, E - 2, (45, K), key=mx.random.key(22))
    indices = (indices + (indices >= 3)).astype(mx.uint32)
    for fused in (False, True):
        mx.random.seed(20)
        experts = Experts(64, 32, E, bias=bias)
        experts.update(
            nn.utils.tree_map(lambda p: mx.random.normal(p.shape) * 0.3, experts.parameters())
        )
        if fused:  # layers.fuse's layout: gate and up stacked on the output axis
            gate, up = experts.gate_proj, experts.up_proj
            experts.gate_up_proj = ExpertLinear(64, 64, E, bias)
            experts.gate_up_proj.weight = mx.concatenate([gate.weight, up.weight], axis=1)
            if bias:
                experts.gate_up_proj.bias = mx.concatenate([gate.bias, up.bias], axis=1)
        if quantized:
            nn.quantize(experts, 32, 4, class_predicate=lambda _, m: hasattr(m, "to_quantized"))
        want = np.array(experts.gathered(x, indices, False))
        for got in (experts.gathered(x, indices, True), experts.by_expert(x, indices)):
            assert got.shape == (45, K, 64)
            np.testing.assert_allclose(np.array(got), want, atol=1e-4, rtol=1e-4)


def test_the_cpu_multiplies_by_expert_from_enough_rows_per_expert(monkeypatch):
    """On the CPU a block takes ``by_expert`` once the pairs reach ``BY_EXPERT_ROWS`` per expert
    (a prefill), and the gathers below that (decode steps and small batches, where one matmul
    per expert costs more than the rows it saves); the answer is the same either way."""
    from mlxc.runtime.model.moe import BY_EXPERT_ROWS

    assert mx.default_device() == mx.cpu  # the suite runs on the CPU
    moe = _random_moe(6)
    calls = []
    real = Experts.by_expert
    monkeypatch.setattr(
        Experts, "by_expert", lambda self, x, i: calls.append(i.size) or real(self, x, i)
    )
    few = BY_EXPERT_ROWS * E // K - 1  # tokens: one pair short
    x = mx.random.normal((1, few + 1, H), key=mx.random.key(9))
    a = moe(x[:, :few])
    assert calls == []
    b = moe(x)
    assert calls == [(few + 1) * K]
    np.testing.assert_allclose(np.array(b[:, :few]), np.array(a), atol=1e-5, rtol=0)


@pytest.mark.parametrize("quantized", [False, True])
def test_sorted_gather_leaves_row_indices_to_mlx(monkeypatch, quantized):
    """A gather matmul over rows sorted by expert passes no ``lhs_indices``: MLX takes its
    grouped-GEMM path (CUDA, Metal) only then (``GatherMM``'s ``right_sorted`` is
    ``sorted_indices and not lhs_indices``; with them the H200's bf16 MoE prefill ran ~3.5x
    slower). Unsorted (decode) calls pass the cached row indices."""
    moe = _random_moe(5, hidden=64, inter=32)  # sizes a 32-wide quantisation group divides
    if quantized:
        nn.quantize(
            moe, group_size=32, bits=4, class_predicate=lambda _, m: hasattr(m, "to_quantized")
        )
    name = "gather_qmm" if quantized else "gather_mm"
    real, calls = getattr(mx, name), []

    def spy(*args, **kw):
        calls.append((kw["sorted_indices"], kw["lhs_indices"] is None))
        return real(*args, **kw)

    monkeypatch.setattr(mx, name, spy)
    # the sorted gather as a GPU takes it (the CPU multiplies each expert's run instead)
    monkeypatch.setattr(Experts, "by_expert", lambda self, x, i: self.gathered(x, i, True))
    x = mx.random.normal((2, 40, 64), key=mx.random.key(4))
    for threshold in (0, 10**9):  # sorted, unsorted
        moe.experts.sort_threshold = threshold
        mx.eval(moe(x))
    assert {c[0] for c in calls} == {True, False}
    assert all(no_rows == is_sorted for is_sorted, no_rows in calls), calls


def _quantized_experts(seed: int, mode: str, bias: bool = False, hidden: int = 64) -> Experts:
    """Random experts (gate and up fused, as loading leaves them) quantised in ``mode``."""
    from mlxc.runtime.model.moe import ExpertLinear

    mx.random.seed(seed)
    experts = Experts(hidden, 32, E, bias=bias)
    experts.update(
        nn.utils.tree_map(lambda p: mx.random.normal(p.shape) * 0.3, experts.parameters())
    )
    gate, up = experts.gate_proj, experts.up_proj
    experts.gate_up_proj = ExpertLinear(hidden, 64, E, bias)
    experts.gate_up_proj.weight = mx.concatenate([gate.weight, up.weight], axis=1)
    if bias:
        experts.gate_up_proj.bias = mx.concatenate([gate.bias, up.bias], axis=1)
    nn.quantize(experts, 32, 4, mode=mode, class_predicate=lambda _, m: hasattr(m, "to_quantized"))
    return experts


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("mode", ["affine", "mxfp4"])
def test_cuda_prefill_dequantizes_quantized_experts(monkeypatch, mode, bias):
    """Where MLX's CUDA backend runs (faked on a CPU, which runs the same MLX calls), a gather
    sorted by expert with ``EXPERT_ROWS`` pairs per expert dequantises the experts and takes
    ``gather_mm``: the same numbers as ``gather_qmm``'s. Fewer pairs keep ``gather_qmm``; so
    does a CPU without CUDA."""
    from mlxc.runtime.model.dequantized import EXPERT_ROWS

    experts = _quantized_experts(30, mode, bias)
    tokens = EXPERT_ROWS * E // K  # exactly EXPERT_ROWS pairs per expert
    x = mx.random.normal((tokens, 64), key=mx.random.key(31))
    indices = mx.random.randint(0, E, (tokens, K), key=mx.random.key(32)).astype(mx.uint32)
    monkeypatch.setattr(dequantized, "EXPERT_ROWS", 10**9)  # gather_qmm, on CUDA too
    want = np.array(experts.gathered(x, indices, True))
    monkeypatch.setattr(dequantized, "EXPERT_ROWS", EXPERT_ROWS)
    quantized_calls = []
    real = mx.gather_qmm
    monkeypatch.setattr(
        mx, "gather_qmm", lambda *a, **kw: quantized_calls.append(1) or real(*a, **kw)
    )
    monkeypatch.setattr(cuda_attention, "available", lambda: True)
    got = np.array(experts.gathered(x, indices, True))
    assert quantized_calls == []  # both products (gate|up and down) dequantised
    # Both sides multiply the same dequantised values in float32; only the order of the sums
    # differs.
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
    assert np.abs(want).mean() > 0.1

    experts.gathered(x[:-1], indices[:-1], True)  # one token short of the rule
    assert len(quantized_calls) == 2


@pytest.mark.parametrize("mode", ["affine", "mxfp4"])
def test_cuda_prefill_copies_large_stacks_in_groups(monkeypatch, mode):
    """A stack whose copy would pass ``EXPERT_BYTES`` is dequantised in groups of experts (CUDA
    faked on the CPU, as above), each copy within it, the groups' rows found from the expert
    counts on the host: a group with fewer than ``EXPERT_ROWS`` pairs per expert keeps
    ``gather_qmm`` over its slice of the stack, one with no pairs is left out. The numbers are
    ``gather_qmm``'s for the whole gather, expert biases included; such a forward reads the
    host, so a MoE block does not compile it."""
    from mlxc.runtime.model import moe
    from mlxc.runtime.model.dequantized import EXPERT_ROWS

    experts = _quantized_experts(36, mode, bias=True)
    whole = dequantized.copy_bytes(experts.gate_up_proj["weight"].shape, 4, mx.float32)
    # Experts 0-2 get no pairs, 3-5 3 * EXPERT_ROWS each, 6-7 EXPERT_ROWS / 2 each: over the
    # whole stack, at least EXPERT_ROWS pairs per expert.
    chosen = [3, 4, 5] * 3 * EXPERT_ROWS + [6, 7] * (EXPERT_ROWS // 2)
    assert len(chosen) >= EXPERT_ROWS * E
    chosen = np.random.default_rng(37).permutation(chosen).reshape(-1, K)
    indices = mx.array(chosen.astype(np.uint32))
    x = mx.random.normal((len(chosen), 64), key=mx.random.key(38))
    monkeypatch.setattr(dequantized, "EXPERT_ROWS", 10**9)  # gather_qmm, on CUDA too
    want = np.array(experts.gathered(x, indices, True))
    monkeypatch.setattr(dequantized, "EXPERT_ROWS", EXPERT_ROWS)
    monkeypatch.setattr(cuda_attention, "available", lambda: True)
    monkeypatch.setattr(moe, "BY_EXPERT_ROWS", 10**9)  # no CPU by_expert: syncs is CUDA's
    assert experts.experts_per_copy(indices.size, mx.float32) == E  # the whole stack at once
    monkeypatch.setattr(dequantized, "EXPERT_BYTES", whole * 3 // E)  # 3 experts a copy

    copies, gathers = [], []  # gathers: (function, experts in its stack, indices)
    real_weight = dequantized.weight
    monkeypatch.setattr(
        dequantized, "weight", lambda *a, **kw: copies.append(real_weight(*a, **kw)) or copies[-1]
    )

    def spy(name: str):
        real = getattr(mx, name)

        def call(*a, **kw):
            gathers.append((name, a[1].shape[0], sorted(set(np.array(kw["rhs_indices"])))))
            return real(*a, **kw)

        return call

    for name in ("gather_qmm", "gather_mm"):
        monkeypatch.setattr(mx, name, spy(name))
    assert experts.experts_per_copy(indices.size, mx.float32) == 3
    assert experts.syncs(indices.size, mx.float32)
    assert not experts.syncs(EXPERT_ROWS * E - 1, mx.float32)  # one pair short of copying
    got = np.array(experts.gathered(x, indices, True))
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
    assert np.abs(want).mean() > 0.1
    # Experts 3-5 through a copy, 6-7 through gather_qmm, for gate|up then down; 0-2 nowhere.
    # Indices count from the group's first expert: on the CPU, MLX's gathers gave the same
    # numbers with indices not counted from it, so the numbers alone would not show it.
    assert [c.shape[0] for c in copies] == [3, 3]
    assert all(c.nbytes <= dequantized.EXPERT_BYTES for c in copies)
    group_calls = [("gather_mm", 3, [0, 1, 2]), ("gather_qmm", 2, [0, 1])]
    assert gathers == group_calls * 2


def test_a_copying_block_runs_uncompiled_and_admits_each_copy(monkeypatch):
    """A batch of one-token rows whose pairs reach ``EXPERT_ROWS`` per expert copies the experts
    (CUDA faked on the CPU): the block then skips its compiled step, since each copy's product
    goes through ``dequantized.admit``, which evaluates. The output is the compiled
    ``gather_qmm`` block's."""
    from mlxc.runtime.model import moe as moe_module
    from mlxc.runtime.model.dequantized import EXPERT_ROWS

    block = _random_moe(39, hidden=64, inter=32)
    nn.quantize(block, 32, 4, class_predicate=lambda _, m: hasattr(m, "to_quantized"))
    rows = EXPERT_ROWS * E // K
    x = mx.random.normal((rows, 1, 64), key=mx.random.key(40))
    monkeypatch.setattr(moe_module, "BY_EXPERT_ROWS", 10**9)  # not the CPU's by_expert
    monkeypatch.setattr(cuda_attention, "available", lambda: True)
    compiled, admitted = [], []
    real_step, real_admit = MoE._compiled_step, dequantized.admit
    monkeypatch.setattr(MoE, "_compiled_step", lambda self: compiled.append(1) or real_step(self))
    monkeypatch.setattr(dequantized, "admit", lambda p: admitted.append(p.shape) or real_admit(p))
    monkeypatch.setattr(dequantized, "EXPERT_ROWS", 10**9)  # no copy: compiled gather_qmm
    want = np.array(block(x))
    assert (len(compiled), admitted) == (1, [])
    monkeypatch.setattr(dequantized, "EXPERT_ROWS", EXPERT_ROWS)
    got = np.array(block(x))
    assert len(compiled) == 1  # not compiled this time
    # gate, up (not fused: loading fuses them), then down
    assert admitted == [(rows * K, 1, 32), (rows * K, 1, 32), (rows * K, 1, 64)]
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
    assert np.abs(want).mean() > 0.1


def _experts_in_numpy(experts: Experts, x: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """``experts(x, indices)`` in float64 from MLX's dequantised weights: gate|up (fused), SwiGLU,
    down, one token and expert at a time."""
    w = {
        name: np.array(dequantized.weight(experts[name], mx.float32)).astype(np.float64)
        for name in ("gate_up_proj", "down_proj")
    }
    out = np.zeros((*indices.shape, w["down_proj"].shape[1]))
    for t, chosen in enumerate(indices):
        for j, e in enumerate(chosen):
            gate, up = np.split(w["gate_up_proj"][e] @ x[t], 2)
            h = gate / (1 + np.exp(-gate)) * up
            out[t, j] = w["down_proj"][e] @ h
    return out


@pytest.mark.skipif(not cuda_attention.available(), reason="needs MLX's CUDA backend")
@pytest.mark.parametrize("mode", ["affine", "mxfp4"])
def test_cuda_dequantized_prefill_matches_gather_qmm(monkeypatch, mode):
    """On CUDA, in bf16: a prefill's sorted gather through the dequantised experts against the
    exact products of the same quantised weights (float64, numpy). The path rounds to bf16
    where it hands on a product (gate|up, then down: 2^-9 of each value), so it is a few bf16
    steps off; within 1% of the output's largest magnitude (a wrong expert or a transposed
    weight is off by its whole size). MLX's ``gather_qmm`` on the same rows is reported beside
    it (``EXPERT_ROWS`` set past them): on the CPU, in bf16, it was 2% off, the dequantised
    path 0.3%."""
    experts = _quantized_experts(33, mode, hidden=256)
    experts.set_dtype(mx.bfloat16)
    tokens = 64 * E // K  # 64 pairs per expert
    x = mx.random.normal((tokens, 256), key=mx.random.key(34)).astype(mx.bfloat16)
    indices = mx.random.randint(0, E, (tokens, K), key=mx.random.key(35)).astype(mx.uint32)
    assert experts.experts_per_copy(indices.size, mx.bfloat16) == E  # the whole stack
    got = experts.gathered(x, indices, True)
    monkeypatch.setattr(dequantized, "EXPERT_ROWS", 10**9)
    want = experts.gathered(x, indices, True)
    exact = _experts_in_numpy(experts, np.array(x.astype(mx.float32)), np.array(indices))
    got_err, want_err = (np.abs(np.array(a.astype(mx.float32)) - exact).max() for a in (got, want))
    scale = np.abs(exact).max()
    assert got_err <= 0.01 * scale, f"{got_err=} ({want_err=} through gather_qmm), {scale=}"


def test_half_precision_experts_keep_their_dtype():
    """bf16 experts run (MLX's CPU gather_mm is float32-only: widened there) and stay bf16."""
    x = mx.random.normal((2, 40, H), key=mx.random.key(3))
    moe = _random_moe(4)
    want = moe(x)
    moe.set_dtype(mx.bfloat16)
    for threshold in (10**9, 0):  # unsorted and sorted gathers
        moe.experts.sort_threshold = threshold
        got = moe(x.astype(mx.bfloat16))
        assert got.dtype == mx.bfloat16
        err = np.abs(np.array(got.astype(mx.float32)) - np.array(want)).max()
        assert err < 0.02 * np.abs(np.array(want)).max()  # bf16 rounding, not a wrong expert


def test_every_layout_converts_to_the_same_tensors():
    rng = np.random.default_rng(9)
    gate_up = rng.standard_normal((E, 2 * I, H)).astype(np.float32)
    down = rng.standard_normal((E, H, I)).astype(np.float32)
    p = "model.layers.3.mlp."
    layouts = {
        "fused-out-major": {p + "experts.gate_up_proj": gate_up, p + "experts.down_proj": down},
        "fused-in-major": {
            p + "experts.gate_up_proj": gate_up.transpose(0, 2, 1),
            p + "experts.down_proj": down.transpose(0, 2, 1),
        },
        "per-expert": {
            f"{p}experts.{e}.{name}.weight": w
            for e in range(E)
            for name, w in (
                ("gate_proj", gate_up[e, :I]),
                ("up_proj", gate_up[e, I:]),
                ("down_proj", down[e]),
            )
        },
        "mlx-lm": {
            p + "switch_mlp.gate_proj.weight": gate_up[:, :I],
            p + "switch_mlp.up_proj.weight": gate_up[:, I:],
            p + "switch_mlp.down_proj.weight": down,
        },
    }
    want = {
        p + "experts.gate_proj.weight": gate_up[:, :I],
        p + "experts.up_proj.weight": gate_up[:, I:],
        p + "experts.down_proj.weight": down,
    }
    for name, layout in layouts.items():
        other = {p + "gate.weight": mx.zeros((E, H)), "model.norm.weight": mx.ones((H,))}
        src = {**{k: mx.array(v) for k, v in layout.items()}, **other}
        got = convert_expert_weights(src, hidden=H, intermediate=I, num_experts=E)
        assert set(got) == set(want) | set(other), name
        for k, v in want.items():
            np.testing.assert_array_equal(np.array(got[k]), v, err_msg=f"{name}: {k}")


def test_conversion_errors():
    w = {f"mlp.experts.{e}.gate_proj.weight": mx.zeros((I, H)) for e in range(E - 1)}
    with pytest.raises(ValueError, match=r"experts \[7\] missing"):
        convert_expert_weights(w, hidden=H, intermediate=I, num_experts=E)
    with pytest.raises(ValueError, match="fits neither"):
        convert_expert_weights(
            {"mlp.experts.down_proj": mx.zeros((E, H, H))},
            hidden=H,
            intermediate=I,
            num_experts=E,
        )


def test_quantized_experts_match_their_dequantized_weights():
    """nn.quantize swaps in gather_qmm experts; same numbers as the dense dequantized block."""
    from mlx.utils import tree_flatten

    moe = _random_moe(10, hidden=64, inter=32)
    nn.quantize(moe, group_size=32, bits=8)
    assert "scales" in moe.experts.gate_proj and "scales" in moe.experts.down_proj
    params = dict(tree_flatten(moe.parameters()))
    dense = {}
    for k, w in params.items():
        if k.endswith(".scales"):
            base = k[: -len(".scales")]
            q = (params[base + ".weight"], w, params[base + ".biases"])
            dense[base + ".weight"] = mx.dequantize(*q, group_size=32, bits=8)
        elif not k.endswith((".weight", ".biases")) or k[:-7] + ".scales" not in params:
            dense.setdefault(k, w)
    ref = _random_moe(11, hidden=64, inter=32)
    ref.load_weights(list(dense.items()), strict=True)
    x = mx.random.normal((2, 40, 64), key=mx.random.key(12))
    np.testing.assert_allclose(np.array(moe(x)), np.array(ref(x)), atol=1e-4, rtol=0)


@pytest.mark.parametrize("bias", [False, True])
def test_a_decode_tokens_chosen_experts_split_over_the_cores(monkeypatch, bias):
    """On the CPU a few tokens' chosen quantised experts go out to one stream per core, each
    running the whole expert MLP for its share of the choices (``dequantized.split_choices``):
    bit for bit the one computation, inside the compiled block too."""
    experts = _quantized_experts(7, "affine", bias)
    x = mx.random.normal((3, 64), key=mx.random.key(8))
    indices = mx.array([[0, 5, 2, 7], [1, 1, 6, 3], [4, 0, 2, 5]])
    monkeypatch.setattr(dequantized, "cpu_streams", lambda: ())
    want = experts(x, indices)
    streams = tuple(mx.new_stream(mx.cpu) for _ in range(3))
    monkeypatch.setattr(dequantized, "cpu_streams", lambda: streams)
    real, calls = mx.gather_qmm, []
    monkeypatch.setattr(mx, "gather_qmm", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    got = experts(x, indices)
    assert len(calls) == 4  # k = 4 over 3 streams: two choices each, two linears
    assert [c["rhs_indices"].shape for c in calls] == [(3, 2)] * 4
    assert mx.array_equal(got, want).item()
    assert mx.array_equal(mx.compile(experts)(x, indices), want).item()
