"""The ``mlxc`` command line: lint, build, verify, generate."""

from __future__ import annotations

import json
import os
import sys

import click

from mlxc.runtime.serving import serve_defaults


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="mlxc")
def main() -> None:
    """mlxc: compile declarative model specs to MLX and run them."""


def _specs_or_exit(fn, *args):
    """Run a compiler step; unusable input (no such path, no specs) exits 2."""
    from mlxc.compiler.lint import UnusableInput

    try:
        return fn(*args)
    except UnusableInput as err:
        click.echo(f"error: {err}", err=True)
        sys.exit(2)


def _specs_option(command):
    """``--specs DIR``: your own specs, compiled in memory next to the built-in ones."""
    return click.option(
        "--specs",
        default=None,
        metavar="DIR",
        type=click.Path(exists=True),
        help="Directory of your own specs (or one spec file), compiled in memory next to the "
        "built-in ones: no build, no reinstall. Lint findings (a model_type a built-in spec "
        "serves is R001) exit 1 before anything runs.",
    )(command)


def _user_specs_or_exit(specs: str | None) -> None:
    """Compile ``--specs`` before anything runs: findings are printed and exit 1, unusable input
    (no specs there) exits 2. Later lookups reuse the compiled modules."""
    if specs is None:
        return
    from mlxc.compiler.findings import render
    from mlxc.runtime.checkpoint.loading import registry
    from mlxc.runtime.checkpoint.user_specs import SpecError

    try:
        _specs_or_exit(registry, specs)
    except SpecError as err:
        click.echo(render(err.findings, "text"), err=True)
        click.echo(f"error: lint findings in --specs {specs}; nothing run", err=True)
        sys.exit(1)


@main.command()
@click.argument("paths", nargs=-1, required=True)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["text", "json", "github"]),
    default="text",
    show_default=True,
    help="Output format of the findings.",
)
def lint(paths: tuple[str, ...], fmt: str) -> None:
    """Check specs; print findings as PATH:LINE:COL: CODE message.

    Exit 0 when clean, 1 with findings, 2 on unusable input.
    """
    from mlxc.compiler import lint as lint_mod
    from mlxc.compiler.findings import render

    checked = _specs_or_exit(lint_mod.check_all, list(paths))
    findings = [f for c in checked for f in c.findings]
    if findings or fmt == "json":
        click.echo(render(findings, fmt))
    if findings:
        sys.exit(1)


@main.command()
@click.argument("paths", nargs=-1, required=True)
@click.option("-o", "--output", default="generated", show_default=True, help="Output directory.")
@click.option("--check", is_flag=True, help="Write nothing; exit 1 with a diff if output is stale.")
def build(paths: tuple[str, ...], output: str, check: bool) -> None:
    """Compile specs into MLX model modules and the model_type registry."""
    from pathlib import Path

    from mlxc.compiler import build as build_mod
    from mlxc.compiler.findings import render

    result = _specs_or_exit(build_mod.render, list(paths))
    if result.findings:
        click.echo(render(result.findings, "text"), err=True)
        click.echo("error: lint findings; nothing written", err=True)
        sys.exit(1)
    out = Path(output)
    if check:
        text = build_mod.diff(result.files, out)
        if text:
            click.echo(text, nl=False)
            click.echo(f"error: {out}/ is stale; run `mlxc build {' '.join(paths)}`", err=True)
            sys.exit(1)
        click.echo(f"{out}/ is up to date ({len(result.files)} files)")
        return
    written = build_mod.write(result.files, out)
    for name in written:
        click.echo(f"wrote {out / name}")
    click.echo(f"{len(written)} changed, {len(result.files) - len(written)} unchanged")


@main.command()
@click.argument("paths", nargs=-1)
@_specs_option
def verify(paths: tuple[str, ...], specs: str | None) -> None:
    """Run each spec's generated code through a bounded-cache schedule (trims included).

    Give spec PATHS, or --specs DIR: DIR's specs only, first checked against the built-in
    ones as `mlxc generate --specs` uses them.
    """
    # The checks compare float32 runs to 1e-4; on a GPU MLX rounds float32 matmuls through
    # TF32 (~1e-3) unless told otherwise before its first one, here.
    os.environ.setdefault("MLX_ENABLE_TF32", "0")
    from mlxc.verify import VerifyError
    from mlxc.verify import verify as verify_specs

    if bool(paths) == bool(specs):
        click.echo("error: give spec PATHS or --specs DIR (one of them)", err=True)
        sys.exit(2)
    if specs:
        _user_specs_or_exit(specs)
        paths = (specs,)
    try:
        reports = _specs_or_exit(verify_specs, list(paths))
    except VerifyError as err:
        click.echo(f"error: {err}", err=True)
        sys.exit(1)
    for r in reports:
        click.echo(f"{'ok  ' if r.ok else 'FAIL'} {r.spec}: {r.detail}")
    if not all(r.ok for r in reports):
        sys.exit(1)


# --- generate (runtime) -------------------------------------------------------------------


class _OneLineError(click.ClickException):
    """Printed as a single ``error: ...`` line on stderr, no usage block, no traceback."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code

    def show(self, file=None) -> None:
        click.echo(f"error: {self.format_message()}", err=True)


class _GenerateCommand(click.Command):
    # Flag errors (click.UsageError, exit 2) come from parsing or from the body: reword both.
    def make_context(self, *args, **kwargs):
        try:
            return super().make_context(*args, **kwargs)
        except click.UsageError as e:
            raise _OneLineError(e.format_message(), e.exit_code) from e

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except click.UsageError as e:
            raise _OneLineError(e.format_message(), e.exit_code) from e


def _model_option(command):
    """``--model``, as generate and serve take it (resolved by :func:`_resolve_model`)."""
    return click.option(
        "--model",
        "model_dir",
        default=None,
        metavar="DIR|ORG/NAME",
        help="HF checkpoint directory, or a Hugging Face hub model id (org/name: its snapshot "
        "in the hub cache, downloaded when missing; the cache only under HF_HUB_OFFLINE=1). "
        "Default: the built-in demo checkpoint (a small llama with RANDOM weights, written to "
        "$MLXC_HOME or ~/.cache/mlxc on first use; no download).",
    )(command)


def _resolve_model(model_dir: str) -> tuple[str, str | None]:
    """``--model``'s checkpoint directory, and the hub id it names (None for a directory)."""
    from mlxc.runtime.checkpoint.hub import ModelNotFound, resolve_model

    try:
        path, hub_id = resolve_model(model_dir)
    except ModelNotFound as e:
        raise click.BadParameter(str(e), param_hint="'--model'") from None
    return str(path), hub_id


def _cache_options(prefill_chunk_size: int):
    """The KV-cache flags generate and serve share (the server prefills in smaller chunks, so
    that running sequences decode between them)."""
    options = [
        click.option(
            "--max-kv-size",
            default=None,
            type=click.IntRange(min=1),
            help="Keep at most this many tokens in each full-attention KV cache, trimming the "
            "oldest after every prefill chunk and decode step (sliding-window layers keep "
            "their own window; prompts may then exceed the context). Default: unbounded, and "
            "a prompt longer than the context is an error.",
        ),
        click.option(
            "--kv-sink",
            default=None,
            type=click.IntRange(min=0),
            help="Tokens kept at the front when --max-kv-size trims. Default 4: StreamingLLM "
            "found that the first tokens soak up attention mass ('attention sinks') and "
            "evicting them degrades a sliding window sharply; keeping 4 restores it. 0 is a "
            "plain sliding window.",
        ),
        click.option(
            "--kv-bits",
            default=None,
            type=click.Choice(["4", "8"]),
            help="Store keys and values quantised to this many bits (4 bits: 0.28x the bytes "
            "of bf16 at group 64); works with --max-kv-size and its sinks and, in serve, the "
            "batched decode. Sliding-window layers too; recurrent state stays as it is. "
            "Default: the model's dtype.",
        ),
        click.option(
            "--kv-group-size",
            default=64,
            show_default=True,
            type=click.Choice(["32", "64", "128"]),
            help="Elements of a head vector sharing one scale and bias under --kv-bits (it "
            "must divide the head dim).",
        ),
        click.option(
            "--prefill-chunk-size",
            default=prefill_chunk_size,
            show_default=True,
            type=click.IntRange(min=1),
            help="Prompt tokens per prefill step (a chunk never splits an image of a model "
            "whose image tokens attend to each other).",
        ),
    ]

    def decorate(command):
        for option in reversed(options):
            command = option(command)
        return command

    return decorate


def _speculation_options(command):
    """The speculative-decoding flags generate and serve share."""
    options = [
        click.option(
            "--draft-model",
            default=None,
            metavar="DIR|ORG/NAME",
            help="Speculative decoding: a smaller checkpoint with the same tokenizer drafts "
            "--num-draft-tokens tokens per step, the model verifies them in one forward.",
        ),
        click.option(
            "--prompt-lookup",
            is_flag=True,
            help="Speculative decoding without a second model: drafts are the tokens that "
            "followed the last --ngram-size tokens' latest earlier occurrence in the prompt "
            "and output; the model verifies them in one forward.",
        ),
        click.option(
            "--num-draft-tokens",
            default=3,
            show_default=True,
            type=click.IntRange(min=1),
            help="Tokens drafted per speculative step.",
        ),
        click.option(
            "--ngram-size",
            default=3,
            show_default=True,
            type=click.IntRange(min=1),
            help="Longest n-gram --prompt-lookup matches (shorter ones are tried when it finds "
            "none).",
        ),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def _kv_quant(kv_bits: str | None, kv_group_size: str):
    """``--kv-bits`` / ``--kv-group-size`` as a ``KVQuant`` (None: float KV)."""
    from mlxc.runtime.model.cache import KVQuant

    return None if kv_bits is None else KVQuant(int(kv_bits), int(kv_group_size))


_DEFAULT_MAX_TOKENS = 256


@main.command(cls=_GenerateCommand)
@_model_option
@click.option(
    "--prompt", required=True, help="Prompt text (a user message under the chat template)."
)
@click.option(
    "--max-tokens",
    default=None,
    type=click.IntRange(min=1),
    help="Tokens to generate; the prompt and these must fit the model's context "
    f"(max_position_embeddings) unless --max-kv-size is given  [default: {_DEFAULT_MAX_TOKENS}, "
    "or the room the prompt leaves]",
)
@click.option(
    "--temp",
    default=0.0,
    show_default=True,
    type=click.FloatRange(min=0),
    help="Sampling temperature; 0 is greedy.",
)
@click.option(
    "--top-p",
    default=1.0,
    show_default=True,
    type=click.FloatRange(0, 1, min_open=True),
    help="Nucleus sampling mass.",
)
@click.option(
    "--top-k",
    default=0,
    show_default=True,
    type=click.IntRange(min=0),
    help="Keep the k most likely tokens; 0 keeps all.",
)
@click.option("--seed", default=None, type=int, help="Seed of the sampler's random key.")
@_cache_options(prefill_chunk_size=2048)
@click.option("--no-chat-template", is_flag=True, help="Encode the prompt as raw text.")
@click.option(
    "--image",
    "images",
    multiple=True,
    metavar="PATH",
    help="Image file for a vision-language model; repeat for several (they go before the "
    "prompt text, in the order given).",
)
@_speculation_options
@_specs_option
def generate(
    model_dir,
    prompt,
    max_tokens,
    temp,
    top_p,
    top_k,
    seed,
    max_kv_size,
    kv_sink,
    kv_bits,
    kv_group_size,
    prefill_chunk_size,
    no_chat_template,
    images,
    draft_model,
    prompt_lookup,
    num_draft_tokens,
    ngram_size,
    specs,
):
    """Generate a completion for PROMPT, streaming the text to stdout.

    Under `mlx.launch -n N` the model is sharded over the N processes (tensor parallelism);
    every rank generates, rank 0 prints.
    """
    import time

    from mlxc.runtime.checkpoint.loading import CheckpointError, load_checkpoint
    from mlxc.runtime.checkpoint.processor import ImageInputError, load_image
    from mlxc.runtime.checkpoint.tokenizer import StreamingDetokenizer, encode_prompt
    from mlxc.runtime.model import cuda_attention
    from mlxc.runtime.model.cache import KVQuantError, check_kv_quant
    from mlxc.runtime.serving.distributed import agree_on_seed, same_on_every_rank, world

    # MLX and transformers load here, not at CLI start-up: lint and build never need them.
    from mlxc.runtime.serving.generate import (
        DEFAULT_KV_SINK,
        ContextExceeded,
        completion_budget,
        generate_tokens,
    )
    from mlxc.runtime.serving.sample import make_sampler

    kv_sink = DEFAULT_KV_SINK if kv_sink is None else kv_sink
    if max_kv_size is not None and max_kv_size <= kv_sink:
        raise click.BadParameter(
            f"must be larger than --kv-sink ({kv_sink})", param_hint="'--max-kv-size'"
        )
    _user_specs_or_exit(specs)
    group = world()  # under mlx.launch: the ranks the model is sharded over
    lead = group is None or group.rank() == 0  # the rank that prints
    speculate = draft_model is not None or prompt_lookup
    _check_speculation(draft_model, prompt_lookup, images, group, top_p, top_k)
    if model_dir is None:
        from mlxc.runtime.checkpoint import demo

        try:
            model_dir = demo.ensure_demo()
        except (OSError, RuntimeError) as e:
            raise _OneLineError(f"cannot write the demo checkpoint: {e}") from e
        if lead:
            click.echo(f"warning: {demo.no_model_warning('generating with', model_dir)}", err=True)
    else:
        model_dir, _ = _resolve_model(model_dir)
    pil_images = []

    def refuse_images(config, tower) -> None:  # before the tokenizer and the weights load
        if images and tower is None:
            raise click.BadParameter(
                f"the {config.get('model_type')} model at {model_dir} takes no images "
                "(it has no vision tower, or its checkpoint was saved without one)",
                param_hint="'--image'",
            )
        try:
            pil_images.extend(load_image(p) for p in images)
        except ImageInputError as e:
            raise click.BadParameter(str(e), param_hint="'--image'") from e

    try:
        checkpoint = load_checkpoint(model_dir, specs=specs, before_tokenizer=refuse_images)
    except (CheckpointError, ValueError) as e:  # ValueError: inconsistent processor files
        raise _OneLineError(str(e), 1) from e
    tokenizer, processor = checkpoint.tokenizer, checkpoint.processor

    template = False if no_chat_template else None
    vision_inputs = None
    try:
        if processor is not None:
            encoded = processor.encode_text_and_images(prompt, pil_images, chat_template=template)
            ids, vision_inputs = encoded.ids, encoded.vision
        else:
            ids = encode_prompt(tokenizer, prompt, chat_template=template)
    except ValueError as e:  # the chat template (named), or images that do not fit the prompt
        raise _OneLineError(str(e), 1) from e
    if not ids:
        raise click.BadParameter("encodes to no tokens", param_hint="'--prompt'")
    # Before the weights load: a prompt or --max-tokens past the context fails at once.
    try:
        max_tokens = completion_budget(
            len(ids), max_tokens, _DEFAULT_MAX_TOKENS, checkpoint.context_length, max_kv_size
        )
    except ContextExceeded as e:
        raise click.BadParameter(str(e), param_hint=f"'--{e.param.replace('_', '-')}'") from e
    kv_quant = _kv_quant(kv_bits, kv_group_size)
    try:
        model = checkpoint.load_model(group=group)
        check_kv_quant(model, kv_quant)
    except (CheckpointError, KVQuantError) as e:
        raise _OneLineError(str(e), 1) from e
    # The kernels decode steps take (CUDA only): packed keys', or MLA's latents'.
    if kv_quant is not None:
        cuda_attention.warm(model, (1,), kv_quant)
    else:
        cuda_attention.warm_latent(model)

    if group is not None and seed is None:
        agree_on_seed(group)  # the ranks must draw the same tokens
    stats = None
    if speculate:
        from mlxc.runtime.serving.speculative import SpecStats, speculative_tokens

        drafter = _drafter(draft_model, prompt_lookup, ngram_size, num_draft_tokens, checkpoint)
        drafter_args = {"max_kv_size": max_kv_size, "kv_sink": kv_sink, "kv_quant": kv_quant}
        stats = SpecStats()
        try:
            drafter = drafter(**drafter_args)
            tokens = speculative_tokens(
                model,
                ids,
                drafter,
                max_tokens=max_tokens,
                num_draft_tokens=num_draft_tokens,
                temp=temp,
                seed=seed,
                prefill_chunk_size=prefill_chunk_size,
                eos_token_ids=checkpoint.eos_token_ids,
                stats=stats,
                **drafter_args,
            )
        except ValueError as e:  # RewindError, SpeculationError: named
            raise _OneLineError(f"cannot speculate: {e}", 1) from e
    else:
        sampler = make_sampler(temp=temp, top_p=top_p, top_k=top_k, seed=seed)
        tokens = generate_tokens(
            model,
            ids,
            max_tokens=max_tokens,
            sampler=sampler,
            prefill_chunk_size=prefill_chunk_size,
            max_kv_size=max_kv_size,
            kv_sink=kv_sink,
            kv_quant=kv_quant,
            eos_token_ids=checkpoint.eos_token_ids,
            vision_inputs=vision_inputs,
        )
    detok = StreamingDetokenizer(tokenizer)
    start = time.perf_counter()
    first = start
    n = 0
    generated = []
    for token in tokens:
        if n == 0:
            first = time.perf_counter()  # prefill time = time to the first token
        n += 1
        generated.append(token)
        text = detok.add(token)
        if lead:
            click.echo(text, nl=False)
            sys.stdout.flush()
    end = time.perf_counter()
    text = detok.finalize()
    if group is not None and not same_on_every_rank(generated, group):
        raise _OneLineError("the ranks generated different tokens: the output is not valid")
    if not lead:
        return
    click.echo(text)

    if n == 0:
        first = end  # stopped on EOS at once: all the time went to prefill
    prefill_tps = len(ids) / (first - start) if first > start else 0.0
    decode_tps = (n - 1) / (end - first) if n > 1 else 0.0
    click.echo(
        f"prompt: {len(ids)} tokens, {prefill_tps:.1f} tok/s | "
        f"generated: {n} tokens, {decode_tps:.1f} tok/s",
        err=True,
    )
    if stats is not None:
        click.echo(
            f"speculative: {stats.steps} verification steps, {stats.accepted}/{stats.proposed} "
            f"drafts accepted ({stats.acceptance:.0%})",
            err=True,
        )


def _check_speculation(draft_model, prompt_lookup, images, group, top_p, top_k) -> None:
    """Refuse, before anything loads, the speculative settings not built."""
    if draft_model is None and not prompt_lookup:
        return
    if draft_model is not None and prompt_lookup:
        raise click.BadParameter("give --draft-model or --prompt-lookup, not both")
    flag = "'--draft-model'" if draft_model is not None else "'--prompt-lookup'"
    if images:
        raise click.BadParameter("speculative decoding takes text prompts only", param_hint=flag)
    if group is not None:
        raise click.BadParameter("speculative decoding runs unsharded", param_hint=flag)
    if top_p < 1.0 or top_k:
        raise click.BadParameter(
            "speculative sampling keeps the --temp distribution; --top-p/--top-k are not "
            "combined with it",
            param_hint=flag,
        )


def _drafter(draft_model, prompt_lookup, ngram_size, num_draft_tokens, checkpoint):
    """A factory of the drafter (called with the cache settings): prompt lookup, or the draft
    checkpoint loaded, its tokenizer checked against the target's."""
    from mlxc.runtime.checkpoint.loading import CheckpointError
    from mlxc.runtime.serving.speculative import DraftModel, PromptLookup, load_draft

    if prompt_lookup:
        return lambda **_: PromptLookup(ngram_size)
    try:
        draft_model = load_draft(_resolve_model(draft_model)[0], checkpoint.tokenizer)
    except CheckpointError as e:
        raise _OneLineError(f"--draft-model: {e}", 1) from e
    return lambda **kw: DraftModel(draft_model, num_draft_tokens, **kw)


# --- end generate ---------------------------------------------------------------------------


# --- serve (runtime) ------------------------------------------------------------------------


@main.command(cls=_GenerateCommand)
@_model_option
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    help="Interface to bind (0.0.0.0 exposes the server to the network: set --api-key).",
)
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535))
@_cache_options(prefill_chunk_size=512)
@click.option(
    "--max-concurrency",
    default=16,
    show_default=True,
    type=click.IntRange(min=1),
    help="Sequences generating at once (their decode steps run as one batched forward); "
    "more requests wait in the queue.",
)
@click.option(
    "--max-queue",
    default=64,
    show_default=True,
    type=click.IntRange(min=0),
    help="Requests waiting for a slot; past this the answer is 429 at once.",
)
@click.option(
    "--prefix-cache-bytes",
    default=serve_defaults.DEFAULT_PREFIX_CACHE_BYTES,
    show_default=True,
    type=click.IntRange(min=0),
    help="Bytes of prompt caches kept across requests (LRU), so a multi-turn chat or a shared "
    "system prompt prefills only its new tokens; reuse comes in whole --prefill-chunk-size "
    "chunks. 0 turns it off.",
)
@click.option(
    "--prefill-wait-steps",
    default=serve_defaults.DEFAULT_PREFILL_WAIT_STEPS,
    show_default=True,
    type=click.IntRange(min=0),
    help="Decode steps a new short prompt may wait while others decode, so that prompts "
    "arriving a few per step prefill together in one forward (until a quarter of the decode "
    "batch's count waits); 0 prefills each at once.",
)
@click.option(
    "--warmup/--no-warmup",
    default=True,
    show_default=True,
    help="On CUDA, serve a few throwaway requests before the real ones, so that the kernels MLX "
    "compiles at first use do not stall the first real requests (about a minute on a machine "
    "whose MLX kernel cache is empty, ~20 s once filled). No effect on other devices.",
)
@click.option(
    "--max-tokens",
    default=serve_defaults.DEFAULT_MAX_TOKENS,
    show_default=True,
    type=click.IntRange(min=1),
    help="Completion length for requests that set no max_tokens.",
)
@click.option(
    "--max-tokens-limit",
    default=serve_defaults.DEFAULT_MAX_TOKENS_LIMIT,
    show_default=True,
    type=click.IntRange(min=1),
    help="Largest max_tokens a request may ask for (400 above), so no request holds a slot "
    "for ever (under --max-kv-size the context no longer bounds it).",
)
@click.option(
    "--max-images-per-request",
    default=serve_defaults.DEFAULT_MAX_IMAGES,
    show_default=True,
    type=click.IntRange(min=0),
    help="Images one chat request may carry (400 above).",
)
@click.option(
    "--max-request-pixels",
    default=serve_defaults.DEFAULT_MAX_REQUEST_PIXELS,
    show_default=True,
    type=click.IntRange(min=1),
    help="Pixels of all of a request's images together, read from their headers before any "
    "is decoded (400 above).",
)
@click.option(
    "--allowed-hosts",
    default="",
    metavar="NAMES",
    help="Comma-separated extra host names the Host header may carry (DNS-rebinding guard; "
    "localhost, loopback and the bound address always pass); '*' allows any.",
)
@click.option(
    "--allowed-origins",
    default="",
    metavar="ORIGINS",
    help="Comma-separated web origins (e.g. http://localhost:3000) whose pages may call the "
    "server (CORS); '*' allows any. Other cross-origin requests get 403.",
)
@click.option(
    "--api-key",
    default=None,
    envvar="MLXC_API_KEY",
    help="Require 'Authorization: Bearer KEY' on /v1/* (401 otherwise); also read from "
    "$MLXC_API_KEY. /health stays open.",
)
@click.option(
    "--chat-template",
    default=None,
    type=click.Path(exists=True, dir_okay=False),
    help="Jinja chat template file used instead of the tokenizer's.",
)
@click.option(
    "--chat-template-args",
    default=None,
    metavar="JSON",
    help="Extra variables of the chat template for every request, as a JSON object (e.g. "
    "'{\"enable_thinking\": false}'); a request's chat_template_kwargs override them.",
)
@click.option(
    "--reasoning-parser",
    default=None,
    type=click.Choice(["deepseek_r1", "qwen3"]),
    help="Split the model's <think>...</think> text into message.reasoning_content (streamed "
    "as delta.reasoning_content).",
)
@click.option(
    "--model-id",
    default=None,
    help="Model name in the API (default: the hub id, or the directory name).",
)
@click.option(
    "--max-body-bytes",
    default=serve_defaults.DEFAULT_MAX_BODY_BYTES,
    show_default=True,
    type=click.IntRange(min=1024),
    help="Largest request body accepted (413 above).",
)
@click.option(
    "--log-level",
    default="info",
    show_default=True,
    type=click.Choice(["debug", "info", "warning", "error"]),
)
@click.option(
    "--http-process/--no-http-process",
    default=True,
    show_default=True,
    help="Serve HTTP from a process of its own, so the event loop's Python never waits on "
    "(or holds up) the scheduler's; --no-http-process runs both in one process.",
)
@_speculation_options
@click.option(
    "--speculative-rows",
    default=4,
    show_default=True,
    type=click.IntRange(min=1),
    help="With --prompt-lookup or --draft-model: the decode batch speculates while it holds "
    "at most this many rows, each greedy or sampled by temperature alone, without penalties, "
    "logit biases, logprobs or grammars, and half of them have drafts (each row keeps the "
    "drafts it accepts).",
)
@_specs_option
def serve(
    model_dir,
    host,
    port,
    max_kv_size,
    kv_sink,
    kv_bits,
    kv_group_size,
    prefill_chunk_size,
    max_concurrency,
    max_queue,
    prefix_cache_bytes,
    prefill_wait_steps,
    warmup,
    max_tokens,
    max_tokens_limit,
    max_images_per_request,
    max_request_pixels,
    allowed_hosts,
    allowed_origins,
    api_key,
    chat_template,
    chat_template_args,
    reasoning_parser,
    model_id,
    max_body_bytes,
    log_level,
    http_process,
    draft_model,
    prompt_lookup,
    num_draft_tokens,
    ngram_size,
    speculative_rows,
    specs,
):
    """Serve a model over an OpenAI-compatible HTTP API (chat, completions, streaming).

    Under `mlx.launch -n N` the model is sharded over the N processes (tensor parallelism):
    rank 0 serves HTTP, every rank runs the scheduler's steps in lockstep.
    """
    import logging
    from pathlib import Path

    from mlxc.runtime.checkpoint.loading import CheckpointError
    from mlxc.runtime.model.cache import KVQuantError, RewindError
    from mlxc.runtime.serving.distributed import Lockstep, agree_on_seed, world
    from mlxc.runtime.serving.engine import Engine
    from mlxc.runtime.serving.generate import DEFAULT_KV_SINK
    from mlxc.runtime.serving.server import bind, create_app, run

    logging.basicConfig(level=log_level.upper(), format="%(levelname)s:     %(name)s: %(message)s")
    log = logging.getLogger("mlxc.serve")
    kv_sink = DEFAULT_KV_SINK if kv_sink is None else kv_sink
    if max_kv_size is not None and max_kv_size <= kv_sink:
        raise click.BadParameter(
            f"must be larger than --kv-sink ({kv_sink})", param_hint="'--max-kv-size'"
        )
    if max_tokens > max_tokens_limit:
        raise click.BadParameter(
            f"must be at most --max-tokens-limit ({max_tokens_limit})", param_hint="'--max-tokens'"
        )
    _user_specs_or_exit(specs)
    template = None
    if chat_template is not None:
        try:
            template = Path(chat_template).read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise _OneLineError(f"cannot read --chat-template {chat_template}: {e}") from e
    template_args = _json_object(chat_template_args, "--chat-template-args")

    group = world()  # under mlx.launch: the ranks the model is sharded over
    speculation = None
    if prompt_lookup or draft_model is not None:
        from mlxc.runtime.serving.speculative import BatchSpeculation

        if prompt_lookup and draft_model is not None:
            raise click.BadParameter("give --draft-model or --prompt-lookup, not both")
        speculation = BatchSpeculation(num_draft_tokens, ngram_size, speculative_rows)
    # What every rank under mlx.launch must set alike: their schedulers take the same steps.
    shared = {
        "max_kv_size": max_kv_size,
        "kv_sink": kv_sink,
        "kv_quant": _kv_quant(kv_bits, kv_group_size),
        "prefill_chunk_size": prefill_chunk_size,
        "prefix_cache_bytes": prefix_cache_bytes,
        "prefill_wait_steps": prefill_wait_steps,
        "warm_up": warmup,
        "speculation": speculation,
        "specs": specs,
    }
    if group is not None:
        agree_on_seed(group)  # samplers without a seed draw the same tokens on every rank
        shared |= {"group": group, "lockstep": Lockstep(group)}
        if group.rank() != 0:
            return _follow(model_dir, draft_model, shared)

    # Bind first: a port in use is reported now, not after the model has loaded.
    try:
        sock = bind(host, port)
    except OSError as e:
        raise _OneLineError(f"cannot listen on {host}:{port}: {e.strerror or e}") from e

    description = None
    if model_dir is None:
        from mlxc.runtime.checkpoint import demo

        try:
            model_dir = demo.ensure_demo()
        except (OSError, RuntimeError) as e:
            sock.close()
            raise _OneLineError(f"cannot write the demo checkpoint: {e}") from e
        model_id = model_id or demo.DEMO_MODEL_ID
        description = demo.DEMO_DESCRIPTION
        log.warning("%s", demo.no_model_warning("serving", model_dir))
    else:
        try:
            model_dir, hub_id = _resolve_model(model_dir)
        except click.BadParameter:
            sock.close()
            raise
        model_id = model_id or hub_id  # the API names a hub model by its id
    draft_dir = None
    if draft_model is not None:
        try:
            draft_dir, _ = _resolve_model(draft_model)
        except click.BadParameter:
            sock.close()
            raise
    try:
        engine = Engine.from_path(
            model_dir,
            model_id=model_id,
            chat_template=template,
            description=description,
            max_concurrency=max_concurrency,
            max_queue=max_queue,
            draft_model=draft_dir,
            **shared,
        )
    except (CheckpointError, KVQuantError, RewindError) as e:
        sock.close()
        raise _OneLineError(_load_failure(e), 1) from e
    except KeyboardInterrupt:
        sock.close()
        raise _OneLineError("interrupted while loading the model", 130) from None

    app_settings = {
        "api_key": api_key,
        "default_max_tokens": max_tokens,
        "max_tokens_limit": max_tokens_limit,
        "max_body_bytes": max_body_bytes,
        "max_images": max_images_per_request,
        "max_request_pixels": max_request_pixels,
        "bind_host": host,
        "allowed_hosts": _comma_list(allowed_hosts),
        "allowed_origins": _comma_list(allowed_origins),
        "chat_template_args": template_args,
        "reasoning_parser": reasoning_parser,
    }
    window = f"max-kv-size {max_kv_size}, kv-sink {kv_sink}" if max_kv_size else "unbounded KV"
    if kv_bits is not None:
        window += f", {kv_bits}-bit KV (group {kv_group_size})"
    if speculation is not None:
        drafter = "prompt lookup" if draft_model is None else f"draft model {draft_model}"
        window += f", {drafter} (up to {num_draft_tokens} drafts, {speculative_rows} rows)"
    bound_host, bound_port = sock.getsockname()[:2]
    log.info(
        "serving %r from %s (%s, prefill chunk %d, concurrency %d, queue %d); OpenAI base_url "
        "http://%s:%d/v1",
        engine.model_id,
        model_dir,
        window,
        prefill_chunk_size,
        max_concurrency,
        max_queue,
        bound_host,
        bound_port,
    )
    if not http_process:
        return run(create_app(engine, **app_settings), sock, log_level=log_level)
    from mlxc.runtime.serving.frontend import serve_http_process

    status = serve_http_process(engine, sock, app_settings, log_level)
    if status:
        raise SystemExit(status)


def _json_object(value: str | None, flag: str) -> dict:
    if value is None:
        return {}
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as e:
        raise click.BadParameter(f"not valid JSON: {e}", param_hint=f"'{flag}'") from e
    if not isinstance(parsed, dict):
        raise click.BadParameter("must be a JSON object", param_hint=f"'{flag}'")
    return parsed


def _follow(model_dir, draft_model, shared: dict) -> None:
    """A rank other than 0 of `mlx.launch ... mlxc serve`: no HTTP; its scheduler runs the
    ticks rank 0 broadcasts, with the settings every rank shares (`shared`: caches, prefill,
    speculation, the group), so every rank trims, resumes prefixes, groups prompts and
    speculates alike (each drafts for itself, the same drafts), until rank 0 stops."""
    import time

    from mlxc.runtime.checkpoint import demo
    from mlxc.runtime.checkpoint.loading import CheckpointError
    from mlxc.runtime.model.cache import KVQuantError, RewindError
    from mlxc.runtime.serving.engine import Engine

    try:
        engine = Engine.from_path(
            _resolve_model(model_dir)[0] if model_dir else demo.ensure_demo(),
            draft_model=_resolve_model(draft_model)[0] if draft_model else None,
            **shared,
        )
    except (CheckpointError, KVQuantError, RewindError) as e:
        raise _OneLineError(_load_failure(e), 1) from e
    while engine.scheduler.alive:
        time.sleep(0.5)


def _load_failure(error: Exception) -> str:
    """The one line `mlxc serve` exits with when its model (or draft model) cannot serve."""
    from mlxc.runtime.model.cache import RewindError

    if isinstance(error, RewindError):  # a draft model whose caches cannot take back drafts
        return f"cannot speculate: {error}"
    return str(error)


def _comma_list(value: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in value.split(",") if item.strip())


# --- end serve ------------------------------------------------------------------------------


# --- convert (runtime) ----------------------------------------------------------------------


@main.command(cls=_GenerateCommand)
@click.option(
    "--model",
    "model_dir",
    required=True,
    type=click.Path(exists=True, file_okay=False),
    help="Checkpoint directory to convert (anything `mlxc generate` loads).",
)
@click.option(
    "--out",
    "out_dir",
    required=True,
    type=click.Path(file_okay=False),
    help="New directory to write (must not exist, or be empty); appears only when complete.",
)
@click.option("--quantize", is_flag=True, help="Quantise linears, embeddings and experts.")
@click.option(
    "--bits",
    default=4,
    show_default=True,
    type=click.Choice(["2", "3", "4", "5", "6", "8"]),
    help="Bits per weight with --quantize.",
)
@click.option(
    "--group-size",
    default=64,
    show_default=True,
    type=click.Choice(["32", "64", "128"]),
    help="Weights sharing one scale and bias with --quantize; layers whose input width it "
    "does not divide stay float.",
)
@click.option(
    "--dtype",
    default=None,
    type=click.Choice(["bfloat16", "float16", "float32"]),
    help="Float dtype of the written weights and scales  [default: the checkpoint's]",
)
def convert(model_dir, out_dir, quantize, bits, group_size, dtype):
    """Write a checkpoint as an MLX checkpoint: another dtype, or quantised (--quantize)."""
    from mlxc.runtime.checkpoint.convert import convert as run_convert
    from mlxc.runtime.checkpoint.loading import CheckpointError

    if not quantize and (bits != "4" or group_size != "64"):
        click.echo("note: --bits/--group-size only apply with --quantize", err=True)
    try:
        summary = run_convert(
            model_dir,
            out_dir,
            quantize=quantize,
            bits=int(bits),
            group_size=int(group_size),
            dtype=dtype,
        )
    except CheckpointError as e:
        raise _OneLineError(str(e), 1) from e
    quant = summary["quantization"]
    what = (
        f"{quant['bits']}-bit, group size {quant['group_size']}, "
        f"{summary['quantized_modules']} layers quantised"
        if quant
        else "not quantised"
    )
    click.echo(
        f"wrote {summary['out']}: {summary['parameters'] / 1e6:.1f}M parameters, "
        f"{summary['dtype']}, {what}, {summary['bytes'] / 2**20:.1f} MiB in "
        f"{len(summary['files'])} file(s); copied {len(summary['copied'])} "
        "tokenizer/processor file(s)"
    )


# --- end convert ----------------------------------------------------------------------------


# --- checkpoint (random weights for a spec) -------------------------------------------------


@main.command(cls=_GenerateCommand)
@click.argument("spec", type=click.Path(exists=True, dir_okay=False))
@click.option(
    "--out",
    "out_dir",
    required=True,
    type=click.Path(file_okay=False),
    help="New directory to write (must not exist, or be empty); appears only when complete.",
)
@click.option(
    "--config",
    "config_file",
    default=None,
    type=click.Path(exists=True, dir_okay=False),
    help="config.json to build instead of the spec's tiny_config.",
)
@click.option(
    "--seed",
    default=0,
    show_default=True,
    type=click.IntRange(min=0),
    help="Seed of the random weights: the same seed writes the same weights.",
)
def checkpoint(spec, out_dir, config_file, seed):
    """Write a checkpoint with RANDOM weights for SPEC: config.json (the spec's tiny_config),
    safetensors and a small tokenizer with a chat template; `mlxc generate --model OUT` runs it.
    """
    from mlxc.checkpoint import read_config_file, write_checkpoint
    from mlxc.compiler.findings import render
    from mlxc.runtime.checkpoint.loading import CheckpointError
    from mlxc.runtime.checkpoint.user_specs import SpecError

    try:
        config = read_config_file(config_file) if config_file else None
        summary = write_checkpoint(spec, out_dir, config=config, seed=seed)
    except SpecError as err:
        click.echo(render(err.findings, "text"), err=True)
        click.echo(f"error: lint findings in {spec}; nothing written", err=True)
        sys.exit(1)
    except CheckpointError as e:
        raise _OneLineError(str(e), 1) from e
    click.echo(
        f"wrote {summary['out']}: spec {summary['spec']}, RANDOM weights (seed {seed}), "
        f"{summary['parameters'] / 1e6:.2f}M parameters, float32, "
        f"{summary['bytes'] / 2**20:.1f} MiB; config.json from {summary['config']}; "
        f"a byte-level tokenizer of {summary['vocab_size']} ids with a chat template"
    )


# --- end checkpoint -------------------------------------------------------------------------


if __name__ == "__main__":
    sys.exit(main())
