"""How the engine chooses its mode (ar, sd or psd) and k, and the per-step records it chooses from: pure, plain data.

Runs in the engine replica's process: the vLLM adapter's scheduler records each step (stats.py) and asks auto mode
for its decision on the step thread; the server reads the totals for its metrics; the digital twin (minedraft.twin)
and the autoscaler's replica model run the same policy without an engine.

  auto.py        AutoController: the online choice of mode and k, with hysteresis and cheap probes
  cost_model.py  CostModel: what each way of decoding would yield now, predicted from measured step costs
  stats.py       StepRecord, EngineTotals, StatsRecorder: what each step did, and the overlap fraction's definition
"""
