"""Token-mask time per decoding step of the grammar engines, on the host (issue 15).

    python -m bench.grammar_masks [--vocab 32000] [--runs 20]

For a small JSON schema (an object of a bounded string, a bounded integer and an enum array),
both engines walk random valid paths (a random allowed token each step until the grammar ends)
and every step's mask computation is timed: llguidance through ``runtime.serving.structured``
(what ``mlxc serve`` runs), and xgrammar when it is importable (it is not a dependency: its
package requires torch). Two byte-level BPE tokenizers: the tests' tiny one (320 tokens) and one
trained here on the installed transformers' sources (``--vocab``, a realistic size).
"""

from __future__ import annotations

import argparse
import glob
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


def tokenizers(vocab: int, work: Path) -> dict[str, object]:
    import checkpoints
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    out = {"tiny (tests)": checkpoints.write_tokenizer(work / "tiny")}
    root = Path(transformers.__file__).parent
    files = sorted(glob.glob(str(root / "models" / "*" / "modeling_*.py")))[:300]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train(files, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    out[f"BPE {len(fast)}"] = fast
    return out


def allowed(mask: np.ndarray, vocab: int) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")[:vocab])


def llguidance_walks(tok, runs: int) -> dict:
    from mlxc.runtime.serving.structured import Grammars, response_grammar

    t0 = time.perf_counter()
    grammars = Grammars(tok, None, {tok.eos_token_id})
    grammars._tokenizer_info()
    setup = time.perf_counter() - t0
    grammar = response_grammar("json_schema", SCHEMA)
    rng, times, compile_times = random.Random(0), [], []
    for _ in range(runs):
        t0 = time.perf_counter()
        c = grammars.constraint(grammar)
        compile_times.append(time.perf_counter() - t0)
        while True:
            t0 = time.perf_counter()
            mask = c.bitmask()
            times.append(time.perf_counter() - t0)
            token = int(rng.choice(allowed(mask, len(tok))))
            c.accept(token)
            if token == tok.eos_token_id:
                break
    return {"setup": setup, "compile": statistics.median(compile_times), "masks": times}


def xgrammar_walks(tok, runs: int) -> dict | None:
    try:
        import xgrammar as xgr
    except ImportError:
        return None
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    setup = time.perf_counter() - t0
    rng, times, compile_times = random.Random(0), [], []
    for _ in range(runs):
        t0 = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
        compile_times.append(time.perf_counter() - t0)
        matcher = xgr.GrammarMatcher(compiled)
        mask = xgr.allocate_token_bitmask(1, info.vocab_size)
        while not matcher.is_terminated():
            t0 = time.perf_counter()
            matcher.fill_next_token_bitmask(mask)
            times.append(time.perf_counter() - t0)
            token = int(rng.choice(allowed(mask[0].numpy(), info.vocab_size)))
            if token in info.stop_token_ids:
                break
            matcher.accept_token(token)
    return {"setup": setup, "compile": statistics.median(compile_times), "masks": times}


def row(engine: str, tok_name: str, r: dict) -> str:
    us = sorted(t * 1e6 for t in r["masks"])
    p99 = us[min(len(us) - 1, int(len(us) * 0.99))]
    return (
        f"| {engine} | {tok_name} | {r['setup'] * 1e3:.0f} ms | {r['compile'] * 1e3:.2f} ms | "
        f"{statistics.median(us):.1f} | {statistics.mean(us):.1f} | {p99:.0f} | {len(us)} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    print(
        "| engine | tokenizer | tokenizer setup | grammar compile | mask median us | mean us "
        "| p99 us | masks |"
    )
    print("|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as work:
        for name, tok in tokenizers(args.vocab, Path(work)).items():
            print(row("llguidance", name, llguidance_walks(tok, args.runs)), flush=True)
            r = xgrammar_walks(tok, args.runs)
            print(row("xgrammar", name, r) if r else f"| xgrammar | {name} | not installed |")


if __name__ == "__main__":
    main()
