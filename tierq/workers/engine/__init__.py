"""The engine a worker hosts: the interface (`base.py`), vLLM (`vllm_engine.py`) with tierq's
scheduler inside it (`vllm_scheduler.py`), the simulated engine and the fault injector, the
bundled model, and the one builder of vLLM's engine arguments (`vllm_args.py`). Nothing in
`tierq/api/` or `tierq/dispatcher/` imports it."""
