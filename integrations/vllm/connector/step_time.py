"""kvcomm's own time per vLLM engine step, per side, as Prometheus metrics.

Each hook of the connector (``vllm.connector``) and each RPC to the workers
(``vllm.connector.worker_extension``: ``kvcomm_plan_ahead``, ``kvcomm_guard_record``) is timed with ``time.perf_counter`` (wall
seconds) and ``time.thread_time`` (CPU seconds of the calling thread: less sensitive to other
jobs on the cores than wall time, blind to time spent waiting). The times are summed per side
until the side's step ends, then observed once:

- ``worker``: ``start_load_kv``, ``wait_for_layer_load`` and ``save_kv_layer`` (every layer),
  ``wait_for_save``, ``get_finished`` (copying finished requests' captured KV out of their
  blocks) and ``build_connector_worker_meta`` (learning from finished requests and planning
  new ones). vLLM's model runner calls ``build_connector_worker_meta`` once at the end
  of every step it executes (forward or not), after the others; it ends the worker's step.
- ``scheduler``: ``get_num_new_matched_tokens``, ``update_state_after_alloc``,
  ``build_connector_meta``, ``update_connector_output``, ``request_finished``. vLLM's scheduler
  calls ``build_connector_meta`` once at the end of every ``schedule()``; it ends the
  scheduler's step, which so holds this ``schedule()``'s hooks and those run since the previous
  one ended: the previous step's ``update_from_output()`` (``update_connector_output``, the
  finished requests' ``request_finished``) and aborts handled between steps. All of it runs on
  the engine core's thread between two executions of the model.
- ``rpc``: one ``kvcomm_plan_ahead`` or ``kvcomm_guard_record`` call, each its own observation. vLLM's engine core
  runs these ``collective_rpc`` calls between steps, so each stalls the engine loop like a step
  (several may run between two steps).

Metrics (label ``side``: "worker", "scheduler", "rpc", all created at import):

- ``kvcomm_step_seconds{side}``, ``kvcomm_step_cpu_seconds{side}``: histograms of a step's
  summed wall and thread CPU seconds (``BUCKETS``: 0.1 ms to 5 s).
- ``kvcomm_step_max_seconds{side}``, ``kvcomm_step_cpu_max_seconds{side}``: the longest step
  seen by any process since the server started (gauges, ``multiprocess_mode="max"``).

The scheduler and the worker run in vLLM's engine-core and worker processes; ``kvcomm serve``
sets up Prometheus multiprocess mode before vLLM starts, so the API server's ``/metrics``
aggregates them (histogram buckets summed over processes, maxima the largest).
"""

from __future__ import annotations

import functools
import time

from prometheus_client import Gauge, Histogram

SIDES = ("worker", "scheduler", "rpc")
BUCKETS = (0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
"""Histogram bounds in seconds: 1-500 ms resolved, the 200 ms of issue 39 a bound."""

STEP_SECONDS = Histogram("kvcomm_step_seconds", "kvcomm's wall seconds in one engine step, per side", ["side"],
                         buckets=BUCKETS)
STEP_CPU_SECONDS = Histogram("kvcomm_step_cpu_seconds", "kvcomm's thread CPU seconds in one engine step, per side",
                             ["side"], buckets=BUCKETS)
STEP_MAX_SECONDS = Gauge("kvcomm_step_max_seconds", "kvcomm's longest engine step so far, wall seconds, per side",
                         ["side"], multiprocess_mode="max")
STEP_CPU_MAX_SECONDS = Gauge("kvcomm_step_cpu_max_seconds",
                             "kvcomm's longest engine step so far, thread CPU seconds, per side", ["side"],
                             multiprocess_mode="max")


class StepClock:
    """kvcomm's time in the current step of one side of this process: ``wall`` and ``cpu``
    seconds summed over the timed calls since the step began; ``longest`` and ``longest_cpu``:
    the largest step observed by this clock."""

    def __init__(self, side: str):
        self.side = side
        self.wall = self.cpu = self.longest = self.longest_cpu = 0.0
        self._seconds, self._cpu_seconds = STEP_SECONDS.labels(side), STEP_CPU_SECONDS.labels(side)
        self._max, self._cpu_max = STEP_MAX_SECONDS.labels(side), STEP_CPU_MAX_SECONDS.labels(side)

    def end_step(self) -> None:
        """Observe the step's sums and start the next step."""
        wall, cpu = self.wall, self.cpu
        self.wall = self.cpu = 0.0
        self._seconds.observe(wall)
        self._cpu_seconds.observe(cpu)
        if wall > self.longest:
            self.longest = wall
            self._max.set(wall)
        if cpu > self.longest_cpu:
            self.longest_cpu = cpu
            self._cpu_max.set(cpu)

    def timed(self, ends_step: bool = False):
        """A decorator adding each call's wall and thread CPU seconds to the step (also when it
        raises); with ``ends_step`` the call ends the step."""

        def wrap(function):
            @functools.wraps(function)
            def timed_call(*args, **kwargs):
                wall, cpu = time.perf_counter(), time.thread_time()
                try:
                    return function(*args, **kwargs)
                finally:
                    self.wall += time.perf_counter() - wall
                    self.cpu += time.thread_time() - cpu
                    if ends_step:
                        self.end_step()

            return timed_call

        return wrap


CLOCKS = {side: StepClock(side) for side in SIDES}
"""This process's clock of each side."""
