"""Lookahead against sd on the local CPU pair, in one engine, interleaved, with the target's core lending as asked.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/lookahead_cpu.py --modes sd,lookahead,sd,lookahead [--lend]

Per mode and concurrency (1 and 4 requests of 64 greedy tokens): tokens per second, steps, and per step the
verification, the branch (or draft) job, the wait for it, lookahead's hits / backups / bare misses and the branch
job's shape (fan-out, depth). `minedraft bench` lets sd's target widen onto the drafter's cores while nothing drafts
(lend_drafter_cores): on a machine where another process uses those cores that verification slows several times over,
so this script runs without lending by default to compare the modes themselves.
"""

from __future__ import annotations

import argparse
import statistics
import time

from minedraft.bench.workload import bench_prompts
from minedraft.engine.core import Engine
from minedraft.engine.requests import SamplingSettings
from minedraft.engine.settings import DrafterSettings, EngineSettings, Mode, default_core_split
from minedraft.models.spec import default_pair_dir
from tests.component.driver import Planned, drive


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--modes", default="sd,lookahead,sd,lookahead")
    parser.add_argument("--concurrency", default="1,4")
    parser.add_argument("--fanout", type=int, default=4)
    parser.add_argument("--lend", action="store_true", help="let the target widen onto the drafter's cores")
    args = parser.parse_args()
    pair = default_pair_dir()
    target_cores, drafter_cores = default_core_split()
    engine = Engine(EngineSettings(
        model=str(pair / "target"),
        drafter=DrafterSettings(model=str(pair / "draft"), cpu_cores=drafter_cores, backend="torch"),
        mode=Mode.LOOKAHEAD, num_speculative_tokens=3, max_num_seqs=8, max_model_len=512, kv_cache_gib=1,
        target_cpu_cores=target_cores, dtype="float32", lookahead_fanout=args.fanout, lend_drafter_cores=args.lend))
    assert engine.wait_for_drafter(300)
    core = engine.psd_scheduler.core
    plan_lookahead = core.planner._plan_lookahead
    kinds: list[tuple[int, int, int]] = []

    def spy(requests, pad, tokens):  # type: ignore[no-untyped-def]
        plan = plan_lookahead(requests, pad, tokens)
        misses = len(plan.branch_misses) - len(plan.backups)
        kinds.append((len(plan.branches) - len(plan.backups), len(plan.backups), misses))
        return plan

    core.planner._plan_lookahead = spy
    prompts = [engine.encode_prompt(text) for text in bench_prompts(pair, 8, chars=160)]
    for concurrency in (int(c) for c in args.concurrency.split(",")):
        for name in args.modes.split(","):
            engine.set_mode(Mode(name), 3)
            records = engine.step_records()
            first = records[-1].step if records else 0
            kinds.clear()
            started = time.perf_counter()
            run = drive(engine, [Planned(f"{name}-{concurrency}-{i}-{time.monotonic_ns()}", prompts[i],
                                         SamplingSettings(max_tokens=64, ignore_eos=True))
                                 for i in range(concurrency)])
            seconds = time.perf_counter() - started
            steps = [r for r in engine.step_records(first) if r.num_decode_requests]
            tokens = sum(len(c.token_ids) for c in run.completions.values())

            def ms(values: list[float]) -> float:
                return round(1000 * statistics.mean(values), 2) if values else 0.0

            line = (f"concurrency {concurrency} {name}: {tokens / seconds:.1f} tok/s, {len(steps)} steps; per step "
                    f"verify {ms([r.verify_seconds for r in steps])} ms, job {ms([r.draft_seconds for r in steps])} "
                    f"ms, wait {ms([r.wait_seconds for r in steps])} ms, step {ms([r.step_seconds for r in steps])} "
                    f"ms")
            if name == Mode.LOOKAHEAD.value:
                hits, backups, misses = (sum(k[i] for k in kinds) for i in range(3))
                shapes = [(r.lookahead_fanout, r.lookahead_depth) for r in steps if r.lookahead_fanout]
                line += f"; hits {hits}, backups {backups}, bare misses {misses}; shapes {shapes[-6:]}"
            print(line, flush=True)
    engine.shutdown()


if __name__ == "__main__":
    main()
