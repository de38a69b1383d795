"""Everything about drafting, grouped by the process each module runs in.

In the engine replica's process (the scheduler's step thread), the engine's side of the drafter:
  link.py      DrafterLink: the job in flight per sub-batch, bounded waits, hang detection and restarts
  client.py    DrafterClient: starts, talks to and watches a local drafter process (a child, over ZMQ)
  remote.py    RemoteDrafterClient: the same calls over an authenticated TCP session to a shared drafter service

In the drafter process (`python -m minedraft.engine.drafter.process`, a child of the engine replica):
  process.py       DrafterServer (the message loop: token deltas in, drafts out) and the process's main
  backends.py      the backends' job interface and the choice of one (make_drafter); TorchDrafter
  vllm_backend.py  VllmDrafter: the draft model in an in-process vLLM engine, with prefix caching
  torch_backend.py the plain-torch greedy model that keeps each request's KV cache between jobs
  torch_window.py  its context-bounded variant (drafts long contexts from a window)

In the shared drafter service's process (`minedraft drafter`, many engine replicas):
  service.py   ServiceCore and serve(): sessions, batching across engines, fair order; reuses process.py's loop
               and the same backends

On both sides of a connection:
  protocol.py  the job protocol's messages (msgpack): what the engine and any drafter exchange
  wire.py      the shared service's session handshake (HMAC challenge-response), heartbeats and backpressure
"""
