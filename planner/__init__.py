"""roofplan's planner core: model configs, the layer graph, the memory timeline, the time model.

Imports only ``hardware``. The façade (``planner.api``) and the CLI sit on top and import
``search`` / ``validate`` lazily, so they are not re-exported here.
"""
