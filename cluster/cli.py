"""The `slidespec` command line."""

from __future__ import annotations

import argparse
import logging
import sys
import time

logger = logging.getLogger("slidespec")


def _demo(args: argparse.Namespace) -> int:
    """Generate for a few concurrent requests on the shipped tiny hybrid-SWA model."""
    from workers.engine import Engine, SamplingParams

    load_format = "dummy" if args.dummy else "auto"
    eng = Engine(model=args.model, page_size=args.page_size, max_total_tokens=args.max_total_tokens,
                 chunked_prefill_size=args.chunked_prefill_size, load_format=load_format)
    cfg = eng.cfg
    logger.info("model %s: %d layers, windows %s", cfg.architecture, cfg.num_layers,
                sorted({w for w in cfg.layer_windows.values()}, key=lambda w: (w is None, w)))
    prompts = [[(7 * i + j) % cfg.vocab_size for j in range(n)] for i, n in enumerate(args.prompt_lens)]
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = eng.generate(prompt_token_ids=prompts, sampling=sampling)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.token_ids) for o in outs)
    for out in outs:
        shown = out.text if out.text is not None else out.token_ids[:16]
        print(f"{out.request_id}: prompt {len(out.prompt_token_ids)} tokens -> {len(out.token_ids)} tokens "
              f"({out.finish_reason}): {shown}")
    print(f"{generated} tokens in {elapsed:.2f} s = {generated / elapsed:.1f} tokens/s; KV after: {eng.kv_stats()}")
    eng.check_no_leak()
    eng.shutdown()
    return 0


def _generate(args: argparse.Namespace) -> int:
    """Stream one completion from a running gRPC server to the terminal."""
    import grpc

    from cluster.client import GenerationClient

    token = open(args.token_file).read().strip() if args.token_file else None
    root_cert = open(args.tls_ca, "rb").read() if args.tls_ca else None
    client = GenerationClient(args.target, token=token, root_cert=root_cert)
    prompt = [int(t) for t in args.prompt.split(",")] if args.token_ids else args.prompt
    try:
        for response in client.generate(prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                        top_p=args.top_p, top_k=args.top_k, seed=args.seed, timeout=args.timeout):
            sys.stdout.write(response.text or (" ".join(map(str, response.token_ids)) + " "))
            sys.stdout.flush()
            if response.finished:
                spec = f", mean accept length {response.spec.mean_accept_length:.2f}" if response.spec.verify_steps else ""
                print(f"\n[{response.usage.completion_tokens} tokens, replica {response.replica}{spec}]", file=sys.stderr)
    except grpc.RpcError as exc:
        print(f"\nerror: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    finally:
        client.close()
    return 0


def build_parser() -> argparse.ArgumentParser:
    from ops import DEFAULT_MODEL

    parser = argparse.ArgumentParser(prog="slidespec", description=__doc__)
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the engine on the shipped tiny model")
    demo.add_argument("--model", default=DEFAULT_MODEL)
    demo.add_argument("--dummy", action="store_true", default=None,
                      help="random weights (default when the model directory has no weights)")
    demo.add_argument("--page-size", type=int, default=16)
    demo.add_argument("--max-total-tokens", type=int, default=8192)
    demo.add_argument("--chunked-prefill-size", type=int, default=256)
    demo.add_argument("--max-new-tokens", type=int, default=256)
    demo.add_argument("--prompt-lens", type=int, nargs="+", default=[40, 130, 300, 75])
    demo.set_defaults(func=_demo)
    gen = sub.add_parser("generate", help="stream a completion from a running slidespec gRPC server")
    gen.add_argument("prompt", help="text, or comma-separated token ids with --token-ids")
    gen.add_argument("--target", default="127.0.0.1:50051")
    gen.add_argument("--token-ids", action="store_true", help="the prompt is comma-separated token ids")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=None)
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    gen.add_argument("--token-file", default=None, help="file holding the bearer token")
    gen.add_argument("--tls-ca", default=None, help="PEM of the CA that signed the server certificate")
    gen.set_defaults(func=_generate)
    from ops import diagnose

    diag = sub.add_parser("diagnose", help="report accept length over time and find drops in OTLP JSON traces")
    diagnose.add_arguments(diag)
    diag.set_defaults(func=diagnose.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if getattr(args, "dummy", False) is None:
        import glob
        import os

        args.dummy = not glob.glob(os.path.join(args.model, "*.safetensors"))
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
