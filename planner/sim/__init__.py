"""Playing plans out: the event-driven simulator and the measured-vs-predicted report.

``simulate``  per-rank timelines of a plan (rings, routes, NIC contention, all-reduce): the public
              names (:class:`~zeppelin.planner.sim.simulate.Simulator`, ``SimResult``, ...);
``engine``    the discrete-event engine (compute streams, flows with max-min fair sharing);
``layer``     the task graph of one transformer layer of a micro-batch;
``results``   the result types of a simulated step and their summary;
``report``    compares a run's measured metrics with the plan's predictions;
``summary``   the counts of a plan that ``plan``, ``show`` and ``simulate`` print.

The simulator imports neither the Zeppelin planner nor the baselines: it reads plans.
"""
