"""``overlapckpt`` / ``python -m overlapckpt``: the command line (its help is ``HELP`` below; docs/cli.md)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Any

from .cli_output import Progress, readable_size, say, utc_time
from .errors import CheckpointNotFoundError, CheckpointReadError, CorruptCheckpointError, OverlapCkptError
from .format.lease import live_holder
from .format.manifest import CheckpointInfo, step_of_name
from .format.signing import resolve_key
from .format.storage import CheckpointStore
from .format.tiers import LOCAL_TIER, ROOT_TIER, default_local_dir
from .format.verify import read_manifest, verify_checkpoint
from .restore.locate import list_checkpoints, resolve_checkpoint, split_checkpoint_path

HELP = """List, inspect, verify, prune and export overlapckpt checkpoints.

  overlapckpt ls ROOT [--json] [--tier all|root|local] [--local-dir DIR]
      committed checkpoints, oldest first: tier, step, requested step, mode, window, ranks,
      size, run and the checkpoint it continued from (its lineage), commit time, path; with
      --tier all (the default), this node's local tier too, where it exists
  overlapckpt inspect ROOT [--step N | --name DIR] [--json]
      one checkpoint's manifest: versions per group, gradients replayed, the window's choice
  overlapckpt verify ROOT [--step N | --name DIR | --all]
      stream every stored byte against the manifest's checksums; exit 1 on a mismatch
  overlapckpt prune ROOT --keep N [--dry-run] [--force]
      delete all but the newest N committed checkpoints (never the one latest names)
  overlapckpt export ROOT OUT [--step N | --name DIR] [--format torch|safetensors] [--model-only]
      one consolidated file: torch.save of the model and optimizer state, or safetensors of the model
  overlapckpt build-native
      build the optional native helpers now (a pip install builds them on first use otherwise)

--tier local runs any command on this node's local tier (Checkpointer(local_every=...)):
--local-dir, else the default the Checkpointer derives from ROOT (/dev/shm/overlapckpt-...).
ROOT is a local directory or an fsspec URL; -o KEY=VALUE passes storage options
(-o endpoint_url=http://127.0.0.1:9000 -o 'client_kwargs={"region_name": "us-east-1"}').
Without --step, the newest checkpoint. When two runs hold checkpoints of the same step (a
rollback), --step names them and --name picks one. On a terminal, verify and export show
their progress on stderr.

Exit codes: 0 fine, 1 a checkpoint is corrupt (verify), 2 the command could not run (storage
unreachable, no such root, bad arguments, the crc32c package missing for a checkpoint
written with it)."""


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


def _existing_store(args: argparse.Namespace) -> CheckpointStore:
    """The root's store, or CheckpointNotFoundError when the root does not exist or is a file (ls exited 0 on both).

    A checkpoint directory given as ROOT (the path ``ls`` prints) stands for its root, with
    that checkpoint chosen: ``args.name`` is set to it, and ``--step``/``--name`` must agree.
    """
    options = _storage_options(args.option)
    store, name = split_checkpoint_path(args.root, options)
    if name is not None and args.command != "ls":
        given = getattr(args, "name", None)
        if (given is not None and given != name) or (getattr(args, "step", None) not in (None, step_of_name(name))):
            raise OverlapCkptError(
                f"{args.root} is the checkpoint {name}, but --step/--name name another; pass the root with --step or --name, "
                "or the checkpoint's path alone"
            )
        args.name, args.step = name, None
        return store
    if not store.fs.exists(store.root_path):
        raise CheckpointNotFoundError(f"no such checkpoint root: {args.root}; check the path (and -o storage options)")
    if not store.fs.isdir(store.root_path):
        raise CheckpointNotFoundError(f"{args.root} is a file, not a checkpoint root; pass the directory that holds the step-N checkpoints")
    return store


def _count(text: str) -> int:
    """``--keep``'s value: a whole number of checkpoints, 0 or more."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number; pass how many checkpoints to keep, e.g. --keep 3") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative; pass how many checkpoints to keep, 0 or more (e.g. --keep 3)")
    return value


def _chosen(store: CheckpointStore, args: argparse.Namespace, skip_damaged: bool = True) -> str:
    """The directory ``--name`` or ``--step`` names (the newest without either); two of one step is an error listing them."""
    if getattr(args, "name", None):
        if step_of_name(args.name) is None:
            raise OverlapCkptError(f"--name {args.name!r} is not a checkpoint directory name (step-N, checkpoint-N); see overlapckpt ls")
        if not store.is_committed(args.name):
            raise CheckpointNotFoundError(f"{store.checkpoint_url(args.name)} is not a committed checkpoint (no .metadata)")
        return str(args.name)
    if args.step is not None:
        matching = [n for n in store.committed_names() if step_of_name(n) == args.step]
        if len(matching) > 1:
            runs = []
            for n in matching:
                try:
                    runs.append(f"{n} (run {(read_manifest(store, n).run_id or '?')[:8]})")
                except CorruptCheckpointError:
                    runs.append(f"{n} (manifest damaged)")
            raise OverlapCkptError(
                f"step {args.step} has {len(matching)} checkpoints under {store.root}, from runs that diverged after a "
                f"rollback: {', '.join(runs)}; pass --name with one of them"
            )
    return resolve_checkpoint(store, args.step, skip_damaged=skip_damaged)


def cmd_ls(args: argparse.Namespace) -> int:
    listed: list[CheckpointInfo] = []
    if args.tier in ("all", ROOT_TIER):
        _existing_store(args)
        listed += [dataclasses.replace(i, tier=ROOT_TIER) for i in list_checkpoints(args.root, _storage_options(args.option))]
    local = args.local_dir or default_local_dir(args.root)
    if args.tier == LOCAL_TIER or (args.tier == "all" and os.path.isdir(local)):
        if not os.path.isdir(local):
            raise CheckpointNotFoundError(f"no local tier at {local}; pass --local-dir (the Checkpointer's local_dir)")
        listed += [dataclasses.replace(i, tier=LOCAL_TIER) for i in list_checkpoints(local)]
    if args.json:
        rows = [{"tier": i.tier, **dataclasses.asdict(i)} for i in listed]  # "tier" first, as the table shows it
        for line in json.dumps(rows, indent=1).splitlines():
            say(line)  # json escapes control characters itself; printable() leaves the lines as they are
        return 0
    if not listed:
        say(f"no committed checkpoint under {args.root}" + (f" nor in the local tier {local}" if args.tier == "all" else ""))
        return 0
    # The tier column only where a local tier is listed: a root's listing reads as it always did.
    tiered = any(i.tier == LOCAL_TIER for i in listed)
    say(
        ("tier  " if tiered else "") + f"{'step':>10} {'requested':>10} {'mode':>7} {'window':>6} {'ranks':>5} {'size':>10}  {'run':8}  "
        f"{'continued from':24}  committed                path"
    )
    for i in listed:
        say(
            (f"{i.tier:5} " if tiered else "") + f"{i.step:>10} {i.requested_step:>10} {i.mode:>7} {i.window:>6} {i.world_size:>5} "
            f"{readable_size(i.nbytes):>10}  {(i.run_id or '-')[:8]:8}  {i.restored_from or '-':24}  {utc_time(i.created_at)}  {i.path}"
        )
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    store = _existing_store(args)
    name = _chosen(store, args)
    m = read_manifest(store, name)
    if args.json:
        for line in json.dumps(m.raw, indent=1, sort_keys=True).splitlines():
            say(line)
        return 0
    ledger = m.ledger or {}
    say(f"checkpoint   {store.checkpoint_url(name)}")
    say(f"version      step {m.step} (requested at step {m.requested_step}), mode {m.mode}, window {m.window}")
    say(f"state        {len(m.items)} tensors, {readable_size(m.nbytes)}; torch {m.torch_version}; committed {utc_time(m.created_at)}")
    say(f"extra state  {', '.join(m.extra_state_index) or '-'}; boundary captured at {ledger.get('boundary')}")
    if m.ranks:
        mesh = "x".join(str(d) for d in m.mesh_shape)
        say(f"ranks        {m.world_size} (mesh {mesh}); each wrote its share:")
        for r in m.ranks:
            versions = sorted({g["version"] for g in (r.ledger or {}).get("groups", [])})
            copied = (r.stats or {}).get("copied_nbytes")
            say(
                f"  rank {r.rank}: {readable_size(r.nbytes)} in {len(r.items)} tensors or shards, groups at versions "
                f"{versions}{'' if copied is None else f', copied {readable_size(int(copied))}'}"
            )
    if m.exports:
        say(f"framework    {', '.join(sorted(m.exports))}")
    for g in ledger.get("groups", []):
        landed = g.get("landed_s")
        say(f"  group {g['index']}: {readable_size(g['nbytes'])} at version {g['version']}, landed {'-' if landed is None else f'{landed * 1000:.1f} ms'} after the request")
    if ledger.get("gradient_steps"):
        say(f"  gradients logged for steps {', '.join(ledger['gradient_steps'])}; replayed on the CPU to version {m.step}")
    for a in m.replay_arithmetic:
        say(f"  replay of {a.describe()}")
    if ledger.get("closed_early_at") is not None:
        say(f"  window closed early at step {ledger['closed_early_at']}")
    choice = ledger.get("window_choice")
    if choice:
        fwd, bw = choice.get("fwd_bwd_s"), choice.get("copy_bytes_per_s")
        say(
            f"  window='auto' chose {choice['window_steps']}: {choice['reason']} "
            f"(forward+backward {'-' if fwd is None else f'{fwd * 1000:.2f} ms'}, copy "
            f"{'-' if bw is None else f'{bw / 1e9:.2f} GB/s'})"
        )
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    store = _existing_store(args)
    if args.all:
        names = store.committed_names()
        if not names:
            names = [resolve_checkpoint(store, None)]  # raises: nothing committed
    else:
        # The newest committed checkpoint even when its manifest is damaged: that is what verify is for.
        names = [_chosen(store, args, skip_damaged=False)]
    failed = 0
    progress = Progress()
    for name in names:
        # A damaged checkpoint counts and the others are still checked; a storage or
        # setup failure (CheckpointReadError, a missing crc32c package) ends the run
        # with exit 2, since nothing was found corrupt.
        try:
            report = verify_checkpoint(
                store, name, signing_key=resolve_key(None), on_progress=progress.bytes_read(f"verifying {name}")
            )  # OVERLAPCKPT_SIGNING_KEY, if set
        except CorruptCheckpointError as e:
            progress.done()
            say(f"CORRUPT {store.checkpoint_url(name)}: {e}")
            failed += 1
            continue
        progress.done()
        if report.ok:
            say(
                f"ok      {report.path}: {report.blobs} blobs in {report.files} files, .metadata and the manifest, "
                f"{readable_size(report.nbytes)}: every {report.algorithm} checksum matches"
            )
        else:
            failed += 1
            say(f"CORRUPT {report.path}: {len(report.problems)} problem(s), {report.blobs} blobs read")
            for problem in report.problems:
                say(f"  {problem}")
    return 1 if failed else 0


def cmd_prune(args: argparse.Namespace) -> int:
    store = _existing_store(args)
    holder = live_holder(store)
    if holder is not None and not args.force:
        raise OverlapCkptError(
            f"{args.root} is leased by {holder.describe()}: a running job applies its own keep=. Prune it once that job "
            "has ended, or pass --force"
        )
    names = store.committed_names()  # oldest (lowest version) first
    latest = store.read_latest()
    doomed = [n for n in names[: max(0, len(names) - args.keep)] if n != latest]
    for name in doomed:
        if args.dry_run:
            say(f"would delete {store.checkpoint_url(name)}")
        else:
            store.remove_checkpoint(name)  # its commit marker first: never a half-deleted checkpoint listed
            say(f"deleted {store.checkpoint_url(name)}")
    kept = len(names) - len(doomed)
    say(f"{'would keep' if args.dry_run else 'kept'} {kept} checkpoint(s) under {args.root}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from .consolidate import ExportOptions, export_checkpoint

    store = _existing_store(args)
    name = _chosen(store, args)
    progress = Progress()
    try:
        options = ExportOptions(fmt=args.format, model_only=args.model_only, storage_options=_storage_options(args.option))
        info = export_checkpoint(store.checkpoint_url(name), args.out, options, on_stage=progress.say)
    finally:
        progress.done()
    say(f"exported step {info.step} ({readable_size(info.nbytes)} of state) from {info.path} to {args.out} ({args.format})")
    return 0


def _quiet_on_closed_pipe(command: Any, args: argparse.Namespace) -> int:
    try:
        code = int(command(args))
        sys.stdout.flush()  # here, not at exit: a reader gone by then would be reported as an ignored exception
        return code
    except BrokenPipeError:
        # The reader stopped reading (`overlapckpt inspect ROOT | head`): not an error of ours. Python
        # would report the pipe again when it flushes stdout at exit; point stdout at nothing first.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0


def cmd_build_native(args: argparse.Namespace) -> int:
    """Build the optional native helpers now, into the user's cache (they are otherwise built on first use)."""
    from .cuda_adam_native import build as build_fused_adam
    from .landing_page import build as build_landing_words
    from .train.copying.native import build as build_gather
    from .train.copying.tensor_passes import build as build_passes

    missing = 0
    for what, build in (
        ("host values gather", build_gather),
        ("hooks' passes", build_passes),
        ("fused Adam replay", build_fused_adam),
        ("landing words", build_landing_words),
    ):
        built = build()
        missing += built is None
        say(f"{what:18} {built if built is not None else 'not built: its Python twin runs (see the log for why)'}")
    return 0 if not missing else 2


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["build-native"]:  # takes no root
        return _quiet_on_closed_pipe(cmd_build_native, argparse.Namespace(command="build-native"))
    parser = argparse.ArgumentParser(prog="overlapckpt", description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, fn, helptext in (
        ("ls", cmd_ls, "list committed checkpoints"),
        ("inspect", cmd_inspect, "show one checkpoint's manifest"),
        ("verify", cmd_verify, "check every stored byte against the manifest's checksums"),
        ("prune", cmd_prune, "delete all but the newest N committed checkpoints"),
        ("export", cmd_export, "write one consolidated torch.save or safetensors file"),
    ):
        p = sub.add_parser(name, help=helptext, description=helptext)
        p.add_argument("root", help="checkpoint root: a directory or an fsspec URL")
        tiers = ("all", ROOT_TIER, LOCAL_TIER) if name == "ls" else (ROOT_TIER, LOCAL_TIER)
        p.add_argument("--tier", choices=tiers, default=tiers[0], help="which tier: the root, this node's local tier" + (", or both" if name == "ls" else ""))
        p.add_argument("--local-dir", default=None, metavar="DIR", help="the local tier's directory (default: derived from ROOT, as the Checkpointer does)")
        if name == "export":
            p.add_argument("out", help="the file to write (written beside, then renamed into place)")
        p.add_argument("-o", "--option", action="append", default=[], metavar="KEY=VALUE", help="fsspec storage option")
        if name in ("inspect", "verify", "export"):
            p.add_argument("--step", type=int, default=None, help="the checkpoint of this step (default: the newest)")
            p.add_argument("--name", default=None, metavar="DIR", help="the checkpoint directory of this name (step-000001000-1a2b3c4d)")
        if name in ("ls", "inspect"):
            p.add_argument("--json", action="store_true", help="print as JSON" if name == "ls" else "print the whole manifest as JSON")
        if name == "verify":
            p.add_argument("--all", action="store_true", help="verify every committed checkpoint")
        if name == "prune":
            p.add_argument("--keep", type=_count, required=True, help="how many of the newest committed checkpoints to keep")
            p.add_argument("--dry-run", action="store_true", help="say what would be deleted, delete nothing")
            p.add_argument("--force", action="store_true", help="prune even while a job holds the root's lease")
        if name == "export":
            p.add_argument("--format", choices=("torch", "safetensors"), default="torch", help="torch.save (default) or safetensors (the model only)")
            p.add_argument("--model-only", action="store_true", help="leave the optimizer's state out (torch format)")
        p.set_defaults(fn=fn)
    args = parser.parse_args(argv)
    if args.command != "ls" and args.tier == LOCAL_TIER:  # the local tier is a root of its own, on this node
        args.root, args.option = args.local_dir or default_local_dir(args.root), []
    # Exit codes: 0 fine, 1 a checkpoint is corrupt (verify), 2 the command could not run.
    try:
        return _quiet_on_closed_pipe(args.fn, args)
    except CheckpointReadError as e:  # storage, not the checkpoint: name what the storage said
        cause = e.__cause__ if e.__cause__ is not None else e
        say(f"overlapckpt {args.command}: {args.root}: {type(cause).__name__}: {cause}", file=sys.stderr)
        return 2
    except OverlapCkptError as e:
        say(f"overlapckpt {args.command}: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # storage unreachable (botocore's errors are not OSErrors), bad URL, missing s3fs
        say(f"overlapckpt {args.command}: {args.root}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
