"""``overlapckpt`` / ``python -m overlapckpt``: list, inspect and verify checkpoints.

    overlapckpt ls ROOT                 committed checkpoints, oldest first
    overlapckpt inspect ROOT [--step N] one checkpoint's manifest: versions, ledger, window choice
    overlapckpt verify ROOT [--step N | --all]
                                        stream every stored byte (shards blob by blob, .metadata,
                                        the manifest) against the manifest's checksums; exit 1 on a mismatch

ROOT is a local directory or an fsspec URL; ``-o key=value`` passes storage options
(``-o endpoint_url=http://127.0.0.1:9000 -o 'client_kwargs={"region_name": "us-east-1"}'``).
Exit codes: 0 fine, 1 a checkpoint is corrupt (verify), 2 the command could not run (storage
unreachable, bad arguments, the crc32c package missing for a checkpoint written with it).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from typing import Any

from .errors import CheckpointReadError, CorruptCheckpointError, OverlapCkptError
from .format.signing import resolve_key
from .format.storage import CheckpointStore
from .format.verify import verify_checkpoint
from .loading import list_checkpoints, read_manifest, resolve_checkpoint


def _storage_options(pairs: list[str]) -> dict[str, Any]:
    """``key=value`` pairs; a value that reads as JSON (true, 3, {"region_name": "x"}) is taken as such."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise OverlapCkptError(f"storage option {pair!r} is invalid; write it as key=value")
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value  # a plain string: a URL, a key id
    return out


def _size(nbytes: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024  # type: ignore[assignment]
    return str(nbytes)


def _when(unix_s: float) -> str:
    return datetime.datetime.fromtimestamp(unix_s, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def printable(text: str) -> str:
    """``text`` with every character a terminal would act on escaped (``\x1b``, ``\n``, ...).

    What a manifest holds is data from storage: a crafted name or field must not move the
    cursor, clear the screen or forge a line of output.
    """
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def _say(text: str, file: Any = None) -> None:
    print(printable(text), file=file if file is not None else sys.stdout)


def cmd_ls(args: argparse.Namespace) -> int:
    infos = list_checkpoints(args.root, _storage_options(args.option))
    if not infos:
        _say(f"no committed checkpoint under {args.root}")
        return 0
    _say(f"{'step':>10} {'requested':>10} {'mode':>7} {'window':>6} {'ranks':>5} {'size':>10}  committed                path")
    for i in infos:
        _say(
            f"{i.step:>10} {i.requested_step:>10} {i.mode:>7} {i.window:>6} {i.world_size:>5} {_size(i.nbytes):>10}  "
            f"{_when(i.created_at)}  {i.path}"
        )
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    store = CheckpointStore(args.root, _storage_options(args.option))
    name = resolve_checkpoint(store, args.step)
    m = read_manifest(store, name)
    if args.json:
        for line in json.dumps(m.raw, indent=1, sort_keys=True).splitlines():
            _say(line)
        return 0
    ledger = m.ledger or {}
    _say(f"checkpoint   {store.checkpoint_url(name)}")
    _say(f"version      step {m.step} (requested at step {m.requested_step}), mode {m.mode}, window {m.window}")
    _say(f"state        {len(m.items)} tensors, {_size(m.nbytes)}; torch {m.torch_version}; committed {_when(m.created_at)}")
    _say(f"extra state  {', '.join(m.extra_state_index) or '-'}; boundary captured at {ledger.get('boundary')}")
    if m.ranks:
        mesh = "x".join(str(d) for d in m.mesh_shape)
        _say(f"ranks        {m.world_size} (mesh {mesh}); each wrote its share:")
        for r in m.ranks:
            versions = sorted({g["version"] for g in (r.ledger or {}).get("groups", [])})
            copied = (r.stats or {}).get("copied_nbytes")
            _say(
                f"  rank {r.rank}: {_size(r.nbytes)} in {len(r.items)} tensors or shards, groups at versions "
                f"{versions}{'' if copied is None else f', copied {_size(int(copied))}'}"
            )
    if m.exports:
        _say(f"framework    {', '.join(sorted(m.exports))}")
    for g in ledger.get("groups", []):
        landed = g.get("landed_s")
        _say(f"  group {g['index']}: {_size(g['nbytes'])} at version {g['version']}, landed {'-' if landed is None else f'{landed * 1000:.1f} ms'} after the request")
    if ledger.get("gradient_steps"):
        _say(f"  gradients logged for steps {', '.join(ledger['gradient_steps'])}; replayed on the CPU to version {m.step}")
    if ledger.get("closed_early_at") is not None:
        _say(f"  window closed early at step {ledger['closed_early_at']}")
    choice = ledger.get("window_choice")
    if choice:
        fwd, bw = choice.get("fwd_bwd_s"), choice.get("copy_bytes_per_s")
        _say(
            f"  window='auto' chose {choice['window_steps']}: {choice['reason']} "
            f"(forward+backward {'-' if fwd is None else f'{fwd * 1000:.2f} ms'}, copy "
            f"{'-' if bw is None else f'{bw / 1e9:.2f} GB/s'})"
        )
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    store = CheckpointStore(args.root, _storage_options(args.option))
    if args.all:
        names = store.committed_names()
        if not names:
            names = [resolve_checkpoint(store, None)]  # raises: nothing committed
    else:
        # The newest committed checkpoint even when its manifest is damaged: that is what verify is for.
        names = [resolve_checkpoint(store, args.step, skip_damaged=False)]
    failed = 0
    for name in names:
        # A damaged checkpoint counts and the others are still checked; a storage or
        # setup failure (CheckpointReadError, a missing crc32c package) ends the run
        # with exit 2, since nothing was found corrupt.
        try:
            report = verify_checkpoint(store, name, signing_key=resolve_key(None))  # OVERLAPCKPT_SIGNING_KEY, if set
        except CorruptCheckpointError as e:
            _say(f"CORRUPT {store.checkpoint_url(name)}: {e}")
            failed += 1
            continue
        if report.ok:
            _say(
                f"ok      {report.path}: {report.blobs} blobs in {report.files} files, .metadata and the manifest, "
                f"{_size(report.nbytes)}: every {report.algorithm} checksum matches"
            )
        else:
            failed += 1
            _say(f"CORRUPT {report.path}: {len(report.problems)} problem(s), {report.blobs} blobs read")
            for problem in report.problems:
                _say(f"  {problem}")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="overlapckpt", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, fn, helptext in (
        ("ls", cmd_ls, "list committed checkpoints"),
        ("inspect", cmd_inspect, "show one checkpoint's manifest"),
        ("verify", cmd_verify, "check every stored byte against the manifest's checksums"),
    ):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("root", help="checkpoint root: a directory or an fsspec URL")
        p.add_argument("-o", "--option", action="append", default=[], metavar="KEY=VALUE", help="fsspec storage option")
        if name != "ls":
            p.add_argument("--step", type=int, default=None, help="the checkpoint of this step (default: the newest)")
        if name == "inspect":
            p.add_argument("--json", action="store_true", help="print the whole manifest as JSON")
        if name == "verify":
            p.add_argument("--all", action="store_true", help="verify every committed checkpoint")
        p.set_defaults(fn=fn)
    args = parser.parse_args(argv)
    # Exit codes: 0 fine, 1 a checkpoint is corrupt (verify), 2 the command could not run.
    try:
        return args.fn(args)
    except CheckpointReadError as e:  # storage, not the checkpoint: name what the storage said
        cause = e.__cause__ if e.__cause__ is not None else e
        _say(f"overlapckpt {args.command}: {args.root}: {type(cause).__name__}: {cause}", file=sys.stderr)
        return 2
    except OverlapCkptError as e:
        _say(f"overlapckpt {args.command}: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # storage unreachable (botocore's errors are not OSErrors), bad URL, missing s3fs
        _say(f"overlapckpt {args.command}: {args.root}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
