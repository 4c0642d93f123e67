"""Playing plans out: the event-driven simulator and the measured-vs-predicted report.

``simulate``  per-rank timelines of a plan (rings, routes, NIC contention, all-reduce);
``report``    compares a run's measured metrics with the plan's predictions.

The simulator imports neither the Zeppelin planner nor the baselines: it reads plans.
"""
