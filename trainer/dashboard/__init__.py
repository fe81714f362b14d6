"""The trainer dashboard: live charts, the system view, the trajectory viewer and the runs of a runs dir.

Served by the trainer on its port (``/``) and by ``stargym dashboard RUNS_DIR`` for finished runs;
it only reads what the trainer already writes into each run directory (docs/architecture.md,
"Dashboard").
"""
