"""The PSD engine, grouped by where its code runs.

  async_engine.py, core.py   the engine replica's faces: asyncio streams, and the vLLM engine it owns (in process)
  settings.py, requests.py   one settings object per replica; what callers send and get back
  placement.py               which devices and CPU cores the target and the drafter use (decided at start)
  psd/                       the PSD step policy (pure; engine replica process, step thread)
  control/                   auto mode, its cost model and the per-step records (pure; engine replica process)
  drafter/                   the drafter: the engine's side, the drafter process and the shared service
  vllm_adapter/              what runs inside vLLM: its engine core (the scheduler) and its target workers
"""
