"""``python -m builder``: build engine bundles from Hugging Face hybrid checkpoints."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hybrid_runtime.config import ConfigError

from .bundle import BuildOptions, build_bundle, describe


def _progress(msg: str) -> None:
    print(f"[builder] {msg}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m builder", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("default-checkpoint", help="write the embedded seeded smoke model (HF format) to OUT")
    d.add_argument("out", type=Path)
    d.add_argument("--seed", type=int, default=0)
    b = sub.add_parser("build", help="build an engine bundle from a checkpoint folder")
    b.add_argument("--checkpoint", type=Path, required=True, help="HF folder: config.json, *.safetensors, tokenizer")
    b.add_argument("--output", type=Path, required=True, help="bundle folder to write (replaced if present)")
    b.add_argument("--backend", default="onnxruntime", choices=["onnxruntime", "tensorrt", "cuda"],
                   help="onnxruntime (CPU), tensorrt (plans), cuda (the native GPU runtime: kernels + cuBLASLt)")
    b.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"],
                   help="weight/activation precision (default: bfloat16 for --backend cuda, else float32; the "
                        "onnxruntime CPU backend always uses float32)")
    b.add_argument("--max-batch-size", type=int, default=8, help="sequences decoded together (DECODE profile max)")
    b.add_argument("--max-input-len", type=int, default=1024, help="longest prompt accepted, in tokens")
    b.add_argument("--max-seq-len", type=int, default=2048, help="longest prompt + generation, in tokens")
    b.add_argument("--max-num-tokens", type=int, default=0,
                   help="tokens per prefill step (PREFILL profile max; default max(512, max batch size))")
    b.add_argument("--page-size", type=int, default=16, help="tokens per KV-cache page")
    b.add_argument("--num-kv-pages", type=int, default=0,
                   help="KV pages per attention layer (default: every slot at max-seq-len)")
    b.add_argument("--num-state-slots", type=int, default=0, help="recurrent-state slots (default max batch size)")
    b.add_argument("--target-arch", default="",
                   help="--backend tensorrt: GPU architecture of the plans, e.g. sm_89 (default: the current GPU; "
                        "TensorRT-RTX can build for any of sm_75/80/86/89/120/121 without a GPU)")
    b.add_argument("--quant-activations", default="fp32", choices=["fp32", "int8"],
                   help="GPTQ checkpoints: activations of the MatMulNBits weight-only matmuls: fp32 (parity with the "
                        "dequantised float model) or int8 (MLAS integer kernels: faster, logits differ slightly)")
    b.add_argument("--dummy-weights", action="store_true",
                   help="--backend cuda: write no weights; the runtime generates seeded random weights on the GPU at "
                        "load (benchmarks and load tests of a model shape without its checkpoint: only config.json "
                        "and the tokenizer are read)")
    i = sub.add_parser("inspect", help="print a bundle's manifest summary")
    i.add_argument("bundle", type=Path)
    args = ap.parse_args(argv)
    try:
        if args.cmd == "default-checkpoint":
            from .default_model import write_default_checkpoint

            write_default_checkpoint(args.out, seed=args.seed, progress=_progress)
            _progress(f"default checkpoint written to {args.out}")
        elif args.cmd == "build":
            dtype = args.dtype or ("bfloat16" if args.backend == "cuda" else "float32")
            opts = BuildOptions(backend=args.backend, dtype=dtype, max_batch_size=args.max_batch_size,
                                max_input_len=args.max_input_len, max_seq_len=args.max_seq_len,
                                max_num_tokens=args.max_num_tokens, page_size=args.page_size,
                                num_kv_pages=args.num_kv_pages, num_state_slots=args.num_state_slots,
                                target_arch=args.target_arch, dummy_weights=args.dummy_weights,
                                quant_activations=args.quant_activations)
            build_bundle(args.checkpoint, args.output, opts, _progress)
        else:
            print(describe(args.bundle))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
