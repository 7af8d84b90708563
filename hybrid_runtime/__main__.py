"""``python -m hybrid_runtime generate``: run requests offline through the serving loop (no server).

With ``--requests FILE.jsonl`` every line is submitted at once, so they run as one continuously batched
workload; the output is one JSON line per request, in input order.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from .config import BundleError, ConfigError
from .sampling import RequestValidationError, SamplingParams
from .serving import GenerationRequest, RuntimeOptions, ServingEngine, generate

_REQUEST_KEYS = {"prompt", "prompt_ids", "id"}


def _load_requests(path: Path, defaults: SamplingParams) -> list[GenerationRequest]:
    reqs = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            if not isinstance(obj, dict):
                raise ValueError("each line must be a JSON object")
            sampling = {k: v for k, v in obj.items() if k not in _REQUEST_KEYS}
            params = SamplingParams.from_json(sampling, defaults=defaults)
        except (ValueError, RequestValidationError) as e:
            raise SystemExit(f"error: {path}:{n}: {e}") from e
        ids = obj.get("prompt_ids")
        reqs.append(GenerationRequest(str(obj.get("id", f"line-{n}")), prompt=obj.get("prompt"),
                                      prompt_ids=tuple(ids) if ids is not None else None, params=params))
    return reqs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hybrid_runtime", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="generate from a prompt, token ids, or a JSONL file of requests")
    g.add_argument("--engine", type=Path, required=True, help="engine bundle directory")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="text prompt")
    src.add_argument("--prompt-ids", help="comma-separated token ids, e.g. 1,2,3")
    src.add_argument("--requests", type=Path, help="JSONL: {prompt|prompt_ids, max_tokens, temperature, ...}")
    g.add_argument("--max-tokens", type=int, default=16)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--logprobs", type=int, default=None,
                   help="0..20: add each token's logprob and that many top alternatives to the JSON output")
    g.add_argument("--multi-block-mode", default="auto", choices=["auto", "on", "off"])
    g.add_argument("--profile-pinning", default="per_context", choices=["per_context", "single_context"])
    g.add_argument("--max-batch-size", type=int, default=0, help="0 = the bundle's")
    g.add_argument("--device", default="auto",
                   help="auto (a cuda or tensorrt bundle on the GPU, an onnxruntime bundle on the CPU) | cpu | cuda | "
                        "cuda:N (a tensorrt bundle on cpu: segment outputs copied to the host)")
    g.add_argument("--json", action="store_true", help="print JSON lines instead of text")
    g.add_argument("--stats", action="store_true", help="print the runtime metrics to stderr at the end")
    g.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        defaults = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                                  top_p=args.top_p, seed=args.seed, ignore_eos=args.ignore_eos,
                                  logprobs=args.logprobs)
        if args.requests:
            reqs = _load_requests(args.requests, defaults)
        elif args.prompt is not None:
            reqs = [GenerationRequest("prompt", prompt=args.prompt, params=defaults)]
        else:
            ids = tuple(int(t) for t in args.prompt_ids.split(",") if t.strip())
            reqs = [GenerationRequest("prompt", prompt_ids=ids, params=defaults)]
        engine = ServingEngine(args.engine, RuntimeOptions(
            max_batch_size=args.max_batch_size, multi_block_mode=args.multi_block_mode,
            profile_pinning=args.profile_pinning, device=args.device, warmup=False)).start()  # one-shot: no warm-up
    except (RequestValidationError, ConfigError, BundleError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        results = generate(engine, reqs)
    finally:
        engine.shutdown()
    failed = 0
    for r, ev in zip(reqs, results):
        failed += ev.finish_reason == "error"
        if args.json or args.requests:
            row = {"id": r.request_id, "output_ids": list(ev.output_ids), "text": ev.text,
                   "finish_reason": ev.finish_reason}
            if ev.error:
                row["error"] = ev.error
            if r.params.logprobs is not None:
                row["logprobs"] = [{"logprob": lp.logprob, "top": [list(t) for t in lp.top]} for lp in ev.logprobs]
            print(json.dumps(row, ensure_ascii=False))
        elif ev.error:
            print(f"error: {ev.error}", file=sys.stderr)
        else:
            print(ev.text)
    if args.stats:
        print(json.dumps(engine.stats(), indent=1), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
