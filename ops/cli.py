"""The `slidespec` command line."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable

logger = logging.getLogger("slidespec")


def run_command(func: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """A command's exit status. Bad input (a file that cannot be read or parsed, a malformed
    option) is one line on stderr and status 2, not a traceback; the traceback is logged at
    debug level."""
    try:
        return func(args)
    except ValueError as exc:
        logger.debug("command failed", exc_info=True)
        print(f"error: {exc}", file=sys.stderr)
        return 2


def positive(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def read_file(path: str, what: str, binary: bool = False, errors: str = "strict") -> str | bytes:
    """A whole input file (text as UTF-8, `errors` as `open` reads them); one that cannot be read
    is a ValueError naming `what` asked for it and the path."""
    try:
        if binary:
            with open(path, "rb") as f:
                return f.read()
        with open(path, encoding="utf-8", errors=errors) as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{what}: cannot read {path}: {getattr(exc, 'strerror', None) or exc}") from exc


def _prompt(args: argparse.Namespace) -> str | list[int]:
    if not args.token_ids:
        return args.prompt
    try:
        return [int(t) for t in args.prompt.split(",")]
    except ValueError:
        raise ValueError(f"prompt: --token-ids wants comma-separated integers, got {args.prompt!r}") from None


def _generate(args: argparse.Namespace) -> int:
    """Stream one completion from a running gRPC server to the terminal."""
    import grpc

    from cluster.client import GenerationClient

    prompt = _prompt(args)
    token = read_file(args.token_file, "--token-file").strip() if args.token_file else None
    root_cert = read_file(args.tls_ca, "--tls-ca", binary=True) if args.tls_ca else None
    client = GenerationClient(args.target, token=token, root_cert=root_cert)
    try:
        for response in client.generate(
            prompt,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            timeout=args.timeout,
        ):
            sys.stdout.write(response.text or (" ".join(map(str, response.token_ids)) + " "))
            sys.stdout.flush()
            if response.finished:
                spec = (
                    f", mean accept length {response.spec.mean_accept_length:.2f}" if response.spec.verify_steps else ""
                )
                print(
                    f"\n[{response.usage.completion_tokens} tokens, replica {response.replica}{spec}]", file=sys.stderr
                )
    except grpc.RpcError as exc:
        print(f"\nerror: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    finally:
        client.close()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="slidespec", description=__doc__)
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)
    from ops import demo

    demo_parser = sub.add_parser("demo", help="run the whole system locally on the shipped tiny models")
    demo.add_arguments(demo_parser)
    demo_parser.set_defaults(func=demo.run)
    from ops import serve

    serve_parser = sub.add_parser("serve", help="serve a model in the foreground (a local Ray head, or --address)")
    serve.add_arguments(serve_parser)
    serve_parser.set_defaults(func=serve.run)
    gen = sub.add_parser("generate", help="stream a completion from a running slidespec gRPC server")
    gen.add_argument("prompt", help="text, or comma-separated token ids with --token-ids")
    gen.add_argument("--target", default="127.0.0.1:50051")
    gen.add_argument("--token-ids", action="store_true", help="the prompt is comma-separated token ids")
    gen.add_argument("--max-new-tokens", type=positive, default=128)
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
    from ops import first_token

    first = sub.add_parser("first-token", help="split each request's time to first token in OTLP JSON traces")
    first_token.add_arguments(first)
    first.set_defaults(func=first_token.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run_command(args.func, args)


if __name__ == "__main__":
    sys.exit(main())
