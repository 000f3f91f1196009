"""The node-local tier and the native cache as trust boundaries: one test per finding of the attack on them.

``/dev/shm`` is shared by every user and container of a node; here a sticky, world-writable
scratch directory stands in for it (``tiers._SHARED_MEMORY_DIR``), and the other user's
files are chowned to uid 54321 (the tests that chown need root, as the CI runs). A hang is
caught by running the step in a child process with a timeout, never by sleeping.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import stat
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import overlapckpt.format.tiers as tiers_module
from overlapckpt import Checkpointer, list_checkpoints, load
from overlapckpt.errors import ConfigError, CorruptCheckpointError, RootLeaseError, SignatureError, UntrustedPathError
from overlapckpt.format.blob_macs import MAC_ALGORITHMS, check_mac_algorithm, mac_of, new_nonce
from overlapckpt.format.checksum import updater
from overlapckpt.format.lease import LEASE_NAME, sweep_dead_tiers
from overlapckpt.format.manifest import MANIFEST_NAME, dump_manifest
from overlapckpt.format.process_identity import this_process
from overlapckpt.format.signing import sign
from overlapckpt.format.storage import CheckpointStore
from overlapckpt.format.tensor_decode import locate
from overlapckpt.format.tiers import TIER_MARKER_NAME, default_local_dir
from overlapckpt.format.verify import verify_checkpoint
from overlapckpt.restore.held_files import encode_held
from overlapckpt.restore.node_listings import NodeListings, TierDigest, agreed_file_table, tier_listing

from helpers import assert_state_equal, make_run, snapshot, train_step, twin_states

OTHER_UID = 54321
KEY = "a signing key of at least 16 bytes"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="files of another uid: chown needs root")
_TWIN: dict[int, tuple] = {}


def _twin(step: int) -> tuple:
    if not _TWIN:
        _TWIN.update(twin_states(8))
    return _TWIN[step]


@pytest.fixture
def shm(tmp_path, monkeypatch):
    """A sticky, world-writable directory standing in for /dev/shm."""
    path = tmp_path / "shm"
    path.mkdir()
    os.chmod(path, 0o1777)
    monkeypatch.setattr(tiers_module, "_SHARED_MEMORY_DIR", str(path))
    return path


def _train(root: str, steps: int, local_dir: str | None = None, seed: int = 0, **kwargs) -> None:
    model, opt, sched, sampler = make_run(seed=seed, width=kwargs.pop("width", 16))
    kwargs.setdefault("every", 2)
    kwargs.setdefault("local_every", 2)
    with Checkpointer(model, opt, root, local_dir=local_dir, **kwargs) as ckpt:
        for _ in range(steps):
            train_step(model, opt, sched, sampler)
            ckpt.step()
        ckpt.wait(timeout_s=120)


def _load(root: str, local_dir: str | None, **kwargs):
    model, opt, _, _ = make_run(seed=7)  # other weights: a load that did nothing fails the comparison
    info = load(root, model, opt, local_dir=local_dir, **kwargs)
    return info, model, opt


def _chown_tree(path, uid: int = OTHER_UID) -> None:
    for top, dirs, files in os.walk(path):
        for name in [*dirs, *files]:
            os.lchown(os.path.join(top, name), uid, uid)
    os.lchown(path, uid, uid)


def _newest(directory: str) -> str:
    store = CheckpointStore(directory)
    return os.path.join(directory, max(store.committed_names(), key=lambda n: int(n.split("-")[1])))


def _largest_shard(checkpoint: str) -> str:
    shards = [os.path.join(checkpoint, f) for f in os.listdir(checkpoint) if f.endswith(".distcp")]
    return max(shards, key=os.path.getsize)


def _run_python(code: str, timeout_s: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    """``code`` in a child Python; a hang past ``timeout_s`` fails the test (the child is killed)."""
    full_env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.path.join(REPO, "tests"), os.environ.get("PYTHONPATH", "")])}
    full_env.update(env or {})
    try:
        return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=timeout_s, env=full_env)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"hung for {timeout_s} s: {e.stderr!r}")


# ---- 1. a rollback, then a restart: the branch latest names ------------------------------


def test_01_a_restart_after_a_rollback_resumes_the_branch_latest_names_and_the_tier_drops_the_abandoned_one(tmp_path, monkeypatch):
    """Before: restore() chose between the branches' equal versions by run id; the first run's id here sorts above
    any the rollback derives (run_identity.new_run_id), so it returned the abandoned branch's 6 every time.

    The tier's retention drops the abandoned branch once the new one commits; a crash between a commit and its
    retention leaves it, which is planted here from the root (which keeps abandoned branches)."""
    import overlapckpt.train.run.run_identity as run_identity

    monkeypatch.setattr(run_identity, "new_run_id", lambda: "f" * 32)
    root, local = str(tmp_path / "root"), str(tmp_path / "local")
    model, opt, sched, sampler = make_run()
    branch: dict[int, tuple] = {}
    with Checkpointer(model, opt, root, every=2, local_every=2, local_keep=3, local_dir=local) as ckpt:
        for _ in range(6):
            train_step(model, opt, sched, sampler)
            ckpt.step()
        ckpt.wait(timeout_s=120)
        abandoned_run = ckpt._lineage.run_id
        assert ckpt.restore(step=2).step == 2
        for step in range(3, 7):
            train_step(model, opt, sched, sampler)  # the sampler went on: other batches, another branch
            ckpt.step()
            branch[step] = snapshot(model, opt)
        ckpt.wait(timeout_s=120)
        run = ckpt._lineage.run_id
    held = sorted(os.listdir(local))
    assert not [n for n in held if n.startswith("step-") and n.endswith(abandoned_run[:8]) and n.split("-")[1] in ("000000004", "000000006")], held
    assert abandoned_run > run
    for version in (4, 6):
        shutil.copytree(os.path.join(root, f"step-00000000{version}"), os.path.join(local, f"step-00000000{version}"))
    for step in (None, 4, 6):
        info, model2, opt2 = _load(root, local, step=step)
        assert (info.step, info.run_id) == (step or 6, run)
        assert_state_equal(*branch[info.step], model2, opt2)


def test_01_among_equal_versions_the_run_latest_names_wins_whatever_the_run_ids(tmp_path):
    """The choice among the tiers' equal versions: the run on latest's lineage, even where the other's id sorts higher."""
    abandoned, current = "f" * 32, "0" * 32
    # Each: .metadata and the manifest (its only files), both held, 10 bytes each.
    listing = {
        f"step-000000006-{abandoned[:8]}": TierDigest(6, abandoned, b"a" * 32, 2, encode_held(0b11, 2), 10, 10),
        f"step-000000006-{current[:8]}": TierDigest(6, current, b"c" * 32, 2, encode_held(0b11, 2), 10, 10),
    }
    tiers = NodeListings.from_gathered([("node", listing)], lineage={current: 2**62, abandoned: 2})
    assert tiers.newest_complete(None, None) == (f"step-000000006-{current[:8]}", 6)
    assert tiers.newest_complete(6, None) == (f"step-000000006-{current[:8]}", 6)


# ---- 2. relative roots -------------------------------------------------------------------


def test_02_two_projects_with_the_same_relative_root_never_share_a_tier(tmp_path, shm, monkeypatch):
    """Before: both "ckpts" hashed alike, and project B, with an empty ckpts/, restored project A's step 6."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b" / "ckpts").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "a")
    tier_a = default_local_dir("ckpts")
    _train("ckpts", 6, every=100)
    monkeypatch.chdir(tmp_path / "b")
    assert default_local_dir("ckpts") != tier_a
    # As the store opens it: "~/ckpts" is a directory "~" here, not the home's ckpts (before: both hashed alike).
    assert default_local_dir("~/ckpts") != default_local_dir(os.path.expanduser("~/ckpts"))
    model, opt, _, _ = make_run(seed=7)
    assert load("ckpts", model, opt, local_dir=default_local_dir("ckpts"), missing_ok=True) is None


# ---- 3. a tier made by another user; a forged shard of a signed one -----------------------


def _plant_checkpoint(tmp_path, victim_root: str, into: str, steps: int) -> None:
    """Another run's checkpoints, its latest and a marker naming the victim's root, copied into ``into``."""
    other = str(tmp_path / "attacker-run")
    _train(other, steps, every=steps, local_every=None)
    os.makedirs(into, exist_ok=True)
    for name in os.listdir(other):
        if name.startswith("step-") or name == "latest":
            source = os.path.join(other, name)
            (shutil.copytree if os.path.isdir(source) else shutil.copy)(source, os.path.join(into, name))
    marker = {"format": 1, "root": os.path.realpath(victim_root), "uid": OTHER_UID}
    with open(os.path.join(into, TIER_MARKER_NAME), "w") as f:
        json.dump(marker, f)


@needs_root
def test_03_a_tier_another_user_made_first_is_refused_by_name_and_the_root_restores(tmp_path, shm):
    """Before: restore() loaded the plant (version 8) from the pre-created 0777 directory of uid 54321."""
    root = str(tmp_path / "root")
    _train(root, 4, every=4, local_every=None)
    planted = default_local_dir(root)
    _plant_checkpoint(tmp_path, root, planted, steps=8)
    _chown_tree(planted)
    os.chmod(planted, 0o777)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        info, model, opt = _load(root, planted)
    assert info.step == 4
    assert_state_equal(*_twin(4), model, opt)
    assert any(f"the node-local tier {planted} is not read" in str(w.message) and f"owned by uid {OTHER_UID}" in str(w.message) for w in caught)
    model, opt, _, _ = make_run()
    with pytest.raises(UntrustedPathError, match=f"{planted}.*owned by uid {OTHER_UID}.*pass local_dir="):
        Checkpointer(model, opt, root, local_every=2)


def _forge_keeping_the_crc(checkpoint: str) -> None:
    """Change a float in the largest tensor blob of ``checkpoint`` and fix 4 bytes of its data so its CRC stays the same.

    A CRC is affine over GF(2): the 4 fix-up bytes that cancel the change solve 32 linear equations.
    """
    sums = json.loads(open(os.path.join(checkpoint, MANIFEST_NAME), "rb").read())["checksums"]
    algorithm = sums["algorithm"]
    shard, blob = max(((f, b) for f, e in sums["files"].items() for b in e["blobs"]), key=lambda fb: fb[1]["length"])
    shard = os.path.join(checkpoint, shard)
    data = bytearray(open(shard, "rb").read())
    record = locate(memoryview(data)[blob["offset"] : blob["offset"] + blob["length"]])
    assert record is not None and record.data_end - record.data_start >= 16
    record_start, record_end = blob["offset"] + record.data_start, blob["offset"] + record.data_end
    update = updater(algorithm)
    start, end = record_start, record_end

    def crc(buf: bytearray) -> int:
        return update(bytes(buf[start:end]), 0)

    wanted = crc(data)
    data[start : start + 4] = torch.tensor([123.0]).numpy().tobytes()  # the forged value
    fix = end - 4
    data[fix:end] = b"\0\0\0\0"
    base = crc(data)
    columns = []
    for bit in range(32):
        probe = bytearray(data)
        probe[fix + bit // 8] ^= 1 << (bit % 8)
        columns.append(crc(probe) ^ base)
    # Gaussian elimination: which fix-up bits XOR to base ^ wanted.
    rows = [(columns[i], 1 << i) for i in range(32)]
    basis: list[tuple[int, int]] = []
    for value, combo in rows:
        for b_value, b_combo in basis:
            if value ^ b_value < value:
                value, combo = value ^ b_value, combo ^ b_combo
        if value:
            basis.append((value, combo))
            basis.sort(reverse=True)
    target, chosen = base ^ wanted, 0
    for b_value, b_combo in basis:
        if target ^ b_value < target:
            target, chosen = target ^ b_value, chosen ^ b_combo
    assert target == 0, "the CRC's fix-up bits span every value"
    for bit in range(32):
        if chosen >> bit & 1:
            data[fix + bit // 8] ^= 1 << (bit % 8)
    assert crc(data) == wanted
    with open(shard, "r+b") as f:
        f.write(data)


def test_03_with_a_key_a_tier_shard_forged_to_keep_its_crc_is_refused_and_an_authentic_one_restores(tmp_path):
    """Before: the forged tensor of the signed tier checkpoint passed every CRC and was loaded without a warning."""
    root, local = str(tmp_path / "root"), str(tmp_path / "local")
    _train(root, 6, local_dir=local, every=4, signing_key=KEY)
    newest = _newest(local)
    _forge_keeping_the_crc(newest)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        info, model, opt = _load(root, local, signing_key=KEY)
    assert info.step == 4
    assert_state_equal(*_twin(4), model, opt)
    refusal = re.compile(r"refused .*keyed digest \(MAC\) of .* does not match the signed manifest's: forged")
    assert any(refusal.search(str(w.message)) for w in caught), [str(w.message) for w in caught]
    report = verify_checkpoint(CheckpointStore(local), os.path.basename(newest), signing_key=KEY.encode())
    assert not report.ok and any("MAC mismatch" in p for p in report.problems), report.problems


def test_03_a_signed_manifest_without_blob_macs_is_refused_with_a_key(tmp_path):
    """A manifest signed by an overlapckpt that did not MAC its blobs: with a key its shards would go unauthenticated."""
    root = str(tmp_path / "root")
    _train(root, 2, every=2, local_every=None, signing_key=KEY)
    checkpoint = _newest(root)
    document = json.loads(open(os.path.join(checkpoint, MANIFEST_NAME), "rb").read())
    document.pop("signature")
    document["checksums"].pop("mac_algorithm", None)
    for entry in document["checksums"]["files"].values():
        entry.pop("mac_nonce", None)
        for blob in entry["blobs"]:
            blob.pop("mac", None)
    document.pop("manifest_crc32", None)
    sign(document, open(os.path.join(checkpoint, ".metadata"), "rb").read(), KEY.encode())
    with open(os.path.join(checkpoint, MANIFEST_NAME), "wb") as f:
        f.write(dump_manifest(document))
    with pytest.raises(SignatureError, match="no keyed digests of its shards.*Load it without a key only if you trust"):
        _load(root, None, signing_key=KEY)
    info, model, opt = _load(root, None)  # without a key: the CRCs, as before
    assert_state_equal(*_twin(2), model, opt)


def test_03_with_a_key_a_forged_root_shard_is_refused_even_with_verify_false(tmp_path):
    """The key's promise holds whatever verify says: every blob read is checked against its MAC."""
    root = str(tmp_path / "root")
    _train(root, 2, every=2, local_every=None, signing_key=KEY)
    _forge_keeping_the_crc(_newest(root))
    for verify in (True, False):
        with pytest.raises(CorruptCheckpointError, match=r"keyed digest \(MAC\) of .* does not match the signed manifest's"):
            _load(root, None, signing_key=KEY, verify=verify)
    info, model, opt = _load(root, None)  # without a key, only CRCs: the forgery passes, as docs/security.md says
    tensors = [*model.state_dict().values(), *(v for st in opt.state_dict()["state"].values() for v in st.values() if torch.is_tensor(v))]
    assert info.step == 2 and any(t.numel() > 1 and float(t.flatten()[0]) == 123.0 for t in tensors)


@pytest.mark.parametrize("algorithm", MAC_ALGORITHMS)
def test_03_blob_macs_are_keyed_per_blob_and_independent_of_how_the_bytes_are_split(algorithm):
    signing_key, nonce = KEY.encode(), new_nonce()
    data = os.urandom(100_000)
    whole = mac_of(signing_key, algorithm, nonce, 64, data)
    assert mac_of(signing_key, algorithm, nonce, 64, data[:13], memoryview(data)[13:70_001], data[70_001:]) == whole
    assert mac_of(signing_key, algorithm, nonce, 128, data) != whole  # another blob's key
    assert mac_of(b"another key, sixteen bytes or more", algorithm, nonce, 64, data) != whole
    assert mac_of(signing_key, algorithm, new_nonce(), 64, data) != whole
    forged = bytearray(data)
    forged[50_000] ^= 1
    assert mac_of(signing_key, algorithm, nonce, 64, bytes(forged)) != whole
    with pytest.raises(ConfigError, match="names the blob MAC 'md5'.*knows"):
        check_mac_algorithm("md5", "OVERLAPCKPT_BLOB_MAC='md5'")


# ---- 4. modes ------------------------------------------------------------------------------


def test_04_the_tier_is_readable_by_its_user_only(tmp_path):
    """Before: directories 0755, shards and manifests 0644."""
    root, local = str(tmp_path / "root"), str(tmp_path / "local")
    _train(root, 4, local_dir=local, every=100)
    modes = {}
    for top, dirs, files in os.walk(local):
        for name in [*dirs, *files]:
            modes[os.path.relpath(os.path.join(top, name), local)] = stat.S_IMODE(os.lstat(os.path.join(top, name)).st_mode)
    modes["."] = stat.S_IMODE(os.stat(local).st_mode)
    assert any(name.endswith(".distcp") for name in modes)
    loose = {name: oct(mode) for name, mode in modes.items() if mode & 0o077}
    assert not loose, loose


# ---- 5, 6. the sweep and the leases ------------------------------------------------------


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(timeout=60)
    return child.pid


def test_05_the_sweep_never_deletes_a_durable_root_that_merely_shares_the_prefix(tmp_path, shm):
    """Before: construction removed shm/overlapckpt-run1, a durable root whose lease named a dead pid."""
    durable = shm / "overlapckpt-run1"
    _train(str(durable), 2, every=2, local_every=None)
    dead = {"host": this_process().host, "pid": _dead_pid(), "run_id": "x" * 32, "since_unix_s": 0.0}
    (durable / LEASE_NAME).write_text(json.dumps(dead))
    root = str(tmp_path / "root")
    _train(root, 2, every=100)  # its tier is a sibling in shm: construction sweeps
    assert (durable / "latest").is_file() and list_checkpoints(str(durable))


def test_06_a_tier_and_a_root_leased_from_another_pid_namespace_are_never_taken_for_dead(tmp_path, shm):
    """Before: a lease names host and pid only; a live container's job (another PID namespace) was taken for gone."""
    neighbour = shm / "overlapckpt-neighbour-0123456789ab"
    neighbour.mkdir(mode=0o700)
    (neighbour / TIER_MARKER_NAME).write_text(json.dumps({"format": 1, "root": "/elsewhere", "uid": os.geteuid()}))
    me = this_process()
    other_space = {**me.fields(), "pid": _dead_pid(), "pid_namespace": "pid:[4026599999]"}
    lease = json.dumps({**other_space, "run_id": "y" * 32, "since_unix_s": 0.0})
    (neighbour / LEASE_NAME).write_text(lease)
    assert sweep_dead_tiers(str(shm / "overlapckpt-mine")) == []
    assert neighbour.is_dir()
    root = tmp_path / "root"
    root.mkdir()
    (root / LEASE_NAME).write_text(lease)
    model, opt, _, _ = make_run()
    with pytest.raises(RootLeaseError, match="in another PID namespace or boot"):
        Checkpointer(model, opt, str(root))


# ---- 7. local_dir through a symlink ---------------------------------------------------------


def test_07_a_local_dir_that_is_a_symlink_to_the_root_is_refused(tmp_path):
    """Before: the settings compared abspath; with lease=False local_keep deleted root checkpoints keep=None kept."""
    root = tmp_path / "root"
    root.mkdir()
    (tmp_path / "link").symlink_to(root)
    model, opt, _, _ = make_run()
    with pytest.raises(ConfigError, match=f"local_dir.*{root}"):
        Checkpointer(model, opt, str(root), local_dir=str(tmp_path / "link"), local_every=1, local_keep=1, lease=False)


# ---- 8. FIFOs and device links planted as small files --------------------------------------


def _marker_for(root: str) -> str:
    return json.dumps({"format": 1, "root": os.path.realpath(root), "uid": os.geteuid()})


def test_08_a_fifo_or_a_dev_zero_link_as_a_siblings_lease_hangs_no_construction(tmp_path, shm):
    """Before: a FIFO as a sibling tier's lease hung Checkpointer(); a lease linked to /dev/zero raised MemoryError."""
    for name in ("overlapckpt-fifo-000000000000", "overlapckpt-zero-000000000000"):
        sibling = shm / name
        sibling.mkdir(mode=0o700)
        (sibling / TIER_MARKER_NAME).write_text(_marker_for(str(tmp_path / name)))
        if "fifo" in name:
            os.mkfifo(sibling / LEASE_NAME)
        else:
            os.symlink("/dev/zero", sibling / LEASE_NAME)
    done = _run_python(f"""
        import overlapckpt.format.tiers as tiers
        tiers._SHARED_MEMORY_DIR = {str(shm)!r}
        from helpers import make_run
        from overlapckpt import Checkpointer
        model, opt, _, _ = make_run()
        with Checkpointer(model, opt, {str(tmp_path / "root")!r}, local_every=2):
            print("constructed")
    """)
    assert done.returncode == 0 and "constructed" in done.stdout, done.stderr[-2000:]
    assert (shm / "overlapckpt-fifo-000000000000").is_dir() and (shm / "overlapckpt-zero-000000000000").is_dir()


def test_08_a_fifo_as_the_roots_lease_manifest_or_latest_hangs_no_reader(tmp_path):
    """Before: each of these hung Checkpointer(), load, list_checkpoints or overlapckpt ls. Now the lease is refused by
    name, and the checkpoint whose manifest is a FIFO is skipped with a warning naming it."""
    root = tmp_path / "root"
    _train(str(root), 4, every=2, local_every=None)
    os.mkfifo(root / LEASE_NAME)
    done = _run_python(f"""
        from helpers import make_run
        from overlapckpt import Checkpointer
        from overlapckpt.errors import RootLeaseError
        model, opt, _, _ = make_run()
        try:
            Checkpointer(model, opt, {str(root)!r})
        except RootLeaseError as e:
            print("refused:", e)
    """)
    assert "refused: checkpoint root" in done.stdout and "an unreadable lease file" in done.stdout, done.stderr[-2000:]
    os.unlink(root / LEASE_NAME)
    manifest = root / "step-000000004" / MANIFEST_NAME
    os.unlink(manifest)
    os.mkfifo(manifest)
    os.unlink(root / "latest")
    os.mkfifo(root / "latest")
    done = _run_python(f"""
        from helpers import make_run
        from overlapckpt import list_checkpoints, load
        from overlapckpt.errors import OverlapCkptError
        print("listed", [c.step for c in list_checkpoints({str(root)!r})])
        model, opt, _, _ = make_run(seed=7)
        try:
            print("loaded", load({str(root)!r}, model, opt).step)
        except OverlapCkptError as e:
            print("refused:", type(e).__name__, e)
    """)
    assert "listed [2]" in done.stdout, done.stdout + done.stderr[-2000:]
    assert "loaded 2" in done.stdout and str(manifest) in done.stderr, done.stdout + done.stderr[-2000:]
    cli = subprocess.run([sys.executable, "-m", "overlapckpt", "ls", str(root)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": REPO})
    assert cli.returncode == 0 and "step-000000002" in cli.stdout, cli.stdout + cli.stderr


# ---- 9, 10. refusals fall back ----------------------------------------------------------------


def test_09_a_dangling_link_in_a_tier_checkpoint_falls_back_with_a_warning_even_with_a_key(tmp_path, caplog):
    """Before: tier_listing's getsize raised FileNotFoundError, before any fallback, key or not."""
    root, local = str(tmp_path / "root"), str(tmp_path / "local")
    _train(root, 6, local_dir=local, every=4, signing_key=KEY)
    shard = _largest_shard(_newest(local))
    os.unlink(shard)
    os.symlink(str(tmp_path / "nowhere"), shard)
    with caplog.at_level(logging.WARNING, logger="overlapckpt"):
        info, model, opt = _load(root, local, signing_key=KEY)
    assert info.step == 4
    assert_state_equal(*_twin(4), model, opt)
    assert any(shard in r.getMessage() and "not a regular file" in r.getMessage() for r in caplog.records), caplog.text


def test_10_a_checkpoint_of_other_shapes_in_the_tier_falls_back_to_the_root(tmp_path):
    """Before: CheckpointMismatchError was not a fallback error: the restart stopped."""
    root, local = str(tmp_path / "root"), str(tmp_path / "local")
    _train(root, 4, local_dir=local, every=4)
    other = str(tmp_path / "other")
    _train(other, 8, every=8, local_every=None, width=32)
    shutil.copytree(os.path.join(other, "step-000000008"), os.path.join(local, "step-000000008"))
    with open(os.path.join(local, "latest"), "w") as f:
        f.write("step-000000008")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        info, model, opt = _load(root, local)
    assert info.step == 4
    assert any("step-000000008 was refused (CheckpointMismatchError" in str(w.message) for w in caught)
    assert_state_equal(*_twin(4), model, opt)


# ---- 11. the cross-node fetch ----------------------------------------------------------------


def test_11_the_fetch_copies_no_link_and_only_the_signed_manifests_sizes(tmp_path):
    """Before: a symlinked .metadata was listed (and sent) as held; a planted 64 GiB .metadata was planned as a copy."""
    root, local = str(tmp_path / "root"), str(tmp_path / "local")
    _train(root, 4, local_dir=local, every=100)
    newest = _newest(local)
    name = os.path.basename(newest)
    secret = tmp_path / "secret"
    shutil.copy(os.path.join(newest, ".metadata"), secret)
    os.chmod(secret, 0o600)
    os.unlink(os.path.join(newest, ".metadata"))
    os.symlink(secret, os.path.join(newest, ".metadata"))
    listing = tier_listing(local, 1, root)
    table = agreed_file_table(local, name, listing[name])
    assert not listing[name].held() >> table.index[".metadata"] & 1
    tiers = NodeListings.from_gathered([("a", listing), ("b", {})])
    assert tiers.newest_complete(4, None) is None or tiers.newest_complete(4, None)[0] != name
    os.unlink(os.path.join(newest, ".metadata"))
    with open(os.path.join(newest, ".metadata"), "wb") as f:
        f.truncate(64 << 30)  # sparse: 64 GiB that cost nothing here
    listing = tier_listing(local, 1, root)
    tiers = NodeListings.from_gathered([("a", listing), ("b", {})])
    choice = tiers.newest_complete(4, None)
    if choice is not None and choice[0] == name:
        planned = tiers.head_copies(name)
        tiers.received(name, planned)
        planned += tiers.copies(name, agreed_file_table(local, name, listing[name]), {"a": None, "b": None})
    else:
        planned = []
    assert all(copy.nbytes < 1 << 30 for copy in planned), planned


# ---- 12, 13, 14. the native cache --------------------------------------------------------------

needs_cc = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")
_PLANTED_C = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen(getenv("PLANT_MARKER"), "w");
    if (f) { fputs("ran", f); fclose(f); }
}
void gather_values(void) {}
"""


@needs_root
@needs_cc
def test_12_a_library_planted_in_a_shared_cache_never_runs(tmp_path):
    """Before: with XDG_CACHE_HOME=/tmp, a .so another user planted under the computable name ran inside this process."""
    shared = tmp_path / "tmp"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    named = _run_python("from overlapckpt.train.copying.native import library_path; print(library_path().name)",
                        env={"XDG_CACHE_HOME": str(tmp_path / "private")})
    name = named.stdout.strip()
    assert name.endswith(".so"), named.stderr
    cache = shared / "overlapckpt"
    cache.mkdir()
    os.chmod(cache, 0o777)
    (tmp_path / "planted.c").write_text(_PLANTED_C)
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(cache / name), str(tmp_path / "planted.c")], check=True, timeout=120)
    _chown_tree(cache)
    marker = tmp_path / "ran"
    done = _run_python("from overlapckpt.train.copying.native import gather_library; print('loaded', gather_library() is not None)",
                       env={"XDG_CACHE_HOME": str(shared), "PLANT_MARKER": str(marker)})
    assert done.returncode == 0 and "loaded False" in done.stdout, done.stdout + done.stderr
    assert not marker.exists()
    assert f"{cache}" in done.stderr and f"owned by uid {OTHER_UID}" in done.stderr, done.stderr


@needs_cc
def test_13_a_truncated_library_is_rebuilt_and_never_loaded(tmp_path):
    """Before: the truncated .so killed the process with SIGBUS inside dlopen."""
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    built = _run_python("from overlapckpt.train.copying.native import build; print(build())", env=env).stdout.strip()
    assert built.endswith(".so")
    size = os.path.getsize(built)
    with open(built, "r+b") as f:
        f.truncate(size // 2)
    done = _run_python("from overlapckpt.train.copying.native import gather_library; print('loaded', gather_library() is not None)", env=env)
    assert done.returncode == 0, f"the child died with {done.returncode}: {done.stderr[-2000:]}"
    assert "loaded True" in done.stdout and "removed, and built again" in done.stderr, done.stdout + done.stderr
    assert os.path.getsize(built) == size


@needs_cc
def test_14_a_library_built_by_another_compiler_or_with_other_flags_is_never_reused(tmp_path):
    """Before: the cache key was the source alone: a fused_adam_cuda built without -ffp-contract=off would be reused."""
    wrapper = tmp_path / "cc-fast"
    wrapper.write_text('#!/bin/sh\nexec cc -ffp-contract=fast "$@"\n')
    os.chmod(wrapper, 0o755)
    code = "from overlapckpt.cuda_adam_native import library_path; print(library_path())"
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    plain = _run_python(code, env={**env, "CC": "cc"}).stdout.strip()
    other = _run_python(code, env={**env, "CC": str(wrapper)}).stdout.strip()
    assert plain.endswith(".so") and other.endswith(".so") and plain != other
    from overlapckpt.cbuild import c_library_path
    from overlapckpt.cuda_adam_native import FLAGS, LIBRARIES, SOURCE

    without = [flag for flag in FLAGS if flag != "-ffp-contract=off"]
    assert c_library_path(SOURCE, "cuda_adam", FLAGS, LIBRARIES) != c_library_path(SOURCE, "cuda_adam", without, LIBRARIES)


# ---- the ranks of a node prepare its tier at once ---------------------------------------------


def _prepare(directory: str, root: str, barrier, failures) -> None:
    from overlapckpt.format.tiers import prepare_tier

    barrier.wait(timeout=60)
    try:
        prepare_tier(directory, root)
    except Exception as e:  # noqa: BLE001 - reported to the test
        failures.put(f"{type(e).__name__}: {e}")


def test_the_ranks_of_a_node_mark_its_tier_at_once_without_refusing_each_other(tmp_path):
    """Before: the marker was written in place, and a rank that read it half-written refused the tier
    (UntrustedPathError in 14 of 60 rounds of 4 processes): its peers then waited 180 s in the run id's broadcast."""
    import multiprocessing

    context = multiprocessing.get_context("fork")
    failures = context.Queue()
    for round_ in range(20):
        barrier = context.Barrier(4)
        ranks = [context.Process(target=_prepare, args=(str(tmp_path / f"tier{round_}"), str(tmp_path / "root"), barrier, failures))
                 for _ in range(4)]
        for rank in ranks:
            rank.start()
        for rank in ranks:
            rank.join(timeout=120)
            assert rank.exitcode == 0
        assert failures.empty(), failures.get()
        assert json.loads((tmp_path / f"tier{round_}" / TIER_MARKER_NAME).read_text())["root"] == os.path.realpath(tmp_path / "root")
        assert [n for n in os.listdir(tmp_path / f"tier{round_}") if "partial" in n] == []
