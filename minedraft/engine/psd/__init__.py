"""Batch-parallel speculative decoding's step policy: pure decisions over plain data (no vLLM, no I/O, no clocks).

Runs in the engine replica's process, on its step thread, called by the vLLM adapter's scheduler
(vllm_adapter/scheduler.py) once per step; the digital twin (minedraft.twin) runs the same code in simulated time.

  core.py      SpeculationCore: the step (schedule -> decision, update -> record) that the vLLM scheduler, the twin
               and the tests drive; owns the planner, wait policy, auto controller, statistics
  events.py    DraftSource (the drafter link's surface) and the drafter's events the core consumes
  planner.py   PSDPlanner: which sub-batch a step verifies, with which drafts, how long it may wait for them
               (WaitPolicy), and what the next draft job sends
  subbatch.py  SubBatches: who is in which of the two sub-batches, where newcomers go, how balance is restored
  inflight.py  InFlight: the one record of draft jobs in flight (written by the drafter link, read by the planner)
"""
