"""The planning framework every planner plugs into.

``base``      the :class:`Planner` base class, the registry (``register``, ``get_planner``) and the
              re-exported :class:`PlanContext` / :class:`PlanningError`;
``registry``  imports every planner module by name so that each registers itself;
``sampler``   manifest -> the sequences of each training step;
``builder``   :class:`StepBuilder`, which writes a planner's placements down as a step plan;
``inputs``    cluster / model / profile resolution from preset names or JSON files;
``driver``    plans the sampled steps (optionally in worker processes) and writes the plan file.
"""
