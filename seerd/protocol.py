"""What crosses the coordinator/worker boundary: the API's endpoints and their message types, the
long-poll constants, and the engine request id codec.

Dependency-light (the standard library, msgspec and the settings it carries, `seerd.settings`): the
worker, the draft client inside the engine, `seerd status` and the simulator import it without the
API framework or the lease book. Field names
are the JSON names on the wire. Each endpoint names its body and reply types, so the API decodes
requests and encodes replies with the same types the client decodes replies into; a reply that
does not decode is a `BadReply`, not a KeyError somewhere later.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import msgspec

from seerd.settings import EngineConfig, PoolSettings, Sampling, SpecConfig

API_PREFIX = "/v1"

# How long a lease call waits for work (the simulator answers calls in the daemon's order with these).
LONG_POLL_MAX_S = 15.0  # the coordinator holds an empty lease call at most this long
# What a worker asks for. A slot freed meanwhile is filled by its report's reply, and the
# coordinator wakes waiting calls when work is queued (and all of them when it stops), so a long
# wait costs nothing; at 1 s, 512 idle workers made 500 empty lease calls a second, at 5 s
# ~65 (three quarters of all lease calls, each a plan and an HTTP round trip: tools/bench/load.py).
LEASE_LONG_POLL_S = 15.0


# What the coordinator budgets for the heartbeats of all its workers together. Past it, each
# worker's interval grows with their count: at 512 workers and one heartbeat each per 2 s,
# heartbeats were 47-60% of the coordinator's calls (tools/bench/load.py).
HEARTBEATS_PER_S = 64.0


def heartbeat_interval(lease_ttl_s: float, workers: int = 1) -> float:
    """What the coordinator tells a worker at registration and in each heartbeat's reply (and
    `seerd status`, with the same count of live workers, uses to call a worker silent): one per
    2 s keeps `seerd status` current while `workers` heartbeats stay within `HEARTBEATS_PER_S`;
    beyond, `workers / HEARTBEATS_PER_S`; never more than a quarter of the lease TTL, so that
    four heartbeats keep a lease alive (and at least 0.2 s)."""
    quarter_ttl = lease_ttl_s / 4
    return max(0.2, min(quarter_ttl, max(2.0, workers / HEARTBEATS_PER_S)))


# ----------------------------------------------------------------------------- workers
class RegisterBody(msgspec.Struct, forbid_unknown_fields=True):
    worker_id: str
    rank: int
    address: str
    max_chunks: int
    kv_capacity_tokens: int
    kv_block_tokens: int = 1  # the engine's KV block: a sequence holds whole blocks
    # The weights its engine holds (`EngineSettings.weights_version`, as it loaded them): a worker
    # registers with a rollout only under that rollout's weights (strictly on-policy).
    weights_version: str = ""
    weights_loaded_s: float = 0.0  # how long its last in-place reload took (0: none)
    dtype: str = ""  # what its engine runs at ("float32", "bfloat16"), as the engine resolved it


class RegisterReply(msgspec.Struct):
    worker_id: str  # the identity to use from now on (the coordinator may shorten it)
    lease_ttl_s: float
    heartbeat_interval_s: float


class EngineSettings(msgspec.Struct):
    """What every worker starts its engine with (`config`): the run configuration's own settings."""

    model_path: str
    engine: EngineConfig
    seed: int
    spec: SpecConfig = SpecConfig()
    kv_pool: PoolSettings | None = None  # absent: the run has no KV pool
    # The rollout's weights: `model_path` and a hash of its files (model_identity.weight_version).
    weights_version: str = ""
    # `seerd serve`: the coordinator outlives a rollout. `batch` is the rollout running now (None:
    # none yet); a worker that heard "done" keeps its engine and waits for the next one.
    serving: bool = False
    batch: int | None = None


class LeaseBody(msgspec.Struct):
    worker_id: str
    wanted: int
    wait_s: float = 0.0  # long poll: wait up to this long for work before answering empty


class ChunkGrant(msgspec.Struct, frozen=True):
    """What a worker needs to run one chunk."""

    chunk_id: int
    epoch: int
    request_id: int
    prompt_token_ids: list[int]  # the group's prompt + the request's tokens so far
    max_tokens: int
    sampling: Sampling  # the group's, with this chunk's own seed
    deadline: float
    # Tokens left to the response's target length (benchmark rows), else None. The worker ends
    # the chunk there with finish reason "length_target"; max_tokens stays the scheduler's budget.
    target_remaining: int | None = None
    # Who the chunk belongs to, for the worker's drafter: the group's sibling responses are what
    # it drafts from, and response tokens start after the group's prompt.
    group_id: int = 0
    prompt_len: int = 0
    is_probe: bool = False
    # In-place continuation (`RunConfig.in_place`). `run_on`: the engine request may generate past
    # this chunk's budget, up to `response_remaining` tokens (the response's max_tokens less those so
    # far, cut at the target): the worker reports the chunk at its budget with `running_on` and
    # keeps the request running until the report's reply says whether it continues there.
    # `continues`: this chunk continues the engine request the worker kept running for the same
    # request (its first tokens may already be generated); the worker holds its context.
    run_on: bool = False
    response_remaining: int = 0
    continues: bool = False
    batch: int = 0  # the rollout (`seerd serve`: the batch) the chunk belongs to

    @property
    def identity(self) -> ChunkIdentity:
        """What the chunk's engine request id carries to the drafter and the KV connector."""
        return ChunkIdentity(self.chunk_id, self.epoch, self.group_id, self.request_id, self.prompt_len,
                             self.is_probe, self.batch)


class LeaseReply(msgspec.Struct):
    chunks: list[ChunkGrant]
    done: bool  # the rollout is complete: the worker may exit
    retry_after_s: float = 0.0  # with no chunks: when to ask again
    # Of the call's time, the long poll's wait for work (not the coordinator's latency): until the
    # work it got was queued, or to its deadline.
    waited_s: float = 0.0


class ChunkReport(msgspec.Struct, frozen=True):
    chunk_id: int
    epoch: int
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    cached_tokens: int | None = None
    # The chunk ended at its budget and its engine request is still generating on this worker:
    # the coordinator may continue it in place (a `continues` grant in the reply).
    running_on: bool = False


class ReportBody(msgspec.Struct):
    worker_id: str
    reports: list[ChunkReport]
    # Free slots the worker would fill from this call's reply, beyond those of its running-on
    # reports: a finished chunk's slot gets its next chunk in the same round trip, not in a
    # lease call after it.
    wanted: int = 0
    # A heartbeat carried by the report (never a leaving one): applied before the reports, as if
    # sent just before the call, and answered in `ReportReply.heartbeat`. A worker that reports
    # within its heartbeat interval makes no heartbeat call of its own (heartbeats were a third to
    # a half of all calls at 1,000 workers). Lease calls carried them too for a while: a second
    # state-thread call beside the lease that bought nothing measurable (docs/journal/2026-11-29.md).
    heartbeat: HeartbeatBody | None = None


class ReportBatch(msgspec.Struct):
    """A `ReportBody` as the coordinator reads it: each report kept raw and decoded on its own
    (`decode_report`), so that one malformed report is rejected alone, not with its batch."""

    worker_id: str
    reports: list[msgspec.Raw]
    wanted: int = 0
    heartbeat: HeartbeatBody | None = None


class _ChunkKey(msgspec.Struct):
    chunk_id: int
    epoch: int


@dataclass(frozen=True)
class UnreadableReport:
    """A report that does not decode as a `ChunkReport`, named by its lease."""

    chunk_id: int
    epoch: int
    problem: str


def decode_report(raw: msgspec.Raw) -> ChunkReport | UnreadableReport:
    """One report of a `ReportBatch`. One that is not a `ChunkReport` (msgspec writes a non-finite
    float as null, so an infinite logprob arrives as one) is an `UnreadableReport` when its lease
    can still be read; otherwise `msgspec.ValidationError`: the body is not a batch of reports."""
    try:
        return msgspec.json.decode(raw, type=ChunkReport)
    except msgspec.ValidationError as exc:
        key = msgspec.json.decode(raw, type=_ChunkKey)
        return UnreadableReport(key.chunk_id, key.epoch, f"malformed report ({exc}; a null float is a non-finite one)")


class ChunkKey(msgspec.Struct):
    """What names a report's lease: read alone from a report that does not decode as a
    `ChunkReport` (a logprob that is not a number, say), so that only that chunk is rejected."""

    chunk_id: int
    epoch: int


class ReportResult(msgspec.Struct):
    chunk_id: int
    accepted: bool
    duplicate: bool  # already acknowledged before: counted nothing
    reason: str  # why it was not accepted (a rejected chunk runs again; the worker drops it)


class ReportReply(msgspec.Struct):
    results: list[ReportResult]  # one per report, in order
    done: bool
    # Leases made at the report for the slots of the chunks reported `running_on` and the body's
    # `wanted` free ones: a grant with `continues` goes on in the engine request already running;
    # a request reported running on without one must be stopped (the scheduler gave its slot to
    # another request, or none).
    grants: list[ChunkGrant] = []
    heartbeat: HeartbeatReply | None = None  # the answer to the body's heartbeat, if it carried one


class ReleaseBody(msgspec.Struct):
    worker_id: str
    chunk_id: int
    epoch: int
    reason: str = ""
    # The engine failed the chunk (it counts toward its request's failure limit); false: given back
    # unrun, e.g. at shutdown.
    failed: bool = False


class ReleaseReply(msgspec.Struct):
    released: bool


class EngineProgress(msgspec.Struct):
    """What says the worker's engine is working: leases are renewed by progress, not by a
    heartbeat alone (an engine stopped or deadlocked under a live worker loop must not hold
    its chunks forever)."""

    steps: int  # the engine's steps (or output events) so far: advances while it generates
    longest_step_s: float  # the longest recent one: the coordinator's stall bound grows with it
    generating: int = 0  # chunks in the engine now (not those done and waiting for their report)


class HeartbeatBody(msgspec.Struct):
    worker_id: str
    running: list[int] = []  # chunk ids the worker still runs: only their leases are extended
    stats: dict = {}  # the worker's live figures (seerd.worker.stats), kept for `seerd status`
    engine: EngineProgress | None = None  # None: the engine does not tell; the heartbeat alone renews
    leaving: bool = False  # the worker's last word after hearing the rollout is done: its final figures


class HeartbeatReply(msgspec.Struct):
    abort: list[int]  # chunk ids whose leases are gone: stop running them
    done: bool
    interval_s: float | None = None  # the next heartbeat in this long (it grows with the worker count)


class StatusReply(msgspec.Struct):
    rollout_id: int
    policy: str
    requests_total: int
    requests_done: int
    groups_total: int
    groups_done: int
    leases: int
    output_tokens: int
    workers_alive: int
    complete: bool
    accepting: bool  # false while draining
    coordinator_busy_s: float
    api_calls: int
    kv_pool: dict | None = None  # the pool's latest figures, when the run has one


class StatusSnapshot(msgspec.Struct):
    """`seerd status`'s whole snapshot (seerd.status.snapshot: a plain dict, docs/status.md), read by
    the coordinator on its own host for a host that may not open the database (seerd.db.sharing)."""

    snapshot: dict


# ErrorReply codes a worker acts on.
UNKNOWN_WORKER = "unknown_worker"  # 404: the coordinator does not know the worker (it restarted): register again
# 410: the coordinator took the worker out (its engine stopped making progress, or failed chunks
# that other engines ran): it exits, and whatever supervises it starts a fresh one.
WORKER_RETIRED = "worker_retired"
# 409: the worker's weights are not the rollout's (`seerd serve` moved to a batch with others
# meanwhile): it reads the config again, loads them, and registers again.
WEIGHTS_MISMATCH = "weights_mismatch"


class ErrorReply(msgspec.Struct):
    detail: str
    code: str = ""  # one of the codes above, or empty


# ----------------------------------------------------------------------------- drafts
class DraftAppendItem(msgspec.Struct, forbid_unknown_fields=True):
    group: int
    request: int
    prev_count: int  # tokens of the response before `tokens`
    tokens: list[int]


class DraftAppendBody(msgspec.Struct):
    items: list[DraftAppendItem]


class DraftAppendResult(msgspec.Struct):
    """One pushed segment's outcome; a failed one (`ok` false) says why in `error`."""

    ok: bool
    count: int = 0  # tokens the server now holds for the request
    gen: int = 0  # the request's log generation
    appended: int = 0
    pending: int = 0
    rewritten: bool = False
    evicted: list[int] = []
    error: str = ""


class DraftAppendReply(msgspec.Struct):
    results: list[DraftAppendResult]  # one per item, in order


class DraftFetchBody(msgspec.Struct):
    cursors: dict[int, dict[int, tuple[int, int]]]  # group -> request -> (gen, count) held


class DraftChanges(msgspec.Struct):
    """What changed past a client's cursors (the draft server's fetch result, and the reply)."""

    # group -> request -> (gen, start, tokens): replace the client's tokens from `start` on
    # (start 0 with a new gen: a reset, the client replaces the whole sequence)
    changes: dict[int, dict[int, tuple[int, int, list[int]]]]
    dropped: dict[int, list[int]]  # group -> requests the client holds that the server does not
    unknown: list[int]  # groups not registered (finished, expired, evicted): drop them


class DraftStats(msgspec.Struct):
    groups: int
    requests: int
    tokens: int  # held in logs and pending segments
    bytes: int
    bytes_per_million_tokens: int | None
    appends: int
    appended_tokens: int
    duplicates: int
    rewrites: int
    evictions: dict[str, int]  # reason -> groups evicted


# ----------------------------------------------------------------------------- batches (`seerd serve`)
class BatchBody(msgspec.Struct, forbid_unknown_fields=True):
    """A batch for `seerd serve`: a prompt file it can read (as `seerd run --input`), the options
    that differ from the serve's, and the client's key (the same key again answers the same batch)."""

    input: str
    key: str
    weights: str | None = None  # a checkpoint directory of the serve's model; None: the serve's --model
    n: int | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None


class BatchState(msgspec.Struct):
    batch: int
    status: str  # the rollout's: created (waiting its turn), running, finished, interrupted, failed
    weights_version: str
    groups: int
    groups_done: int
    requests: int
    requests_done: int  # ended: finished or failed
    reason: str | None = None  # why it failed or was interrupted
    output: str | None = None  # its rollouts.jsonl, once finished


class GroupsReply(msgspec.Struct):
    """The groups of a batch that ended (every response finished or failed) since `after`, each
    {"group_index", "prompt_id", "prompt_token_ids", "rows"} with the rows as rollouts.jsonl has them plus
    `weight_version`; `cursor` is the next call's `after`; `status` the batch's in the same read."""

    groups: list[dict]
    cursor: int
    status: str
    groups_total: int  # the batch's: a client that has them all needs to ask no more


# ----------------------------------------------------------------------------- endpoints
BodyT = TypeVar("BodyT")
ReplyT = TypeVar("ReplyT")


@dataclass(frozen=True)
class Endpoint(Generic[BodyT, ReplyT]):
    method: str
    path: str
    body: type[BodyT] | None  # None: the call has no body (GET)
    reply: type[ReplyT]


CONFIG = Endpoint[None, EngineSettings]("GET", f"{API_PREFIX}/config", None, EngineSettings)
REGISTER = Endpoint("POST", f"{API_PREFIX}/register", RegisterBody, RegisterReply)
LEASE = Endpoint("POST", f"{API_PREFIX}/lease", LeaseBody, LeaseReply)
REPORT = Endpoint("POST", f"{API_PREFIX}/report", ReportBody, ReportReply)
RELEASE = Endpoint("POST", f"{API_PREFIX}/release", ReleaseBody, ReleaseReply)
HEARTBEAT = Endpoint("POST", f"{API_PREFIX}/heartbeat", HeartbeatBody, HeartbeatReply)
STATUS = Endpoint[None, StatusReply]("GET", f"{API_PREFIX}/status", None, StatusReply)
STATUS_SNAPSHOT = Endpoint[None, StatusSnapshot]("GET", f"{API_PREFIX}/status/snapshot", None, StatusSnapshot)
SNAPSHOT_TAIL_ROWS = "tail_rows"  # its query parameter: running requests listed, 0..MAX_SNAPSHOT_TAIL_ROWS
MAX_SNAPSHOT_TAIL_ROWS = 10_000
DRAFTS_APPEND = Endpoint("POST", f"{API_PREFIX}/drafts/append", DraftAppendBody, DraftAppendReply)
DRAFTS_FETCH = Endpoint("POST", f"{API_PREFIX}/drafts/fetch", DraftFetchBody, DraftChanges)
DRAFTS_STATS = Endpoint[None, DraftStats]("GET", f"{API_PREFIX}/drafts/stats", None, DraftStats)
BATCHES = Endpoint("POST", f"{API_PREFIX}/batches", BatchBody, BatchState)
# GET BATCHES.path/{batch}: its BatchState; GET BATCHES.path/{batch}/groups?after=N: a GroupsReply.
BATCH_GROUPS_AFTER = "after"
BATCH_GROUPS_WAIT = "wait"  # seconds to hold the call while nothing new ended (at most BATCH_WAIT_MAX_S)
# `seerd serve`: a worker's GET CONFIG.path?after_batch=N&wait=S is held until a batch other than N
# runs (or S seconds), so that it starts the next batch as soon as it is mounted.
CONFIG_AFTER_BATCH = "after_batch"
BATCH_WAIT_MAX_S = 10.0


class BadReply(RuntimeError):
    """A reply that does not decode as its endpoint's type (the two sides run different versions)."""


def decode_reply(endpoint: Endpoint[Any, ReplyT], content: bytes) -> ReplyT:
    try:
        return msgspec.json.decode(content, type=endpoint.reply)
    except msgspec.DecodeError as exc:  # ValidationError included
        raise BadReply(f"{endpoint.method} {endpoint.path}: the reply is not a {endpoint.reply.__name__} "
                       f"({exc}): {content[:200]!r}") from None


# ----------------------------------------------------------------------------- engine request ids
# The drafter runs inside vLLM's model runner, which hands it token rows and request ids only (in
# the engine-core process under AsyncLLM); the KV connector sees request ids too. So a chunk's
# engine request id carries what they need: the chunk and lease epoch (the worker's own key), the
# group whose siblings it drafts from, the database request id, where the response starts in the
# token row, whether it is its group's probe (high priority for draft depth), and the rollout (under
# `seerd serve`, the batch) it belongs to: the KV pool scopes its keys by it (b0: none named).

# vLLM 0.32 appends "-<8 random hex>" to every request id inside the engine (the runner sees that).
_ENGINE_ID = re.compile(r"^c(\d+)e(\d+)(?:b(\d+))?g(\d+)r(\d+)p(\d+)(h?)(?:-[0-9a-zA-Z]+)?$")


@dataclass(frozen=True)
class ChunkIdentity:
    chunk_id: int
    epoch: int
    group_id: int
    request_id: int
    prompt_len: int  # response tokens start here in the engine's token row
    is_probe: bool
    batch: int = 0  # the rollout's id (0 in ids that name none)

    @property
    def engine_id(self) -> str:
        batch = f"b{self.batch}" if self.batch else ""
        return (f"c{self.chunk_id}e{self.epoch}{batch}g{self.group_id}r{self.request_id}p{self.prompt_len}"
                f"{'h' if self.is_probe else ''}")

    @property
    def lease_key(self) -> str:
        """The worker's own key for a running chunk (what its stats and aborts use)."""
        return lease_key(self.chunk_id, self.epoch)


def lease_key(chunk_id: int, epoch: int) -> str:
    return f"c{chunk_id}e{epoch}"


def parse_engine_id(engine_id: str) -> ChunkIdentity | None:
    """The identity a seerd worker encoded, or None for any other request id."""
    match = _ENGINE_ID.match(engine_id)
    if match is None:
        return None
    chunk, epoch, batch, group, request, prompt_len, probe = match.groups()
    return ChunkIdentity(int(chunk), int(epoch), int(group), int(request), int(prompt_len), probe == "h",
                         int(batch or 0))
