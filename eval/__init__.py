"""``kvcomm eval`` and the reports: workloads (``workloads``, ``retrieval``, ``workload_files``),
scoring (``scorers``), the runs (``evaluate``), metrics and summaries (``metrics``, ``summary``),
outputs and plots (``outputs``, ``plots``), the dense-vs-reuse table (``report``) and the demo's
figures (``demo_report``)."""
