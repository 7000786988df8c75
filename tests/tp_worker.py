"""Run by ``tests/test_tensor_parallel.py`` under ``mlx.launch -n 2``: for every spec, the
sharded model's logits against the unsharded model's, in one pair of processes.

Each rank builds the spec's model from its ``tiny_config`` with the same random weights
(``mlxc.verify.randomize``, deterministic), runs ``mlxc verify``'s schedule (chunked prefill,
a multi-token continuation, decode steps; untrimmed, then trimmed to a bounded cache with sink
tokens), shards the model in place and runs the schedule again. VL specs carry one image
through their (replicated) tower. Rank 0 prints one ``ok``/``FAIL`` line per case; the exit
status is 1 when any case fails (every rank computes the same logits, so both agree).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import mlxc  # noqa: F401 - first: it binds a fast BLAS before MLX loads (runtime/blas.py)

# isort: split
import mlx.core as mx
import numpy as np
from mlx import nn
from mlx.utils import tree_flatten

from mlxc import verify as V
from mlxc.compiler import build, lint
from mlxc.runtime.checkpoint.loading import load_model
from mlxc.runtime.checkpoint.user_specs import load_source
from mlxc.runtime.model import layers, parallel
from mlxc.runtime.serving.distributed import agree_on_seed, same_on_every_rank
from mlxc.runtime.serving.sample import make_sampler

ATOL = 1e-4  # float32: the ranks' partial sums are added in another order, ~1e-6 typical
SCHEDULES = ((None, 0), (V.MAX_KV, 4))  # untrimmed; trimmed to MAX_KV keeping 4 sinks


def schedule_logits(model, chunks, vision) -> list[mx.array]:
    out = []
    for max_kv, keep in SCHEDULES:
        logits, _, _ = V._run(model, chunks, max_kv, keep, vision)
        out += logits
    return out


def compare(
    module, config: dict, image_token: str | None, group, quantize: bool = False, fuse=False
):
    """Largest difference between the sharded and the unsharded model's logits; ``fuse``: the
    model's projections fused as loading fuses them (``layers.fuse``) before either run."""
    args = module.ModelArgs.from_config(config)
    model = module.Model(args)
    V.randomize(model)
    if quantize:
        nn.quantize(model, group_size=32, bits=8)
    if fuse and not fused(layers.fuse(model)):
        raise AssertionError("nothing fused")
    vocab = model(mx.array([[0]])).shape[-1]
    rng = np.random.default_rng(1)
    vision, image = None, None
    if image_token is not None:
        vision, count = V.vision_inputs(model.vision_tower, config, rng)
        image = (getattr(args, image_token), count)
    chunks = V._schedule(rng, vocab, image, model)
    whole = schedule_logits(model, chunks, vision)
    before = n_parameters(model)
    model.shard(group)
    if not n_parameters(model) < before:
        raise AssertionError("shard() split nothing")
    if fuse and not fused(model):
        raise AssertionError("shard() left the model unfused")
    unmarked = [
        n
        for n, m in model.named_modules()
        if "project" in dir(m) and "split_over" not in m.__dict__
    ]
    if unmarked:  # layers.step_compiled would compile a split layer on a GPU
        raise AssertionError(f"shard() left {unmarked[0]} unmarked")
    sharded = schedule_logits(model, chunks, vision)
    return max(mx.abs(a - b).max().item() for a, b in zip(whole, sharded))


def fused(model) -> bool:
    names = [k for k, _ in tree_flatten(model.parameters())]
    return any(".qkv_proj." in k for k in names) and any(".gate_up_proj." in k for k in names)


def n_parameters(model) -> int:
    return sum(p.size for _, p in tree_flatten(model.parameters()))


def expect_error(module, config: dict, names: str, quantize: bool = False) -> str:
    """The ShardError of a config whose sizes do not divide; it must name ``names``."""
    model = module.Model(module.ModelArgs.from_config(config))
    if quantize:
        nn.quantize(model, group_size=32, bits=8)
    try:
        model.shard(mx.distributed.init())
    except parallel.ShardError as e:
        if names not in str(e):
            raise AssertionError(f"the error does not name {names}: {e}") from None
        return str(e)
    raise AssertionError("no ShardError")


def sharded_load_peak(module, config: dict) -> str:
    """``load_model(group=...)`` cuts each tensor as it reads it: its peak memory stays under
    the unsharded model's bytes, and it holds what ``Model.shard`` leaves."""
    config = config | {"hidden_size": 256, "intermediate_size": 1024, "head_dim": 64}
    model = module.Model(module.ModelArgs.from_config(config))
    V.randomize(model)
    whole = sum(p.nbytes for _, p in tree_flatten(model.parameters()))
    group = mx.distributed.init()
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        mx.save_safetensors(
            str(Path(tmp) / "model.safetensors"), dict(tree_flatten(model.parameters()))
        )
        model.shard(group)
        share = sum(p.nbytes for _, p in tree_flatten(model.parameters()))
        del model
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        loaded = load_model(tmp, group=group)
        peak = mx.get_peak_memory() - base
    held = sum(p.nbytes for _, p in tree_flatten(loaded.parameters()))
    if held != share or not peak < whole:
        raise AssertionError(f"held {held} of {whole} bytes (shard {share}), peak {peak}")
    return f"peak {peak / 2**20:.1f} MiB loading {share / 2**20:.1f} of {whole / 2**20:.1f} MiB"


def sampling_agrees() -> str:
    """Unseeded samplers draw the same tokens on every rank once ``agree_on_seed`` ran, and
    ``same_on_every_rank`` tells when they did not."""
    group = mx.distributed.init()
    logits = mx.zeros((1, 1000))  # uniform: any two unrelated generators disagree at once
    sample = make_sampler(temp=1.0)

    def draw() -> list[int]:
        return [sample(logits).item() for _ in range(8)]

    agree_on_seed(group)
    if not same_on_every_rank(draw(), group):
        raise AssertionError("the ranks drew different tokens after agree_on_seed")
    mx.random.seed(group.rank())
    if same_on_every_rank(draw(), group):
        raise AssertionError("same_on_every_rank missed ranks that drew differently")
    return "agree_on_seed: the same draws; differently seeded ranks are caught"


def main() -> int:
    group = mx.distributed.init()
    if group.size() != 2:
        print(f"FAIL launch: expected 2 ranks, got {group.size()}")
        return 1
    paths = sys.argv[1:] or ["specs"]
    result = build.render(paths)
    failed = 0
    modules = {}

    def report(name: str, fn, *args) -> None:
        nonlocal failed
        try:
            line = f"ok   {name}: {fn(*args)}"
        except Exception as e:  # noqa: BLE001 - report every case
            failed += 1
            line = f"FAIL {name}: {type(e).__name__}: {e}"
        if group.rank() == 0:
            print(line, flush=True)

    def logits_case(module, config, image_token, quantize=False, fuse=False):
        err = compare(module, config, image_token, group, quantize, fuse)
        if not err <= ATOL:
            raise AssertionError(f"sharded logits differ from unsharded by {err:.2e}")
        return f"max |sharded - unsharded| {err:.1e}"

    for checked in lint.check_all(paths):
        spec = checked.spec
        module = load_source(spec.name, result.files[f"{spec.name}.py"])
        image_token = spec.vision.image_token if spec.vision is not None else None
        report(spec.name, logits_case, module, spec.tiny_config, image_token)
        modules[spec.name] = (module, dict(spec.tiny_config))
    llama, config = modules["llama"]
    report("llama 8-bit", logits_case, llama, config, None, True)
    # Fused q|k|v and gate|up (as loaded): shard splits each part by its own heads or width.
    report("llama fused", logits_case, llama, config, None, False, True)
    report("qwen3 fused 8-bit", logits_case, *modules["qwen3"], None, True, True)
    # Quantised experts (each rank's share of an expert's width holds whole groups of 32) and
    # a quantised latent attention.
    moe, moe_config = modules["qwen3_moe"]
    report(
        "qwen3_moe 8-bit", logits_case, moe, moe_config | {"moe_intermediate_size": 128}, None, True
    )
    report(
        "qwen3_moe 8-bit, groups split",
        expect_error, moe, moe_config | {"moe_intermediate_size": 32}, "'moe_intermediate_size'", True,
    )  # fmt: skip
    report("llama sharded load", sharded_load_peak, llama, config)
    report("sampling", sampling_agrees)
    heads = {"num_attention_heads": 6, "num_key_value_heads": 3, "head_dim": 8}
    report("llama 3 kv heads", expect_error, llama, config | heads, "'num_key_value_heads'")
    odd = {"intermediate_size": 33}
    report("llama odd width", expect_error, llama, config | odd, "'intermediate_size'")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
