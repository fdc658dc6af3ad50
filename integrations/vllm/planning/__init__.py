"""Server-side planning, in vLLM's worker process (the one that holds the KV cache).
``server_planner.ServerPlanner``: one ``ReuseEngine`` per tenant, plans made in the engine step
or ahead of it, learning when a request finishes; ``worker_plans.WorkerPlans``: answers the
scheduler side's ``PlanAsk`` messages and places each plan's KV on the channel; ``guard``: the
quality guard per tenant; ``segment_ids`` and ``run_index``: client segment ids bound to their
content and shared segments detected in unannotated prompts; ``planner_state``: saves across
restarts; ``metrics`` and ``host_memory``. Imports ``wire``, never ``connector``."""
