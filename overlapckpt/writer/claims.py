"""The writers' claims: how every rank's writer agrees on each checkpoint through a key-value store.

Per checkpoint (a sequence number, the same count on every rank), each writer posts
its claim (name, version, requested step) under ``claim/<seq>/<rank>`` and marks
``posted/<seq>``. The coordinating writer (rank 0) waits for every rank's claim, up to the
agreement timeout, compares them and posts one verdict under ``verdict/<seq>``: agreed, or
the refusal every rank raises. Every other writer waits for that verdict alone. A claim
also carries this rank's own shapes digest, left out of the comparison; the verdict says
whether every rank may reuse its union of the ranks' shape tables (``shape_union.py``).
So a rank makes O(1) store requests per checkpoint and the coordinator O(N): O(N) at the
store's server, where every rank reading every claim made it O(N^2) (``benchmarks/scale.py``,
``docs/scale.md``). An idle writer checks only ``posted/<seq>`` (one request per poll,
whatever the world size), and reads the claims themselves only once that marker has stood
for the agreement timeout. Each rank deletes its own claim key once the checkpoint is
decided (rank 0 the marker and the verdict too), so keys do not pile up.

Every value is sealed (``sealed_store.py``): a claim this run's writers did not write,
or one that is not a JSON object of the expected fields, is a named refusal,
``RankDisagreementError``, never a writer crash; a forged marker alone (no rank's
sealed claim behind it) makes no idle writer refuse anything.

The trust model is torch.distributed's: whoever can reach the store can write keys.
The keys live under a prefix drawn at random on rank 0 and shared over the training
group, and the store is the job's own where it can be reused (``train/run/distributed.py``).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

from ..errors import RankDisagreementError, WritersRegroupedError
from .shape_union import union_reusable

log = logging.getLogger("overlapckpt")

_CLAIM_KEY = "claim/{sequence}/{rank}"
_POSTED_KEY = "posted/{sequence}"
_VERDICT_KEY = "verdict/{sequence}"
COORDINATOR_RANK = 0  # the writer that compares the claims and posts the verdict
_CLAIM_FIELDS = {"name": str, "version": int, "requested": int}
# With a local tier: the tiers it goes to ("local,root"), so ranks that would write different tiers disagree here
# instead of entering different collectives.
# A rank whose writer failed before it could claim the checkpoint properly (preparing its save) still
# claims it, with its error: the coordinator refuses the checkpoint at once, naming it, and the ranks'
# claim sequences stay in step.
FAILED_FIELD = "failed"
_OPTIONAL_CLAIM_FIELDS = {"tiers": str, FAILED_FIELD: str}
# This rank's own fact, not part of what the ranks must agree on: its shape table's digest and the
# gather its cached union came from (shape_union.py). The coordinator's verdict says whether every
# rank may reuse its union.
SHAPES_FIELD = "shapes"
# Also this rank's own (window="auto"): the window it proposes for the next checkpoint. The
# verdict carries the widest any rank proposed, which every rank then uses: what an
# all-gather of the proposals after the commit decided before, without that collective.
NEXT_WINDOW_FIELD = "next_window"
# Also this rank's own: its local save plan's digest and the plan round its cached plan came from
# (save_plans.py). The verdict says whether every rank may skip DCP's plan round.
PLANS_FIELD = "plans"
_OWN_FIELDS = (SHAPES_FIELD, NEXT_WINDOW_FIELD, PLANS_FIELD)
_MAX_SHOWN_BYTES = 120
# While waiting for the other ranks' claims, look this often whether a writer was replaced.
_MOVED_POLL_S = 0.25


@dataclass(frozen=True)
class Agreement:
    """What the ranks agreed on a checkpoint: its sequence number, and whether every rank may reuse its shape union."""

    sequence: int
    shapes_unchanged: bool = False
    next_window: int | None = None  # the widest window any rank proposed for the next checkpoint (None: none did)
    plans_unchanged: bool = False  # every rank may reuse its save plan from the last plan round (save_plans.py)


class KeyValueStore(Protocol):
    """The part of ``SealedStore`` the claims use."""

    def set(self, key: str, value: str) -> None: ...

    def get(self, key: str) -> str | None: ...

    def read_raw(self, key: str) -> bytes | None: ...

    def read_posted(self, keys: list[str]) -> list[bytes | None]: ...

    def open(self, key: str, raw: bytes) -> str | None: ...

    def check(self, keys: list[str]) -> bool: ...

    def wait(self, keys: list[str], timeout: timedelta) -> None: ...

    def delete_key(self, key: str) -> bool: ...


def parse_claim(text: str) -> dict[str, Any]:
    """A claim as posted, or ``{"malformed": <what was there>}`` for anything else."""
    try:
        claim = json.loads(text)
    except ValueError:
        return {"malformed": text[:_MAX_SHOWN_BYTES]}
    if claim == {"requested": None}:
        return claim  # a refusal: that rank requested no checkpoint in time
    fields = {**_CLAIM_FIELDS, **_OPTIONAL_CLAIM_FIELDS, SHAPES_FIELD: str, NEXT_WINDOW_FIELD: int, PLANS_FIELD: str}
    if not isinstance(claim, dict) or not set(_CLAIM_FIELDS) <= set(claim) <= set(fields) or any(
        not isinstance(claim[k], fields[k]) or isinstance(claim[k], bool) for k in claim
    ):
        return {"malformed": json.dumps(claim)[:_MAX_SHOWN_BYTES]}
    return claim


def describe(claims: dict[int, dict[str, Any]]) -> str:
    parts = []
    for rank, c in sorted(claims.items()):
        if "malformed" in c:
            parts.append(f"rank {rank}'s claim is malformed ({c['malformed']!r}: not written by overlapckpt)")
        elif "forged" in c:
            parts.append(
                f"rank {rank}'s claim is forged ({c['forged']!r}: not sealed by this run's writers, so written by another "
                "client of the store, not written by overlapckpt)"
            )
        elif c.get("requested") is None:
            parts.append(f"rank {rank} requested none")
        else:
            tiers = f", to {c['tiers']}" if "tiers" in c else ""
            parts.append(f"rank {rank} requested it after step {c['requested']} (version {c['version']}{tiers})")
    return ", ".join(parts)


class ClaimBoard:
    """This rank's side of the claims, over ``store`` (already prefixed for this run)."""

    def __init__(
        self, store: KeyValueStore, rank: int, world_size: int, agreement_timeout_s: float, moved: Callable[[], bool] | None = None
    ) -> None:
        self.store = store
        self.moved = moved  # whether the writers' group moved to a new generation (group.py)
        self.rank = rank
        self.world_size = world_size
        self.agreement_timeout_s = agreement_timeout_s
        self.sequence = 0  # checkpoints decided (committed or refused) so far: the same count on every rank
        self._unmatched_since: float | None = None

    def _key(self, sequence: int, rank: int) -> str:
        return _CLAIM_KEY.format(sequence=sequence, rank=rank)

    def _post(self, sequence: int, claim: dict[str, Any]) -> None:
        self.store.set(self._key(sequence, self.rank), json.dumps(claim, sort_keys=True))
        self.store.set(_POSTED_KEY.format(sequence=sequence), str(self.rank))  # after the claim it announces

    def _claims(self, sequence: int, waited: bool = False) -> dict[int, dict[str, Any]]:
        """The claims posted for ``sequence``, by rank: one request after a wait saw them all (``waited``), else one per rank."""
        keys = [self._key(sequence, r) for r in range(self.world_size)]
        # Neither read waits for a key deleted since (by another client): it is absent.
        raws = self.store.read_posted(keys) if waited else [self.store.read_raw(key) for key in keys]
        out = {}
        for r, (key, raw) in enumerate(zip(keys, raws)):
            if raw is None:
                continue
            text = self.store.open(key, raw)
            out[r] = {"forged": raw[:_MAX_SHOWN_BYTES].decode("utf-8", "replace")} if text is None else parse_claim(text)
        return out

    def agree(self, claim: dict[str, Any]) -> Agreement:
        """Post this rank's claim for the next checkpoint; what was agreed, or RankDisagreementError."""
        sequence = self.sequence
        self.sequence += 1
        self._unmatched_since = None
        self._post(sequence, claim)
        if self.rank == COORDINATOR_RANK:
            verdict = self._decide(sequence, claim)
            self._post_verdict(sequence, verdict)
        else:
            verdict = self._verdict(sequence)
        if verdict.refusal is not None:
            raise RankDisagreementError(verdict.refusal)
        return Agreement(sequence, verdict.shapes_unchanged, verdict.next_window, verdict.plans_unchanged)

    def _decide(self, sequence: int, claim: dict[str, Any]) -> _Verdict:
        """The coordinator's verdict on every rank's claim: agreed when all match its own, else the refusal's text."""
        try:
            self._wait([self._key(sequence, r) for r in range(self.world_size)], sequence, self.agreement_timeout_s)
        except WritersRegroupedError:
            raise
        except Exception:  # the store's timeout error type differs between torch releases
            return _Verdict(self._missing_claims(sequence, self._claims(sequence)))
        claims = self._claims(sequence, waited=True)
        if len(claims) < self.world_size:  # posted, then deleted by another client of the store before this read
            return _Verdict(self._missing_claims(sequence, claims))
        failed = {r: c[FAILED_FIELD] for r, c in sorted(claims.items()) if FAILED_FIELD in c}
        if failed:
            return _Verdict(
                f"checkpoint #{sequence}: "
                + "; ".join(f"the writer of rank {r} failed before it: {text}" for r, text in failed.items())
                + "; nothing was committed"
            )
        mine = _agreed_part(parse_claim(json.dumps(claim, sort_keys=True)))
        if any(_agreed_part(c) != mine for c in claims.values()):
            return _Verdict(_disagreement(sequence, claims))
        proposals = [c[NEXT_WINDOW_FIELD] for c in claims.values() if NEXT_WINDOW_FIELD in c]
        return _Verdict(
            None,
            union_reusable([str(claims[r].get(SHAPES_FIELD, "")) for r in range(self.world_size)]),
            max(proposals) if proposals else None,
            # A claim without the field (no plan of its own to reuse) makes every rank plan again.
            union_reusable([str(claims[r].get(PLANS_FIELD, "")) for r in range(self.world_size)]),
        )

    def _post_verdict(self, sequence: int, verdict: _Verdict) -> None:
        text = json.dumps(
            {
                "refused": verdict.refusal,
                "shapes_unchanged": verdict.shapes_unchanged,
                "next_window": verdict.next_window,
                "plans_unchanged": verdict.plans_unchanged,
            }
        )
        self.store.set(_VERDICT_KEY.format(sequence=sequence), text)

    def _verdict(self, sequence: int) -> _Verdict:
        """The coordinator's verdict, waited for up to twice the agreement timeout.

        The coordinator may reach this checkpoint up to one timeout after this rank, and
        then wait one timeout for the last claim.
        """
        key = _VERDICT_KEY.format(sequence=sequence)
        try:
            self._wait([key], sequence, 2 * self.agreement_timeout_s)
        except WritersRegroupedError:
            raise
        except Exception as e:  # the coordinator's writer died or never came: say what the claims show
            raise RankDisagreementError(self._missing_claims(sequence, self._claims(sequence), verdict_missing=True)) from e
        raw = self.store.read_raw(key)
        if raw is None:
            raise RankDisagreementError(
                f"checkpoint #{sequence}: the verdict was posted, then deleted from the store before this rank read it "
                "(another client of the store deleted it, not overlapckpt); nothing was committed"
            )
        text = self.store.open(key, raw)
        if text is None:
            raise RankDisagreementError(
                f"checkpoint #{sequence}: the verdict in the store is forged (not sealed by this run's writers, so written "
                "by another client of the store, not written by overlapckpt); nothing was committed"
            )
        verdict = json.loads(text)  # sealed by this run's coordinating writer, which writes an object
        if not isinstance(verdict, dict):
            raise RankDisagreementError(
                f"checkpoint #{sequence}: the verdict in the store is malformed ({text[:_MAX_SHOWN_BYTES]!r}); nothing was committed"
            )
        refusal = verdict.get("refused")
        next_window = verdict.get("next_window")  # sealed by the coordinator, which writes an int or None
        return _Verdict(
            refusal if isinstance(refusal, str) else None,
            verdict.get("shapes_unchanged") is True,
            next_window if isinstance(next_window, int) and not isinstance(next_window, bool) else None,
            verdict.get("plans_unchanged") is True,
        )

    def _missing_claims(self, sequence: int, claims: dict[int, dict[str, Any]], verdict_missing: bool = False) -> str:
        missing = [r for r in range(self.world_size) if r not in claims]
        if not missing and verdict_missing:
            return (
                f"checkpoint #{sequence}: the coordinating writer (rank {COORDINATOR_RANK}) posted no verdict within "
                f"2 x agreement_timeout_s={self.agreement_timeout_s} of {describe(claims)} (its writer died?); nothing was committed"
            )
        return (
            f"checkpoint #{sequence}: ranks {missing} requested no checkpoint (or their writer died) within "
            f"agreement_timeout_s={self.agreement_timeout_s} of {describe(claims)}; nothing was committed. "
            "Every rank must request the same checkpoints (request() after the same step, or the same every=)"
        )

    def _wait(self, keys: list[str], sequence: int, timeout_s: float) -> None:
        """Every key posted, or the store's timeout error; WritersRegroupedError if a writer was replaced meanwhile."""
        if self.moved is None:
            self.store.wait(keys, timedelta(seconds=timeout_s))
            return
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            try:
                self.store.wait(keys, timedelta(seconds=max(0.01, min(_MOVED_POLL_S, remaining))))
                return
            except Exception:
                if self.moved():
                    raise WritersRegroupedError(
                        f"checkpoint #{sequence}: a writer died and was replaced while the ranks agreed on it; "
                        "nothing was committed"
                    ) from None
                if time.monotonic() >= deadline:
                    raise

    def forget(self, sequence: int) -> None:
        """The checkpoint is committed on this rank: remove its keys that no rank reads any more.

        This rank's claim (the coordinator read it before its verdict), and on the
        coordinator the marker. The verdict stays until the coordinator forgets the next
        checkpoint: every rank then claimed that one, so it has read this verdict. Nothing
        here waits on the others, so a rank slower to read the verdict still finds it.
        """
        self.store.delete_key(self._key(sequence, self.rank))
        if self.rank == COORDINATOR_RANK:
            self.store.delete_key(_POSTED_KEY.format(sequence=sequence))
            if sequence > 0:
                self.store.delete_key(_VERDICT_KEY.format(sequence=sequence - 1))

    def missing_claim(self) -> RankDisagreementError | None:
        """For an idle writer: a checkpoint another rank claimed that this rank has not, past the timeout."""
        if not self.store.check([_POSTED_KEY.format(sequence=self.sequence)]):  # one request while nothing is posted
            self._unmatched_since = None
            return None
        now = time.monotonic()
        if self._unmatched_since is None:
            self._unmatched_since = now
        if now - self._unmatched_since < self.agreement_timeout_s:
            return None
        sequence = self.sequence
        claims = self._claims(sequence)
        if not any("version" in c for c in claims.values()):
            # The marker stands, but no rank's sealed claim is behind it: another client of the
            # store wrote it (or only forged claims). Refusing would fail a checkpoint no rank asked for.
            log.warning(
                "overlapckpt: the writers' marker of checkpoint #%d stands in the store with no rank's claim behind it "
                "(%s); ignored: another client of the job's store wrote it",
                sequence, describe(claims) or "no claims",
            )
            self._unmatched_since = None  # looked at again one timeout later, never per poll
            return None
        self._post(sequence, {"requested": None})  # the others fail at once
        if self.rank == COORDINATOR_RANK:  # the others wait for its verdict, not for the claims
            self._post_verdict(sequence, _Verdict(_disagreement(sequence, {**claims, self.rank: {"requested": None}})))
        self.sequence += 1
        self._unmatched_since = None
        return RankDisagreementError(
            f"checkpoint #{sequence}: {describe(claims)}, but this rank ({self.rank}) requested none within "
            f"agreement_timeout_s={self.agreement_timeout_s}; nothing was committed. Every rank must request "
            "the same checkpoints"
        )


def _disagreement(sequence: int, claims: dict[int, dict[str, Any]]) -> str:
    return (
        f"checkpoint #{sequence}: the ranks disagree: {describe(claims)}; nothing was committed. Every rank "
        "must request the same checkpoints (request() after the same step, or the same every=)"
    )


@dataclass(frozen=True)
class _Verdict:
    refusal: str | None  # None: the ranks agreed
    shapes_unchanged: bool = False  # every rank may reuse its shape union (shape_union.py)
    next_window: int | None = None  # the widest window any rank proposed (window="auto")
    plans_unchanged: bool = False  # every rank may skip DCP's plan round (save_plans.py)


def _agreed_part(claim: dict[str, Any]) -> dict[str, Any]:
    """What every rank must claim alike: the claim less this rank's own facts (its shapes and plan digests, its window proposal)."""
    return {k: v for k, v in claim.items() if k not in _OWN_FIELDS}
