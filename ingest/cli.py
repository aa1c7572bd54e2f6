"""The `ingest` command: argparse only; each subcommand calls one public function."""

from __future__ import annotations

import argparse
import functools
import os
import select
import signal
import sys
from collections.abc import Callable

from ingest import format as fmt
from ingest.format import pages
from ingest.infocli import store_info
from ingest.sizes import parse_size


def _shard_size(text: str) -> int:
    """--shard-size: a size whose shard this process can map (``writer.check_shard_size``);
    one it cannot is said in one line, without the usage, and the command exits 2."""
    from ingest.build.writer import ShardSizeError, check_shard_size

    size = parse_size(text)
    try:
        check_shard_size(size, f"--shard-size {text.strip()}")
    except ShardSizeError as e:
        print(f"ingest build: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    return size


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be a positive integer")
    return value


def _quality(text: str) -> int:
    value = int(text)
    if not 1 <= value <= 100:
        raise argparse.ArgumentTypeError(f"{text!r}: JPEG quality must be within 1..100")
    return value


def _encoding(text: str) -> str:
    from ingest.build.encoding import parse_encoding

    try:
        return parse_encoding(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--encoding ")) from None


def _compression(text: str):
    from ingest.format.codec import parse_compression

    try:
        return parse_compression(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


DESCRIPTION = (
    "Pack an image folder (torchvision ImageFolder layout: SRC/CLASS/IMAGE) once into a "
    "store of a few large LMDB shards, checking and normalising every image, for "
    "loader.DataLoader to read fast; then summarise (info) or check (verify) a store."
)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        package = version("imfeed")
    except PackageNotFoundError:  # run from a checkout that was never installed
        package = "(not installed)"
    return f"ingest (imfeed) {package}, store format v{fmt.FORMAT_VERSION}"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ingest", description=DESCRIPTION)
    p.add_argument("--version", action="version", version=_version())
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="convert an ImageFolder tree into a store")
    b.add_argument("src", help="image folder: SRC/CLASS/.../IMAGE")
    b.add_argument("out", help="store directory to create (e.g. train.lmdb)")
    b.add_argument("--workers", type=_positive, default=None, help="processes (default: all cores)")
    b.add_argument("--shard-size", type=_shard_size, default="512MiB", metavar="SIZE",
                   help="shards roll over at this many bytes (default: %(default)s)")  # fmt: skip
    b.add_argument("--compression", type=_compression, default="none",
                   help="none | zstd[:LEVEL] (default: none)")  # fmt: skip
    b.add_argument("--encoding", type=_encoding, default="jpeg", metavar="E",
                   help="jpeg (images as they are) | raw (decoded pixels: no decode when "
                   "training, ~5x the bytes) | mixed:SHARE (that part as pixels) (default: "
                   "%(default)s)")  # fmt: skip
    b.add_argument("--max-size", type=_positive, default=None, metavar="PX",
                   help="cap the longer side; larger images are resized, re-encoded "
                   "(default: no cap)")  # fmt: skip
    b.add_argument("--quality", type=_quality, default=95, metavar="Q",
                   help="JPEG quality of re-encoded images (default: %(default)s)")  # fmt: skip
    b.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                   help="build with Ray tasks: on a new local Ray instance, or on the cluster "
                   "at ADDRESS (HOST:6379); OUT must be on storage every node sees; "
                   "needs pip install 'imfeed[ray]'")  # fmt: skip
    b.add_argument("--overwrite", action="store_true", help="replace a complete store at OUT")
    b.add_argument("--strict", action="store_true",
                   help="exit non-zero if any file is rejected (default: off; the store "
                   "holds the rest either way)")  # fmt: skip
    b.add_argument("--no-verify", action="store_true", help="do not decode images to check them")
    b.add_argument("--max-pixels", type=_positive, default=fmt.DEFAULT_MAX_PIXELS, metavar="N",
                   help="reject images of more pixels (decompression bombs); "
                   "default 178956970, PIL's limit")  # fmt: skip
    b.add_argument("--max-file-size", type=parse_size, default="1GiB", metavar="SIZE",
                   help="reject larger source files unread; default 1GiB")  # fmt: skip
    i = sub.add_parser("info", help="summarise a store")
    i.add_argument("store")
    i.add_argument("--json", action="store_true", help="print one JSON object")
    v = sub.add_parser("verify", help="check checksums and decode every record")
    v.add_argument("store")
    v.add_argument("--max-pixels", type=_positive, default=None, metavar="N",
                   help="decode images of up to N pixels, as a reader given max_pixels=N "
                   "(default 178956970; needed for a store built with a higher limit)")  # fmt: skip
    c = sub.add_parser("cache", help="list or clear the node's RAM cache of stores (/dev/shm)")
    csub = c.add_subparsers(dest="action", required=True)
    ls = csub.add_parser("ls", help="list cached stores: shards, bytes, users alive or not")
    ls.add_argument("--json", action="store_true", help="print one JSON array")
    clear = csub.add_parser("clear", help="remove cached stores (all, or that of OUT)")
    clear.add_argument("out", nargs="?", help="a store directory, or a cache id from `ls`")
    clear.add_argument("--force", action="store_true", help="also caches that processes use")
    for cmd in (ls, clear):
        cmd.add_argument("--root", default="/dev/shm", help="cache root (default /dev/shm)")
    return p


def quiet_pipe(main: Callable[..., int]) -> Callable[..., int]:
    """``main`` that ends quietly where its reader has gone (``ingest info | head``): a
    BrokenPipeError printed a traceback, and another at the interpreter's exit."""

    @functools.wraps(main)
    def run(argv: list[str] | None = None) -> int:
        try:
            status = main(argv)
            if sys.stdout is not None:  # None where the process was started with it closed
                sys.stdout.flush()  # here, not at exit, where its error cannot be caught
            return status
        except BrokenPipeError:
            if not _stdout_gone():  # another pipe (a dead worker's): not ours to hide
                raise
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # exit's flush
            return 128 + signal.SIGPIPE  # as a program the pipe's signal ended

    return run


def _stdout_gone() -> bool:
    """Whether standard output is a pipe whose reader has gone (poll says POLLERR)."""
    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poll.poll(0))
    except (AttributeError, ValueError, OSError):  # no stdout, or not a file
        return False


@quiet_pipe
def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from ingest.build.resume import OutputError
    from ingest.build.scan import SourceError
    from ingest.format.cachedir import CacheError
    from ingest.parallel import WorkerDied

    try:
        if args.command in ("build", "verify") and (problem := pages.engine_problem()):
            raise fmt.StoreError(problem)  # before any worker: each would fail the same way
        commands = {"build": _build, "info": store_info, "verify": _verify, "cache": _cache}
        return commands[args.command](args)
    except (SourceError, OutputError, fmt.StoreError, CacheError) as e:
        print(f"ingest {args.command}: error: {e}", file=sys.stderr)
        return 2
    except WorkerDied as e:  # killed, or out of memory: the sealed shards are kept
        print(f"ingest {args.command}: error: {e}; run the same command again: it resumes "
              "from the shards already written", file=sys.stderr)  # fmt: skip
        return 2
    except KeyboardInterrupt:
        print("ingest: interrupted; run the same command again to resume", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader of stdout gone: quiet_pipe's
        raise
    except OSError as e:  # what the system refused (access, a name too long...): one line
        what = f"{fmt.shown(str(e.filename))}: " if e.filename else ""
        print(f"ingest {args.command}: error: {what}{e.strerror or e}", file=sys.stderr)
        return 2


def _build(args: argparse.Namespace) -> int:
    from ingest.build import BuildOptions, build

    options = BuildOptions(args.shard_size, args.compression, args.max_size, args.quality,
                           not args.no_verify, max_pixels=args.max_pixels,
                           max_file_bytes=args.max_file_size,
                           encoding=args.encoding)  # fmt: skip
    if args.ray is not None:
        manifest = _build_ray(args, options)
        if manifest is None:
            return 2
    else:
        manifest = build(args.src, args.out, options, workers=args.workers,
                         overwrite=args.overwrite)  # fmt: skip
    print(
        f"ingest: {args.out}: seen {manifest['num_seen']} = kept {manifest['num_samples']}"
        f" + rejected {manifest['num_rejected']} + ignored {manifest['num_ignored']}"
        f" in {len(manifest['shards'])} shard(s)"
    )
    if manifest["num_rejected"]:
        print(f"ingest: rejected files are listed in {os.path.join(args.out, fmt.REJECTS)}")
    if manifest["num_samples"] == 0:
        print("ingest: error: no valid image was found; check SRC", file=sys.stderr)
        return 1
    if args.strict and manifest["num_rejected"]:
        print(f"ingest build: error: --strict, and {manifest['num_rejected']} file(s) were "
              "rejected (the store holds the others); fix or remove them, then build again "
              "with --overwrite",
              file=sys.stderr)  # fmt: skip
        return 1
    return 0


def _build_ray(args: argparse.Namespace, options) -> dict | None:
    """The build on Ray (``--ray``); None after printing why it could not run."""
    from ingest.build.ray import ClusterError, build_ray

    if args.workers is not None:
        print("ingest build: error: --workers is for a local build; with --ray, the CPUs "
              "of the Ray cluster decide (ray start --num-cpus N)", file=sys.stderr)  # fmt: skip
        return None
    address = None if args.ray == "local" else args.ray
    try:
        return build_ray(args.src, args.out, options, address=address, overwrite=args.overwrite)
    except ClusterError as e:
        print(f"ingest build: error: {e}", file=sys.stderr)
        return None


def _verify(args: argparse.Namespace) -> int:
    from ingest.verify import verify_store

    problems = verify_store(args.store, max_pixels=args.max_pixels)
    for problem in problems:
        print(f"ingest verify: {args.store}/{problem}", file=sys.stderr)
    if problems:
        print(f"ingest verify: {len(problems)} problem(s); rebuild the store", file=sys.stderr)
        return 1
    n = fmt.read_manifest(args.store)["num_samples"]
    print(f"ingest verify: {args.store}: OK, {n} records checked")
    return 0


def _cache(args: argparse.Namespace) -> int:
    from ingest.cachecli import cache_clear, cache_ls

    return cache_ls(args) if args.action == "ls" else cache_clear(args)


if __name__ == "__main__":
    sys.exit(main())
