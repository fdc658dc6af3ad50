"""Several `kvcomm serve` replicas behind `vllm-router`: what each routing policy does to a team's reuse, and a replica killed half-way.

    .venv/bin/python benchmarks/bench_replicas.py [--teams 4] [--logs DIR] [--json FILE]

Real `kvcomm serve` replicas (``integrations/serve/replicas.py``: two on this machine, each with
``--state-dir`` and a save every 2 s) and a real ``vllm-router`` (0.1.17, the ``replicas`` extra)
in front. A team is three agents of the bundled review pipeline (summarizer, reviewer,
checker: each reads the team's document behind its own system prompt, the later ones also the
earlier ones' replies; ``max_tokens`` the pipeline's) on a document of its own (the pipeline's
rows), with one ``RemoteChatBackend`` whose session key (``X-Session-ID``) is the team's; the
teams run at once, one thread each, their agents in order. Each run gives every team a fresh
tenant (the replicas run without API keys; the tenant travels in the body), so no run reuses
another's state.

Runs, in order, on one deployment: ``one replica`` (the router in front of replica 0 alone),
then the router in front of both with ``consistent_hash``, ``cache_aware`` and ``round_robin``;
then ``consistent_hash`` again with the replica that holds the most teams SIGKILLed once half the
calls have finished (``kill``), then that replica restarted from its ``--state-dir`` and the
teams it held run once more on their documents, as the same tenants (``after restart``: its
state restored from the save serves them; against them, the same teams' first calls in ``kill``).

Printed per run and team: the replicas its calls landed on (``consistent_hash``: from the
router's log; otherwise the replicas whose ``kvcomm_tenant_bytes`` name the team's tenant),
token reuse ((exact + estimated) / prompt tokens), summed end-to-end TTFT, and whether its
replies equal the one-replica run's; for ``kill``: calls failed (after the client's one retry),
calls retried, calls served after the kill, reuse before and after it, and the restart's seconds.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from kvcomm.integrations.local.segments import ChatTurn
from kvcomm.integrations.remote.backend import RemoteChatBackend, RemoteError
from kvcomm.integrations.serve.replicas import Replicas
from kvcomm.reuse.pipeline import load_bundled_pipeline
from kvcomm.services.tenants import tenant_label

AGENTS = 3
REPLICAS = 2
SERVE_ARGS = ["--gamma", "1", "--max-model-len", "2048", "--block-size", "32", "--max-num-seqs", "8", "--save-interval", "2"]
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
POLICIES = ("consistent_hash", "cache_aware", "round_robin")


@dataclass
class Call:
    """One agent's call: tokens by source, end-to-end TTFT (s), its reply; ``failed``: the error
    the client raised after its retry; ``finished``: ``time.monotonic()`` when it returned."""

    team: int
    agent: str
    prompt: int = 0
    reused: int = 0
    ttft_s: float = 0.0
    reply: str = ""
    note: str = ""
    failed: str = ""
    retried: bool = False
    finished: float = 0.0


@dataclass
class Run:
    name: str
    tenant: str = ""
    calls: list[Call] = field(default_factory=list)
    placement: dict[int, list[int]] = field(default_factory=dict)
    killed: int | None = None
    killed_at: float | None = None
    restart_s: float | None = None

    def team(self, team: int) -> list[Call]:
        return [c for c in self.calls if c.team == team]


def team_turns(agent, document: str, replies: dict[str, str]) -> list[ChatTurn]:
    """The review pipeline's shape as chat messages: the agent's system prompt, the document, the
    earlier agents' replies (each a message by its author), the agent's instruction (the last
    line of its template)."""
    turns = [ChatTurn("system", agent.system), ChatTurn("user", document, "user")]
    turns += [ChatTurn("user", text, name) for name, text in replies.items()]
    instruction = "".join(p for p in agent.template if isinstance(p, str)).rsplit("\n", 1)[-1].strip()
    return turns + [ChatTurn("user", instruction, "user")]


def run_team(url: str, tenant: str, team: int, document: str, pipeline, tokenizer, out: Run, done: threading.Semaphore) -> None:
    backend = RemoteChatBackend(url, tokenizer=tokenizer, tenant=tenant, session=f"team-{team}", max_new_tokens=pipeline.max_new_tokens)
    try:
        replies: dict[str, str] = {}
        for agent in pipeline.agents[:AGENTS]:
            call, before = Call(team, agent.name), backend.retries
            try:
                reply = backend.complete(team_turns(agent, document, replies), agent=agent.name)
                p = reply.call.provenance
                call.prompt, call.reused, call.ttft_s = p.prompt_tokens, p.exact_tokens + p.estimated_tokens, p.ttft_s or 0.0
                call.reply, call.note = reply.text, p.note
            except RemoteError as error:
                call.failed = str(error)[:300]
            call.retried, call.finished = backend.retries > before, time.monotonic()
            replies[agent.name] = call.reply or "(no reply)"
            out.calls.append(call)
            done.release()
    finally:
        backend.close()


def run_teams(deployment: Replicas, name: str, teams: list[int], documents: list[str], pipeline, tokenizer,
              kill_after: int | None = None, kill: int | None = None, tenant: str | None = None, kill_delay_s: float = 0.0) -> Run:
    """Every team of ``teams`` at once through the router, team ``t`` as tenant ``{tenant}-{t}``
    (default: fresh tenants); with ``kill_after``, replica ``kill`` (None: the one holding the
    most teams with calls still to make) is SIGKILLed ``kill_delay_s`` after that many calls have finished."""
    tenant = tenant or f"bench-replicas-{name.replace(' ', '-')}-{time.time_ns()}"
    out, done = Run(name, tenant), threading.Semaphore(0)
    threads = [threading.Thread(target=run_team, args=(deployment.url, f"{tenant}-{t}", t, documents[t], pipeline, tokenizer, out, done))
               for t in teams]
    for thread in threads:
        thread.start()
    if kill_after is not None:
        for _ in range(kill_after):
            done.acquire()
        time.sleep(kill_delay_s)
        if kill is None:  # the replica with the most teams that still have calls to make
            held = router_placement(deployment, teams)
            busy = [t for t in teams if len(out.team(t)) < AGENTS]
            kill = max(range(len(deployment.replicas)), key=lambda r: (sum(r in held[t] for t in busy), sum(r in p for p in held.values())))
        deployment.kill(kill)
        out.killed, out.killed_at = kill, time.monotonic()
        print(f"  killed replica {kill} (SIGKILL) {kill_delay_s:g} s after the {kill_after}th call finished", flush=True)
    for thread in threads:
        thread.join()
    out.placement = router_placement(deployment, teams) if deployment.policy == "consistent_hash" else \
        state_placement(deployment, [f"{tenant}-{t}" for t in teams], teams)
    return out


def router_placement(deployment: Replicas, teams: list[int]) -> dict[int, list[int]]:
    """Team -> the replicas the router sent its session key to, from the router's log (the part
    this router wrote: its log is appended to per start)."""
    text = deployment.router_log.read_text(errors="replace").rsplit("=== router:", 1)[-1]
    urls = {r.url: r.index for r in deployment.replicas}
    found: dict[int, set[int]] = {t: set() for t in teams}
    for key, url in re.findall(r"Consistent hash routing: key='header:x-session-id:team-(\d+)' -> worker='([^']+)'", text):
        if int(key) in found and url in urls:
            found[int(key)].add(urls[url])
    return {t: sorted(v) for t, v in found.items()}


def state_placement(deployment: Replicas, tenants: list[str], teams: list[int]) -> dict[int, list[int]]:
    """Team -> the live replicas whose ``kvcomm_tenant_bytes`` has the team's tenant (it planned a call there)."""
    found: dict[int, list[int]] = {t: [] for t in teams}
    for replica in deployment.replicas:
        if not replica.alive():
            continue
        text = httpx.get(replica.url + "/metrics", timeout=60).text
        labels = set(re.findall(r'kvcomm_tenant_bytes\{tenant="([0-9a-f]+)"\}', text))
        for team, tenant in zip(teams, tenants):
            if tenant_label(tenant) in labels:
                found[team].append(replica.index)
    return found


def reuse(calls: list[Call]) -> float:
    prompt = sum(c.prompt for c in calls if not c.failed)
    return sum(c.reused for c in calls if not c.failed) / prompt if prompt else 0.0


def report(run: Run, reference: Run | None) -> dict:
    teams = sorted({c.team for c in run.calls})
    rows = {}
    for t in teams:
        mine = run.team(t)
        ref = {c.agent: c.reply for c in reference.team(t)} if reference else {}
        same = all(ref.get(c.agent) == c.reply for c in mine) if reference else None
        rows[t] = {"replicas": run.placement.get(t, []), "reuse": reuse(mine), "ttft_s": sum(c.ttft_s for c in mine),
                   "replies_equal": same, "failed": sum(bool(c.failed) for c in mine)}
    total = {"reuse": reuse(run.calls), "ttft_s": sum(c.ttft_s for c in run.calls), "failed": sum(bool(c.failed) for c in run.calls),
             "retried": sum(c.retried for c in run.calls)}
    print(f"\n{run.name}: reuse {total['reuse']:.1%}, summed TTFT {total['ttft_s']:.2f} s, failed {total['failed']}, retried {total['retried']}")
    print(f"  {'team':<5} {'replicas':<9} {'reuse':>6} {'TTFT s':>7}  replies equal to one replica's")
    for t, row in rows.items():
        equal = "-" if row["replies_equal"] is None else ("yes" if row["replies_equal"] else "no")
        print(f"  {t:<5} {','.join(map(str, row['replicas'])) or '?':<9} {row['reuse']:>6.1%} {row['ttft_s']:>7.2f}  {equal}"
              + (f"  ({row['failed']} failed)" if row["failed"] else ""))
    return {"teams": rows, "total": total}


def kill_report(run: Run) -> dict:
    before = [c for c in run.calls if c.finished <= run.killed_at]
    after = [c for c in run.calls if c.finished > run.killed_at]
    out = {"killed": run.killed, "calls_before": len(before), "calls_after": len(after),
           "failed": [asdict(c) | {"reply": ""} for c in run.calls if c.failed], "retried": sum(c.retried for c in run.calls),
           "served_after": sum(not c.failed for c in after), "reuse_before": reuse(before), "reuse_after": reuse(after)}
    print(f"  kill: replica {run.killed}; {len(before)} calls before, {len(after)} after ({out['served_after']} served); "
          f"failed {len(out['failed'])}, retried {out['retried']}; reuse before {out['reuse_before']:.1%}, after {out['reuse_after']:.1%}")
    for c in run.calls:
        if c.failed:
            print(f"    failed: team {c.team} {c.agent}: {c.failed[:200]}")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--teams", type=int, default=4, help="teams of three agents (at most the pipeline's rows: 5)")
    parser.add_argument("--logs", default=None, help="folder for the replicas' and the router's logs (default: a temporary one)")
    parser.add_argument("--json", default=None, help="write the figures here")
    parser.add_argument("--skip-policies", action="store_true", help="only the one-replica run and the kill (a quick check)")
    parser.add_argument("--kill-delay", type=float, default=0.0,
                        help="seconds between the half-way call and the SIGKILL (default 0; more than the save interval "
                             "of 2 s lets the replica save what the teams taught it first)")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from kvcomm.integrations.transformers.embedded import embedded_model_dir

    pipeline = load_bundled_pipeline("review")
    if not 1 <= args.teams <= len(pipeline.inputs):
        parser.error(f"--teams must be 1..{len(pipeline.inputs)}")
    documents = [row["document"] for row in pipeline.inputs]
    tokenizer = AutoTokenizer.from_pretrained(str(embedded_model_dir()), local_files_only=True)
    teams = list(range(args.teams))
    folder = Path(args.logs or tempfile.mkdtemp(prefix="bench-replicas-"))
    results: dict = {"teams": args.teams, "agents": AGENTS, "replicas": REPLICAS, "logs": str(folder)}
    began = time.monotonic()
    with Replicas(folder / "logs", REPLICAS, policy="consistent_hash", serve_args=SERVE_ARGS, state_dir=folder / "state",
                  env=ENV) as deployment:
        print(f"{REPLICAS} replicas and the router up in {time.monotonic() - began:.0f} s; logs in {folder}", flush=True)
        deployment.stop_router()
        deployment.start_router("consistent_hash", replicas=[0])
        one = run_teams(deployment, "one replica", teams, documents, pipeline, tokenizer)
        results["one replica"] = report(one, None)
        calls = {"one replica": one}
        for policy in () if args.skip_policies else POLICIES:
            deployment.stop_router()
            deployment.start_router(policy)
            run = run_teams(deployment, policy, teams, documents, pipeline, tokenizer)
            results[policy] = report(run, one)
            calls[policy] = run
        deployment.stop_router()
        deployment.start_router("consistent_hash")
        killed = run_teams(deployment, "kill", teams, documents, pipeline, tokenizer, kill_after=len(teams) * AGENTS // 2,
                           kill_delay_s=args.kill_delay)
        results["kill"] = report(killed, one) | kill_report(killed)
        calls["kill"] = killed
        homed = [t for t, places in killed.placement.items() if killed.killed in places]
        killed.restart_s = deployment.restart(killed.killed)
        print(f"  replica {killed.killed} restarted from its --state-dir in {killed.restart_s:.0f} s; its teams {homed} run again", flush=True)
        again = run_teams(deployment, "after restart", homed, documents, pipeline, tokenizer, tenant=killed.tenant)
        calls["after restart"] = again
        results["after restart"] = report(again, one) | {"restart_s": killed.restart_s, "teams": homed,
                                                         "first_run_reuse": {t: reuse(killed.team(t)) for t in homed}}
        # the same teams' first calls in the kill run: their summarizer read the document cold
        for t in homed:
            first = killed.team(t)[0] if killed.team(t) else None
            fresh = again.team(t)[0] if again.team(t) else None
            if first and fresh:
                print(f"  team {t} summarizer: reused {first.reused}/{first.prompt} tokens in the kill run, "
                      f"{fresh.reused}/{fresh.prompt} after the restart (the same tenant, its state restored from the save)")
                print(f"    kill run: {first.note[:300]}\n    after restart: {fresh.note[:300]}")
    results["wall_s"] = time.monotonic() - began
    results["calls"] = {name: [asdict(c) for c in run.calls] for name, run in calls.items()}
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
