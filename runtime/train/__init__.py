"""The trainer around the step engine (:mod:`zeppelin.runtime.executor`), one component a module:

* ``settings``: every value taken from the plan or a flag, resolved once, with one rule for a flag
  that differs from what the plan was made for;
* ``checks``: the start-up checks every rank makes before any collective, and each step's;
* ``job``: the process group, the agreed start, the model and executor (:func:`job.run_job`);
* ``loop``: the training loop, which hands each step to the components below;
* ``metrics``: the per-step record and its sinks (JSON Lines, TensorBoard, progress, warnings);
* ``verify``: ``--verify``, the single-process reference comparison;
* ``checkpointing``: the checkpoint directory's lock, ``--resume`` and the saves.

This package's own module imports nothing (``settings`` is read by the command line before any
process starts, without torch).
"""
