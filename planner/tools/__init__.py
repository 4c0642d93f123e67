"""User-facing tools over plans.

``validate``  every plan invariant (coverage, memory, routes, ring order, input hashes);
``compare``   the same steps planned by several planners, side by side;
``check``     the CI regression check against golden plans;
``show``      a plan rendered for a person (tables and PNG timelines).
"""
