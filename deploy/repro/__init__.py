"""``stargym repro``: findings of RAGEN and AgentGym-RL rerun at CPU scale, with plots and a report.

:mod:`deploy.repro.findings` says what each finding compares (arms: a recipe and its overrides)
and what the paper saw; :mod:`deploy.repro.analysis` reads the runs back (collapse step, echo-trap
warnings, held-out success); :mod:`deploy.repro.report` draws the curves and writes ``report.md``;
:mod:`deploy.repro.command` runs the arms through the real services and ties it together.
"""
