"""The service bench's ``partitions`` section: lookups/s and written objects/s over 1, 2 and 4
metadata partitions, each its own OS process, against one partition measured in the same run.

Each partition is a ``CacheState(spec, StateConfig(partition=Partition(i, n)))`` behind its own
gRPC server (``build_service``, as the service bench builds its service), in its own spawned
process: no two share a GIL. Every count's partitions are up at once, so the rounds alternate
between the counts and a noisy neighbour slows each alike; each figure is the best of the
rounds. The clients run apart from the partitions, as workers do: in client processes of
their own (``clients``), several threads each, every thread with its own
:class:`~workers.partitioned.PartitionedMetadata` over its own
:class:`~hkv_service.client.MetadataClient` per partition (the port every caller uses):

* ``write_objects_per_s``: new 16-block prompts written as the data plane and the shard write
  them (``DataPlane.write_prefix`` -> ``ShardActor.write_blocks``): one ``allocate`` of every
  object of the prompt (64: 4 per block), then every commit in one ``transition_many``: the
  KV (at its content version), SWA and tail objects, then the indexers synced to those
  versions (2 RPCs a prompt, both to the partition of the prompt's root;
  ``write_prompts_per_s`` counts the prompts);
* ``lookups_per_s``: 1-block lookups (handles packed, no lease) of the roots written, each
  distinct, so they spread over the partitions as roots do (``lookups_by_partition``, from
  each partition's own stats, says how they spread).

Beside each rate, the CPU the clients and the partitions used over its window, in cores
(``*_client_cpu_cores``, ``*_server_cpu_cores``; /proc). Why client processes: threads of
one process share its GIL, and a blocking gRPC call hands it over twice, so one client
process may bound the rate before the partitions do. The full run measures that, in the same
rounds: ``threads_only``, the same calls from as many threads of this one process, and
``threads_only.vs_client_processes`` (threads / processes, per count).

``--quick`` measures 1 and 2 partitions with fewer calls, client processes only. The full run
measures 1, 2 and 4 with the ``threads_only`` comparison, and then the same with the
partitions as Ray actors on a two-node ``ray.cluster_utils.Cluster`` on this machine
(``ray``: partition i on node i % 2, a simulation of a deployment over several nodes; one
round; counts left out, ``skipped_counts``, when starting them would not fit its time
budget). Processes started here are stopped by handle; Ray and the cluster are always shut
down.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import xxhash

from ..client import MetadataClient
from ..core.api import AllocRequest, LookupRequest, ObjectTransitions, Params, StateConfig
from ..core.errors import HkvError
from ..core.ids import BlockHash, ShardId
from ..core.layout import Layout
from ..core.partitions import Partition
from ..core.state_view import CacheState
from ..core.states import Event, Kind
from ..server.app import ServerConfig, Service, build_service
from ..specs import default_spec
from ..testing import pools_for

__all__ = ["FULL", "QUICK", "RAY", "UNITS", "Sizes", "check_spread", "run"]

REQUEST_BLOCKS = 16  # a prompt written per request (as the scale bench's write path)
OWNER = ShardId("bench-partitions")
START_S = 120.0  # a process (partition or client) up and answering, at most
CALL_TIMEOUT_S = 60.0
POOL_BLOCKS = 1 << 20  # per column, split among the partitions (per-block cost is lazy)
PROMPTS_PER_COUNT = 10_000_000  # prompt numbers: each count's from count * this
RAY_BUDGET_S = 120.0  # the whole Ray part; counts whose start would pass half of it: skipped


@dataclass(frozen=True, slots=True)
class Sizes:
    counts: tuple[int, ...]  # partition counts measured (the first must be 1: the base)
    lookups: int  # lookups per round, count and way of running the clients
    writes: int  # prompts written per round, count and way of running the clients
    client_processes: int
    threads: int  # per client process
    rounds: int
    compare_threads: bool = False  # also from as many client threads, all in this process
    ray: Sizes | None = None  # then the partitions as Ray actors over two nodes


# ~1-3 s a window on the 2-core development machine (~1.5k lookups/s, ~80 prompts/s)
QUICK = Sizes(counts=(1, 2), lookups=2000, writes=64, client_processes=2, threads=4, rounds=2)
RAY = Sizes(counts=(1, 2, 4), lookups=3000, writes=120, client_processes=2, threads=4, rounds=1)
FULL = Sizes(counts=(1, 2, 4), lookups=5000, writes=200, client_processes=2, threads=4,
             rounds=2, compare_threads=True, ray=RAY)


# -- what a client does ------------------------------------------------------------------------

def _chain(i: int) -> list[BlockHash]:
    """Prompt ``i``'s block hashes: a root of its own (so prompts spread over partitions)."""
    h = xxhash.xxh3_128_digest(b"hkv bench partitions %d" % i)
    out = [BlockHash(h)]
    for d in range(1, REQUEST_BLOCKS):
        h = xxhash.xxh3_128_digest(h + b"%d" % d)
        out.append(BlockHash(h))
    return out


class _Writer:
    """One prompt's write as the data plane and the shard do it: one allocate of every
    object, then every commit in one ``transition_many``: KV (at its content version), SWA
    and tails, then the indexers synced to those versions. Returns the objects committed."""

    def __init__(self, layout: Layout, blocks: int = REQUEST_BLOCKS, owner: ShardId = OWNER
                 ) -> None:
        self.layout, self.owner = layout, owner
        self.slots = [(d, layout.columns[c].name, c) for d in range(blocks)
                      for c in layout.attached[d % layout.period]]
        self.requests = [AllocRequest(d, name) for d, name, _ in self.slots]
        self.kinds = [layout.columns[c].kind for _, _, c in self.slots]
        # the KV column an indexer is synced to, by slot: its slot's position in the request
        at = {(d, c): k for k, (d, _, c) in enumerate(self.slots)}
        self.kv_of = {k: at[(d, layout.columns[c].indexes or 0)]
                      for k, (d, _, c) in enumerate(self.slots) if self.kinds[k] is Kind.INDEXER}

    def __call__(self, meta: Any, hashes: Sequence[BlockHash]) -> int:
        allocs = meta.allocate(hashes, self.requests, self.owner)
        items: list[ObjectTransitions] = []
        versions: dict[int, int] = {}  # a fresh KV's slot -> its version (known up front)
        for k, a in enumerate(allocs):
            if a.existing or self.kinds[k] is Kind.INDEXER:
                continue
            kind, (d, _, c) = self.kinds[k], self.slots[k]
            if kind is Kind.TAIL:
                params = Params(tail_len=self.layout.tail_tokens(c, d))
            elif kind is Kind.COMPRESSED:  # the data plane's content version of the bytes
                versions[k] = 1 + (int.from_bytes(hashes[d][:6], "little") ^ c)
                params = Params(version=versions[k])
            else:
                params = None
            event = Event.TAIL_DONE if kind is Kind.TAIL else Event.WRITE_DONE
            items.append(ObjectTransitions(a.handle.object_id, (event,), (params,),
                                           a.handle.generation))
        items += [ObjectTransitions(a.handle.object_id, (Event.WRITE_DONE, Event.INDEXER_SYNC),
                                    (None, Params(version=versions[self.kv_of[k]])),
                                    a.handle.generation)
                  for k, a in enumerate(allocs)
                  if self.kinds[k] is Kind.INDEXER and not a.existing
                  and self.kv_of[k] in versions]
        return len(_all_done(meta.transition_many(items))) if items else 0


def _all_done(results: Sequence[Any]) -> list[Any]:
    for r in results:
        if isinstance(r, HkvError):
            raise r
    return list(results)


def _lookup(meta: Any, root: Sequence[BlockHash]) -> int:
    meta.lookup(LookupRequest(root))
    return 1


@dataclass(frozen=True, slots=True)
class _Window:
    """One timed run: work done (objects, lookups), its span (``time.monotonic``, the same
    clock in every process of this machine) and the client CPU it took."""

    done: int
    t0: float
    t1: float
    cpu_s: float

    @staticmethod
    def union(parts: Sequence[_Window]) -> _Window:
        return _Window(sum(p.done for p in parts), min(p.t0 for p in parts),
                       max(p.t1 for p in parts), sum(p.cpu_s for p in parts))


class _Clients:
    """``threads`` client threads, each with its own PartitionedMetadata over its own
    MetadataClient per partition (its own channels)."""

    def __init__(self, endpoints: Sequence[str], threads: int) -> None:
        from workers.partitioned import PartitionedMetadata

        self.metas = [PartitionedMetadata([MetadataClient(e, timeout_s=CALL_TIMEOUT_S)
                                           for e in endpoints]) for _ in range(threads)]
        for meta in self.metas:  # every channel connected; each partition says it is in place
            meta.get_spec()
        self.writer = _Writer(Layout(self.metas[0].get_spec()))

    def run(self, op: str, items: Sequence[int], go: Callable[[], None] = lambda: None
            ) -> _Window:
        """``op`` (``"write"``: prompt i; ``"lookup"``: prompt i's root) over ``items``,
        split among the threads; ``go`` is called once every thread is ready to start."""
        n = len(self.metas)
        if op == "write":
            work: list[list[Sequence[BlockHash]]] = [[_chain(i) for i in items[t::n]]
                                                     for t in range(n)]
            fn: Callable[[Any, Sequence[BlockHash]], int] = self.writer
        else:
            work = [[_chain(i)[:1] for i in items[t::n]] for t in range(n)]
            fn = _lookup
        start = threading.Barrier(n + 1)
        done = [0] * n
        errors: list[BaseException] = []

        def loop(t: int) -> None:
            meta = self.metas[t]
            start.wait()
            try:
                done[t] = sum(fn(meta, x) for x in work[t])
            except BaseException as exc:  # reported once all threads ended
                errors.append(exc)

        pool = [threading.Thread(target=loop, args=(t,), daemon=True) for t in range(n)]
        for t in pool:
            t.start()
        go()
        start.wait()
        t0, cpu0 = time.monotonic(), time.process_time()
        for t in pool:
            t.join()
        t1, cpu1 = time.monotonic(), time.process_time()
        if errors:
            raise errors[0]
        return _Window(sum(done), t0, t1, cpu1 - cpu0)

    def close(self) -> None:
        for meta in self.metas:
            meta.close()


def _client_process(conn: Connection) -> None:
    """A client process: opens clients for a group when told, runs what it is told on them
    (``ready`` once its threads wait, the calls once it hears ``go``), answers each run's
    window; ends on ``stop`` or when the bench process goes away."""
    groups: dict[int, _Clients] = {}
    try:
        with contextlib.suppress(EOFError, OSError):
            while True:
                msg = conn.recv()
                if msg[0] == "open":
                    _, key, endpoints, threads = msg
                    groups[key] = _Clients(endpoints, threads)
                    conn.send("opened")
                elif msg[0] == "run":
                    _, key, op, items = msg

                    def go() -> None:
                        conn.send("ready")
                        if conn.recv() != "go":
                            raise RuntimeError("the bench process did not say go")

                    conn.send(groups[key].run(op, items, go))
                else:
                    return
    finally:
        for g in groups.values():
            g.close()


# -- the partitions' processes -----------------------------------------------------------------

def _serve_partition(index: int, count: int) -> Service:
    state = CacheState(default_spec(), StateConfig(partition=Partition(index, count)))
    service = build_service(ServerConfig(port=0), state)
    service.server.start()
    return service


def _partition_process(index: int, count: int, conn: Connection) -> None:
    """A partition's process: serves until told to stop or the bench process goes away."""
    service = _serve_partition(index, count)
    try:
        conn.send(service.port)
        with contextlib.suppress(EOFError, OSError):
            conn.recv()
    finally:
        service.stop(0).wait(10)


def _answer(conn: Connection, proc: Any, what: str) -> Any:
    """What ``proc`` sends next on ``conn``; a clear error if it died or hung instead."""
    deadline = time.monotonic() + START_S
    while not conn.poll(0.2):
        if not proc.is_alive():
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not answer in {START_S} s")
    try:
        return conn.recv()
    except EOFError:
        raise RuntimeError(f"{what} exited ({proc.exitcode}); its traceback is above"
                           ) from None


class _Children:
    """Spawned processes of this bench (no fork of a process with gRPC threads), each with a
    pipe; stopped by handle: told to stop, then killed if still alive."""

    def __init__(self) -> None:
        self.ctx = multiprocessing.get_context("spawn")
        self.procs: list[Any] = []
        self.conns: list[Connection] = []

    def start(self, target: Callable[..., None], *args: Any) -> tuple[Connection, Any]:
        conn, child = self.ctx.Pipe()
        proc = self.ctx.Process(target=target, args=(*args, child), daemon=True)
        proc.start()
        child.close()
        self.procs.append(proc)
        self.conns.append(conn)
        return conn, proc

    def close(self, stop: object) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send(stop)
        for proc in self.procs:
            proc.join(20)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        for conn in self.conns:
            conn.close()


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far, its threads' too (0 where /proc
    cannot say)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat[stat.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _loadavg() -> float:
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return -1.0


@contextlib.contextmanager
def _load_samples(out: dict[str, Any], every_s: float = 1.0) -> Iterator[None]:
    """The 1-minute load average at the start, the end and its max in between."""
    samples = [_loadavg()]
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(every_s):
            samples.append(_loadavg())

    thread = threading.Thread(target=sample, name="hkv-bench-loadavg", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(5)
        samples.append(_loadavg())
        out["loadavg_1m"] = {"start": samples[0], "end": samples[-1], "max": max(samples)}


@dataclass(slots=True)
class _Group:
    """One partition count's partitions: where they listen and their pids; a client here
    for the owner's registration and the partitions' stats."""

    count: int
    endpoints: list[str]
    pids: list[int]
    control: Any = None  # PartitionedMetadata
    next_prompt: int = 0  # prompts written so far (their roots are what the lookups ask)
    nodes: list[str] = field(default_factory=list)  # Ray only: each partition's node

    def prompts(self, n: int) -> list[int]:
        first = self.count * PROMPTS_PER_COUNT + self.next_prompt
        self.next_prompt += n
        return list(range(first, first + n))

    def roots(self, n: int) -> list[int]:
        """``n`` lookups cycling over every root written so far."""
        first = self.count * PROMPTS_PER_COUNT
        return [first + j % self.next_prompt for j in range(n)]

    def server_cpu_s(self) -> float:
        return sum(_cpu_s(p) for p in self.pids)


def _partition_processes(children: _Children, counts: Sequence[int]) -> list[_Group]:
    """Every count's partitions, each its own process, all started before any is waited for."""
    started = [(n, *children.start(_partition_process, i, n)) for n in counts for i in range(n)]
    groups = {n: _Group(n, [], []) for n in counts}
    for n, conn, proc in started:
        port = _answer(conn, proc, "a partition's process")
        groups[n].endpoints.append(f"127.0.0.1:{port}")
        groups[n].pids.append(int(proc.pid or 0))
    return [groups[n] for n in counts]


class _ClientProcesses:
    """Client processes, each with ``threads`` threads per group (opened once, reused)."""

    def __init__(self, children: _Children, count: int) -> None:
        self.each = [children.start(_client_process) for _ in range(count)]

    def open(self, g: _Group, threads: int) -> None:
        for conn, _ in self.each:
            conn.send(("open", g.count, g.endpoints, threads))
        for conn, proc in self.each:
            _answer(conn, proc, "a client process")

    def run(self, g: _Group, op: str, items: Sequence[int]) -> tuple[_Window, float]:
        """The items split among the processes; all start together (each says ready, then
        hears go); the union of their windows, and the partitions' CPU over it."""
        k = len(self.each)
        for j, (conn, _) in enumerate(self.each):
            conn.send(("run", g.count, op, list(items[j::k])))
        for conn, proc in self.each:
            if _answer(conn, proc, "a client process") != "ready":
                raise RuntimeError("a client process was not ready")
        cpu0 = g.server_cpu_s()
        for conn, _ in self.each:
            conn.send("go")
        windows = [_answer(conn, proc, "a client process") for conn, proc in self.each]
        return _Window.union(windows), g.server_cpu_s() - cpu0


# -- measuring ---------------------------------------------------------------------------------

# (group, op, items) -> the clients' window and the partitions' CPU seconds over it
Runner = Callable[[_Group, str, Sequence[int]], tuple[_Window, float]]


def _measure(groups: Sequence[_Group], sizes: Sizes, runners: dict[str, Runner]
             ) -> dict[str, dict[str, dict[str, Any]]]:
    """Rounds over every count in turn and, within a count, every way of running the clients
    in turn (new prompts written, then lookups of the roots written so far): a noisy
    neighbour slows each alike. Per runner and count the best round of each, with the CPU
    used in its window."""
    best: dict[str, dict[int, dict[str, Any]]] = {
        name: {g.count: {} for g in groups} for name in runners}
    for _ in range(sizes.rounds):
        for g in groups:
            for name, runner in runners.items():
                fig = best[name][g.count]
                prompts = g.prompts(sizes.writes)
                _keep_best(fig, "write_objects", runner(g, "write", prompts),
                           prompts=len(prompts))
                _keep_best(fig, "lookups", runner(g, "lookup", g.roots(sizes.lookups)))
    return {name: {str(n): fig for n, fig in by.items()} for name, by in best.items()}


def _keep_best(fig: dict[str, Any], tag: str, timed: tuple[_Window, float],
               prompts: int = 0) -> None:
    w, server_cpu = timed
    span = w.t1 - w.t0
    rate = w.done / span
    if rate <= fig.get(f"{tag}_per_s", 0.0):
        return
    fig[f"{tag}_per_s"] = rate
    fig[f"{tag}_client_cpu_cores"] = w.cpu_s / span
    fig[f"{tag}_server_cpu_cores"] = server_cpu / span
    if prompts:
        fig["write_prompts_per_s"] = prompts / span


UNITS = ("lookups_per_s", "write_objects_per_s")


def _ratios(by_count: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Each count's rates over one partition's, from the same rounds."""
    one = by_count["1"]
    return {f"{unit}_{n}_vs_1": fig[unit] / one[unit]
            for n, fig in by_count.items() if n != "1" for unit in UNITS}


def _spread(g: _Group) -> dict[str, list[int]]:
    """Each partition's lookups and objects so far, from its own stats."""
    parts = g.control.stats()["partitions"]
    lookups, objects = [], []
    for s in parts:
        counts, gauges = s.get("lookups", {}), s.get("gauges", {})
        lookups.append(int(sum(counts.values())))
        objects.append(int(gauges.get("objects", 0)))
    return {"lookups_by_partition": lookups, "objects_by_partition": objects}


def check_spread(section: dict[str, Any]) -> None:
    """Every partition of every count answered lookups (the roots spread over them)."""
    for n, fig in section["by_count"].items():
        looked = fig["lookups_by_partition"]
        if len(looked) != int(n) or min(looked) <= 0:
            raise RuntimeError(f"{n} partitions: lookups per partition {looked}; the roots "
                               "did not spread over them")


def _measured(groups: Sequence[_Group], sizes: Sizes) -> dict[str, Any]:
    """The rates per count with the clients in processes (and, if asked, from as many
    threads of this one process, in the same rounds), each partition's share, and the
    ratios to one partition. The clients are stopped before this returns (before the
    partitions are)."""
    from workers.partitioned import PartitionedMetadata

    children = _Children()
    threads = sizes.client_processes * sizes.threads
    here: dict[int, _Clients] = {}

    def in_threads(g: _Group, op: str, items: Sequence[int]) -> tuple[_Window, float]:
        cpu0 = g.server_cpu_s()
        w = here[g.count].run(op, items)
        return w, g.server_cpu_s() - cpu0

    try:
        for g in groups:
            g.control = PartitionedMetadata([MetadataClient(e, timeout_s=CALL_TIMEOUT_S)
                                             for e in g.endpoints])
            g.control.register_owner(OWNER, pools_for(Layout(g.control.get_spec()),
                                                      POOL_BLOCKS))
        procs = _ClientProcesses(children, sizes.client_processes)
        runners: dict[str, Runner] = {"processes": procs.run}
        for g in groups:
            procs.open(g, sizes.threads)
            if sizes.compare_threads:
                here[g.count] = _Clients(g.endpoints, threads)
                runners["threads"] = in_threads
        got = _measure(groups, sizes, runners)
        by_count = got["processes"]
        out: dict[str, Any] = {
            "clients": {"processes": sizes.client_processes, "threads_each": sizes.threads},
            "by_count": by_count, "ratios": _ratios(by_count)}
        if sizes.compare_threads:
            mine = got["threads"]
            out["threads_only"] = {
                "clients": {"processes": 1, "threads_each": threads},
                "by_count": mine, "ratios": _ratios(mine),
                "vs_client_processes": {f"{unit}_{n}": fig[unit] / by_count[n][unit]
                                        for n, fig in mine.items() for unit in UNITS}}
        for g in groups:
            by_count[str(g.count)].update(_spread(g))
            if g.nodes:
                by_count[str(g.count)]["nodes_by_partition"] = g.nodes
        check_spread(out)
        return out
    finally:
        children.close(("stop",))
        for c in here.values():
            c.close()
        for g in groups:
            if g.control is not None:
                g.control.close()
                g.control = None


# -- Ray ---------------------------------------------------------------------------------------

class _PartitionActor:
    """A partition served over gRPC from a Ray actor (its own worker process)."""

    def __init__(self, index: int, count: int) -> None:
        self.service = _serve_partition(index, count)

    def where(self) -> tuple[int, int, str]:
        import ray

        return self.service.port, os.getpid(), str(ray.get_runtime_context().get_node_id())

    def close(self) -> None:
        self.service.stop(0).wait(10)


def _on_ray(sizes: Sizes) -> dict[str, Any]:
    """The partitions as Ray actors over a two-node Cluster on this machine (partition i on
    node i % 2), the clients in processes as before. Ray and the cluster always shut down."""
    import ray
    from ray.cluster_utils import Cluster

    from workers.launcher import clear_stale_ray

    if ray.is_initialized():
        return {"skipped": "Ray is already initialized in this process"}
    t_start = time.monotonic()
    clear_stale_ray()
    out: dict[str, Any] = {"nodes": 2, "partitions_are": "ray actors"}
    cluster: Any = None
    actors: list[Any] = []
    try:
        cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 1, "resources": {"bench_node_0": 64}})
        cluster.add_node(num_cpus=1, resources={"bench_node_1": 64})
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
        out["cluster_start_s"] = time.monotonic() - t_start
        actor_cls: Any = ray.remote(num_cpus=0, max_restarts=0)(_PartitionActor)
        groups: list[_Group] = []
        for n in sizes.counts:
            if time.monotonic() - t_start > RAY_BUDGET_S / 2:
                out.setdefault("skipped_counts", []).append(n)
                continue
            mine = [actor_cls.options(resources={f"bench_node_{i % 2}": 1}).remote(i, n)
                    for i in range(n)]
            actors += mine
            where = ray.get([a.where.remote() for a in mine], timeout=START_S)
            groups.append(_Group(n, [f"127.0.0.1:{port}" for port, _, _ in where],
                                 [pid for _, pid, _ in where],
                                 nodes=[node[:8] for _, _, node in where]))
        out["counts"] = [g.count for g in groups]
        out["actors_start_s"] = time.monotonic() - t_start - out["cluster_start_s"]
        out.update(_measured(groups, sizes))
    finally:
        for a in actors:
            with contextlib.suppress(Exception):
                ray.get(a.close.remote(), timeout=15)
            with contextlib.suppress(Exception):
                ray.kill(a, no_restart=True)
        if ray.is_initialized():
            ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
    out["elapsed_s"] = time.monotonic() - t_start
    return out


# -- the section -------------------------------------------------------------------------------

def run(quick: bool = False, sizes: Sizes | None = None) -> dict[str, Any]:
    """The ``partitions`` section of ``hkv bench service``."""
    sizes = sizes or (QUICK if quick else FULL)
    if sizes.counts[0] != 1:
        raise ValueError("the first partition count measured must be 1 (the ratios' base)")
    t_start = time.monotonic()
    section: dict[str, Any] = {
        "counts": list(sizes.counts), "partitions_are": "processes",
        "request_blocks": REQUEST_BLOCKS,
        "objects_per_prompt": len(_Writer(Layout(default_spec())).slots),
        "rounds": sizes.rounds}
    with _load_samples(section):
        servers = _Children()
        try:
            section.update(_measured(_partition_processes(servers, sizes.counts), sizes))
        finally:
            servers.close(("stop",))
        if sizes.ray is not None:
            section["ray"] = _on_ray(sizes.ray)
        else:
            section["ray"] = {"skipped": "quick mode" if quick else "not asked"}
    section["elapsed_s"] = time.monotonic() - t_start
    return section
