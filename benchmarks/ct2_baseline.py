"""CTranslate2's decoding of the same random HF model and the same prompts as ``benchmarks/hf_baseline.py
generate``: the engine a CPU user runs T5 with (C++; int8 weights with integer matrix products).

    python3 benchmarks/ct2_baseline.py --config small --sequence_length 128 --micro_batch_size 8 --output_length 16 \\
        --compute_type int8 --json runs/ct2.json

The HF model is built as hf_baseline.py builds it (random, from the preset's shape, the same seed) and converted
with CTranslate2's own Transformers converter into a temporary directory (no download: the vocabulary is the token
ids themselves, ``<pad>``, ``</s>``, ``<unk>`` and ``t<id>`` for the rest); ``--compute_type int8`` quantizes the
float32 conversion as it loads, as a user's ``Translator(..., compute_type="int8")`` does. Prompts: the decoding
benchmarks' (data/generated.py's ``generated_prompts``), each row's tokens up to its length. Greedy (or beam search:
--num_beams), exactly --output_length tokens (the end token suppressed before: ``min_decoding_length``), as HF's and
ours. Reports the first token's time (the prompts read), the whole decoding's, per-token latency
((T(n) - T(1)) / (n - 1)), tokens/s, and the last batch's tokens.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from app.args import parse_config  # noqa: E402
from app.entry import die, entry  # noqa: E402

SPECIAL = {0: "<pad>", 1: "</s>", 2: "<unk>"}  # T5's ids of its special tokens


def token(i: int) -> str:
    """The vocabulary's string for token id i (CTranslate2 reads tokens as strings)."""
    return SPECIAL.get(int(i), f"t{int(i)}")


def token_id(s: str) -> int:
    """``token``'s inverse."""
    special = {v: k for k, v in SPECIAL.items()}
    return special[s] if s in special else int(s[1:])


class IdVocabulary:
    """What CTranslate2's converter reads of a tokenizer: every id its own token (``token``), T5's special ones."""

    pad_token, eos_token, unk_token = SPECIAL[0], SPECIAL[1], SPECIAL[2]

    def __init__(self, size: int):
        self.size = size

    def get_vocab(self) -> dict:
        return {token(i): i for i in range(self.size)}

    def convert_ids_to_tokens(self, i: int) -> str:
        return token(i)


def convert(model, directory: str) -> str:
    """The HF model (in memory) converted by CTranslate2's Transformers converter into ``directory`` (float32)."""
    from ctranslate2.converters import TransformersConverter

    class InMemory(TransformersConverter):
        def load_model(self, model_class, name, **kwargs):
            return model

        def load_tokenizer(self, tokenizer_class, name, **kwargs):
            return IdVocabulary(model.config.vocab_size)

    config_dir = os.path.join(directory, "config")
    model.config.save_pretrained(config_dir)  # (the converter reads the architecture from a config.json)
    return InMemory(config_dir).convert(os.path.join(directory, "model"), force=True)


def source_tokens(ids, mask) -> list:
    """Prompt rows ids/mask [b, k] -> each row's tokens up to its length, as CTranslate2 reads them."""
    return [[token(t) for t in row[m > 0]] for row, m in zip(ids, mask)]


def extra_flags(p):
    p.add_argument("--json", default=None)
    p.add_argument("--compute_type", choices=("float32", "int8"), default="float32",
                   help="CTranslate2's compute type: float32, or int8 weights (quantized as they load)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="CTranslate2's intra_threads (default: every "
                   "core, as XLA's and PyTorch's thread pools)")
    p.add_argument("--warmup_iterations", type=int, default=2)
    p.add_argument("--iterations", type=int, default=5, help="timed batches")
    p.add_argument("--worker", action="store_true", help="after the warm-up, measure --iterations batches at each "
                   "'measure' line of stdin (benchmarks/compare.py alternates engines this way)")


def translator(cfg, args, directory: str):
    """The random HF model of hf_baseline.py, converted and loaded with ``--compute_type`` -> ctranslate2.Translator."""
    import ctranslate2

    from benchmarks.hf_baseline import hf_model

    model, _, _ = hf_model(cfg)
    path = convert(model.eval(), directory)
    del model
    return ctranslate2.Translator(path, device="cpu", compute_type=args.compute_type, intra_threads=args.threads,
                                  inter_threads=1)


def generate(cfg, args, tr) -> tuple:
    """(what runs, measure: ``args.iterations`` batches -> their medians' figures), warmed up already."""
    from app.bench import decode_figures, decode_rounds
    from data.generated import generated_prompts

    n, inf = cfg.inference.output_length, cfg.inference
    if inf.do_sample:
        die("ct2_baseline.py runs greedy decoding or beam search (--num_beams): drop --do_sample")
    ids, mask = generated_prompts(cfg)
    source = source_tokens(ids, mask)

    def timed(tokens: int) -> tuple:
        t0 = time.perf_counter()
        out = tr.translate_batch(source, beam_size=inf.num_beams, length_penalty=inf.length_penalty,
                                 max_decoding_length=tokens, min_decoding_length=tokens)
        return time.perf_counter() - t0, out

    decode_rounds(timed, n, args.warmup_iterations)
    b = len(source)

    def measure() -> dict:
        times, first, out = decode_rounds(timed, n, args.iterations)
        return {**decode_figures(times, first, b, n), "tokens": [[token_id(s) for s in r.hypotheses[0]] for r in out]}

    import ctranslate2

    return {"framework": f"ctranslate2 {ctranslate2.__version__}", "device": "cpu", "batch_size": b,
            "compute_type": args.compute_type, "threads": args.threads, "prompt_tokens": int((mask > 0).sum())}, \
        measure


@entry
def main(argv=None) -> dict:
    cfg, args = parse_config("inference", "CTranslate2 baseline", "small", sys.argv[1:] if argv is None else argv,
                             extra_flags)
    from modelling import registry

    if registry.of_config(cfg).left_pad_prompts:  # (a causal LM: CTranslate2's Generator, not its Translator)
        die(f"ct2_baseline.py runs CTranslate2's Translator, an encoder-decoder's engine; --config {args.config} is a "
            f"{cfg.model.family} model: pick an encoder-decoder preset (small, base ...)")
    with tempfile.TemporaryDirectory() as d:
        header, measure = generate(cfg, args, translator(cfg, args, d))
    header["config"] = args.config
    if args.worker:  # measured on demand, alternated with other engines (benchmarks/compare.py: app/alternate.py)
        from app.alternate import serve

        serve(measure, header)
        return header
    report = {**header, **measure()}
    from app.bench import write_json

    write_json(args.json, report)
    print({k: v for k, v in report.items() if k != "tokens"})
    return report


if __name__ == "__main__":
    main()
