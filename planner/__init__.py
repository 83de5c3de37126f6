"""roofplan's planner core: model configs, the layer graph, the memory timeline, the time model.

Imports only ``hardware``. ``search`` and ``validate`` build on it, and the app layer
(``roofplan``: the API, the commands, the report) sits on top of all of them.
"""
